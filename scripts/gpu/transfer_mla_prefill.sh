#!/bin/bash
# One device call: KV transfer GB/s between two processes' GPU pools (direct TE vs
# host staging), MLA prefill naive vs SDPA at 2k / 8k prompts, and the GPU fast-path check (the GPU pytest:
# fast path == reference within bf16 tolerance, MXFP4 == dequantised-bf16 experts).
#
#   source .devcarry/setup.sh; cd <this checkout>; bash scripts/gpu/transfer_mla_prefill.sh "$OUT"
#
# Writes into OUT (7 files): run.log, env.txt, transfer_direct.json, transfer_host.json,
# fastpath.json, gpu_e2e.json, gpu_e2e.md. Every step has its own time limit so a
# slow one leaves the others' results.
source "$(dirname "$0")/run_lib.sh" "${1:-}"

step "transfer: k3-mini, GPU pools, direct TE (GPU memory registered)"
timeout 70 python3 benchmarks/transfer.py --presets k3-mini --reps 3 --device cuda \
  --staging direct --json "$OUT/transfer_direct.json" 2>&1 | grep -v -e '^I1' -e '^W1'
step "transfer: k3-mini, GPU pools, host staging"
timeout 50 python3 benchmarks/transfer.py --presets k3-mini --reps 3 --device cuda \
  --staging host --json "$OUT/transfer_host.json" 2>&1 | grep -v -e '^I1' -e '^W1'

step "MLA prefill: naive vs sdpa (k3-mini, 1x2048, 1x8192, 8x8192)"
timeout 180 python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-decode --gpu-init \
  --mla-prefill naive,sdpa

step "fast path check: tests/gpu (fast path vs reference, MXFP4 vs bf16 experts)"
K3SERVE_GPU_REPORT="$OUT/fastpath.json" timeout 180 python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/gpu -x -s --timeout 170 2>&1 | grep -v '^  *"' | tail -60
step "done"
