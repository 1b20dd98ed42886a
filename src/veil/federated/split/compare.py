"""Every split protocol on the same tasks and budget: central, FL, SL, FeSTA, p-FeSTA
(multi-task) and single-task p-FeSTA per task -> RUN_DIR/compare.json (the paper's Table IV/V)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veil.federated.split.run import run_split
from veil.federated.split.spec import SplitSpec, split_spec_from_raw
from veil.io import atomic_write_text


def variant(spec: SplitSpec, **changes: Any) -> SplitSpec:
    """`spec` with `split` keys changed; a protocol other than p-FeSTA runs without the permutation
    defense (it is p-FeSTA's module: `veil.federated.split.spec.check_defenses`)."""
    raw = {**spec.raw, "split": {**spec.raw["split"], **changes}}
    if raw["split"]["protocol"] != "pfesta":
        raw["defense"] = []
    return split_spec_from_raw(raw)


def cached_run(spec: SplitSpec, out: Path) -> dict[str, Any]:
    """Reuse a finished run folder with the same resolved config; run otherwise."""
    if (
        (out / "summary.json").is_file()
        and (out / "config.yaml").is_file()
        and (out / "config.yaml").read_text() == spec.text()
    ):
        return json.loads((out / "summary.json").read_text())
    return run_split(spec, out, progress=True)


def compare(spec: SplitSpec, run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    runs: dict[str, dict[str, Any]] = {}
    for proto in ("central", "fl", "sl", "festa", "pfesta"):
        runs[proto] = cached_run(variant(spec, protocol=proto), run_dir / proto)
    runs["central-frozen-head"] = cached_run(
        variant(spec, protocol="central", freeze_head=True), run_dir / "central-frozen-head"
    )
    if spec.split.task_scale and len(spec.split.tasks) > 1:
        runs["pfesta-equal-scale"] = cached_run(
            variant(spec, protocol="pfesta", task_scale={}), run_dir / "pfesta-equal-scale"
        )
    for t in spec.split.tasks:
        runs[f"pfesta-single-{t}"] = cached_run(
            variant(spec, protocol="pfesta", tasks=[t]), run_dir / f"pfesta-single-{t}"
        )
    table = {
        "tasks": list(spec.split.tasks),
        "metric_names": runs["pfesta"]["metric_names"],
        "metrics": {name: r["metrics"] for name, r in runs.items()},
        "bytes_per_client": {name: r.get("bytes_per_client") for name, r in runs.items() if "bytes_per_client" in r},
        "paper_bytes_per_client": runs["pfesta"]["paper_bytes_per_client"],
        "seconds": {name: r["seconds"] for name, r in runs.items()},
    }
    b = table["bytes_per_client"]
    table["pfesta_below_half_festa"] = b["pfesta"] < 0.5 * b["festa"]
    table["pfesta_below_sl"] = b["pfesta"] < b["sl"]
    atomic_write_text(run_dir / "compare.json", json.dumps(table, indent=2))
    return table
