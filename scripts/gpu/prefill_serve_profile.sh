#!/bin/bash
# One device call: prefill profile (base vs fused) + MoE / SDPA micro-benchmarks,
# then the disaggregated HTTP stack (gpu_serve.py) with host staging.
source "$(dirname "$0")/run_lib.sh" "${1:-}"
timeout ${PROF_T:-100} python3 benchmarks/gpu_prefill_profile.py --out "$OUT" > "$OUT/profile.log" 2>&1
echo "=== profile done at $(( $(date +%s) - t0 )) s"
timeout ${SERVE_T:-150} python3 benchmarks/gpu_serve.py --out "$OUT" --requests 4 --gen-tokens 32 \
  > "$OUT/serve.log" 2>&1
echo "=== serve done at $(( $(date +%s) - t0 )) s"
(cd /tmp/k3serve-logs 2>/dev/null && tar czf "$OUT/stacklogs.tgz" . )
grep -v -e '^I1' -e '^W1' "$OUT/profile.log" | tail -150
tail -25 "$OUT/serve.log"
