#!/bin/bash
# One device call: the stacked-KDA test compiled (fixed tolerance), the MoE
# decode tile sweep under inference_mode, then the fused decode step (MXFP4 experts, batch
# 1 / 64 / 256) with the sweep's table.
#
#   source .devcarry/setup.sh; bash scripts/gpu/moe_tiles_decode.sh "$OUT"
source "$(dirname "$0")/run_lib.sh" "${1:-}"
step "compiled: stacked KDA prefill + l2norm tests"
timeout 40 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_prefill_triton.py \
  -k "stacked or l2norm" --tb=short 2>&1 | tail -25
step "MoE decode tiles sweep (inference_mode; T 1/64/256 x top-8)"
timeout 60 python3 benchmarks/gpu_moe_tiles.py --out "$OUT" --budget-s 45
[ -s "$OUT/moe_tiles_best.json" ] || echo '{}' > "$OUT/moe_tiles_best.json"
step "decode: fused 1, MXFP4, batch 1/64/256, tiles from the sweep"
timeout 110 python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-prefill --gpu-init \
  --fused 1 --experts mxfp4 --iters 10 --moe-tiles "$OUT/moe_tiles_best.json" 2>&1 | grep -v "^   "
step "done"
