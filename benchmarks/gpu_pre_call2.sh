#!/bin/bash
# Issue 11 prefill, the run still owed (helper "pre" had no device time left for it):
# correctness of this tree's prefill path on the GPU, then the prefill rows, then the served stack.
#
#   source .devcarry/setup.sh; cd <this checkout>; bash benchmarks/gpu_pre_call2.sh "$OUT"
#
# ~150 s on a warm H200 (pytest ~45 s, gpu_e2e prefill ~35 s, gpu_serve ~75 s); each step has
# its own limit so a slow one leaves the others' results. Writes run.log, gpu_e2e.json,
# RESULTS_gpu_e2e.md, gpu_serve.json, serve.md into OUT.
set -u
OUT=${1:?usage: gpu_pre_call2.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
exec > >(tee -a "$OUT/run.log") 2>&1
t0=$(date +%s)
step() { echo "=== $(( $(date +%s) - t0 )) s: $*"; }
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step "correctness: must-show 1 (sublayer-forced fast path == reference) + prefill kernels at k3-mini sizes"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/kernels/test_prefill_triton.py \
  -x --timeout 85 2>&1 | grep -v '^  *"' | tail -30
step "prefill rows (SDPA MLA prefill, fused prefill kernels)"
timeout 60 python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-decode --gpu-init \
  --mla-prefill sdpa --prefill-shapes 1x2048,1x8192,8x8192
step "served stack (host staging)"
timeout 100 python3 benchmarks/gpu_serve.py --out "$OUT" --requests 4 --gen-tokens 32 | tail -8
step "done"
