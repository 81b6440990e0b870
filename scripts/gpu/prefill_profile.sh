#!/bin/bash
# One device call: the new prefill kernels compiled (stacked KDA prefill,
# q/k L2 norm, MoE tiles), prefill 1x8192 / 8x8192 with a profile of 1x8192 (host syncs,
# kernels, GPU busy), then the decode-size MoE tile sweep.
#
#   source .devcarry/setup.sh; bash scripts/gpu/prefill_profile.sh "$OUT"
source "$(dirname "$0")/run_lib.sh" "${1:-}"
step "compiled: new prefill / MoE-tile tests"
timeout 45 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_prefill_triton.py \
  tests/model/test_moe_grouped.py -k "stacked or l2norm or tiles or k3mini" 2>&1 | tail -4
step "prefill (sdpa): 1x8192, 8x8192; profile 1x8192"
timeout 95 python3 benchmarks/gpu_e2e.py --out "$OUT" --skip-check --skip-decode --gpu-init \
  --mla-prefill sdpa --prefill-shapes 1x8192,8x8192 --prefill-profile 1x8192
step "MoE decode tiles sweep (T 1/64/256 x top-8)"
timeout 75 python3 benchmarks/gpu_moe_tiles.py --out "$OUT" --budget-s 60
step "done"
