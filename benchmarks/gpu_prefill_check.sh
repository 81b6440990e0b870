#!/bin/bash
# Issue 11 prefill, the run still owed:
# correctness of this tree's prefill path on the GPU, then the prefill rows, then the served stack.
#
#   source .devcarry/setup.sh; cd <this checkout>; bash benchmarks/gpu_prefill_check.sh "$OUT"
#
# ~150 s on a warm H200 (pytest ~45 s, gpu_e2e prefill ~35 s, gpu_serve ~75 s); each step has
# its own limit so a slow one leaves the others' results. Writes run.log, gpu_e2e.json,
# RESULTS_gpu_e2e.md, gpu_serve.json, serve.md into OUT.
source "$(dirname "$0")/gpu_run_lib.sh" "${1:-}"
step "correctness: must-show 1 (sublayer-forced fast path == reference) + prefill kernels at k3-mini sizes"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/kernels/test_prefill_triton.py \
  -x --timeout 85 2>&1 | grep -v '^  *"' | tail -30
step "prefill rows (SDPA MLA prefill, fused prefill kernels)"
timeout 60 python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-decode --gpu-init \
  --mla-prefill sdpa --prefill-shapes 1x2048,1x8192,8x8192
step "served stack (host staging)"
timeout 100 python3 benchmarks/gpu_serve.py --out "$OUT" --requests 4 --gen-tokens 32 | tail -8
step "done"
