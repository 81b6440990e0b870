#!/bin/bash
# One device call: the fused decode kernels compiled (tests/kernels), the GPU fast-path check
# (tests/gpu: fast path == reference within bf16 tolerance, through the fused decode step), and the k3-mini decode step at batch 1 / 64 /
# 256 with K3SERVE_FUSED_DECODE=0 (before) and 1 (after), graphs and eager, MXFP4 and bf16
# experts, kernels per replayed step.
#
#   source .devcarry/setup.sh; cd <this checkout>; bash scripts/gpu/decode_fused.sh "$OUT"
#
# Writes into OUT: run.log, env.txt, fastpath.json, gpu_e2e.json, gpu_e2e.md.
source "$(dirname "$0")/run_lib.sh" "${1:-}"
step "decode: K3SERVE_FUSED_DECODE=0 and 1 (k3-mini, batch 1/64/256)"
timeout ${T_E2E:-300} python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-prefill --gpu-init \
  --fused ${FUSED:-0,1} --iters ${ITERS:-20} 2>&1 | grep -v "^   "
step "fused decode kernels, compiled (tests/kernels/test_fused_decode.py + the decode kernels)"
timeout ${T_KERN:-150} python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_fused_decode.py \
  tests/kernels/test_kernels_triton.py -k "not chunk" 2>&1 | tail -15
step "fast path check: tests/gpu through the fused decode step"
K3SERVE_GPU_REPORT="$OUT/fastpath.json" timeout ${T_GPU:-120} python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/gpu -x -s 2>&1 | grep -v '^  *"' | tail -30
step "done"
