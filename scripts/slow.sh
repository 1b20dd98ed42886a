#!/usr/bin/env bash
# Every test marked slow: the span batch 8/12/16 regressions, the deployments killed and resumed,
# the Ray runs, the DP registry's every-model checks. CI runs only the ci_slow subset of them
# (.ci/run); run this before a release or after changing what these tests cover.
# Usage: scripts/slow.sh [pytest args], e.g. scripts/slow.sh tests/test_deploy.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_TELEMETRY_ENABLED=0
exec python -m pytest -q -m slow "$@"
