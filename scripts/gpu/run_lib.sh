# Sourced by the scripts/gpu/*.sh device scripts (one device call each; run from the repo root):
#   source "$(dirname "$0")/run_lib.sh" "$1"
# Sets OUT (the first argument; created), tees everything to OUT/run.log, defines `step MSG`
# (elapsed seconds + MSG) and writes the card, driver and versions to OUT/env.txt.
set -u
OUT=${1:?usage: $(basename "$0") OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
exec > >(tee -a "$OUT/run.log") 2>&1
t0=$(date +%s)
step() { echo "=== $(( $(date +%s) - t0 )) s: $*"; }
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import mooncake.engine; print("mooncake TE import ok")' 2>/dev/null \
    || echo "mooncake TE not importable"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
