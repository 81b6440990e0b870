#!/bin/bash
# Train the embedded k3-tiny on a GPU machine and score it on the held-out files, in one go.
#
# Prepare here (once), so the GPU scores exactly this box's held-out bytes (Ubuntu's 3.12.3
# differs from 3.11/3.12.1 in 6 of the 40 files; training excludes them by path either way):
#     python scripts/stdlib_data.py --export-heldout .heldout/stdlib   # .heldout/ is git-ignored
# Then on the GPU machine (device tool: carry .heldout), with $OUT the folder that comes back:
#     bash scripts/device_train.sh MINUTES [extra train_tiny.py arguments]
# Writes $OUT/k3-tiny/ (checkpoint + training.json), $OUT/train.log, $OUT/eval.{log,json}.
# The shipped checkpoint came from: bash scripts/device_train.sh 4.5 --batch-size 128
set -u
export PYTHONUNBUFFERED=1 K3SERVE_KERNELS=torch
MIN=${1:-4.5}; shift || true
OUT=${OUT:-out}
python3 -c "import sys,torch,sysconfig;print(sys.version.split()[0],torch.__version__,sysconfig.get_paths()['stdlib'])"
python3 - <<'PY'
import filecmp, pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
for p in sorted(pathlib.Path(".heldout/stdlib").rglob("*.py")):
    rel = p.relative_to(".heldout/stdlib"); q = root / rel
    if not q.exists() or not filecmp.cmp(p, q, shallow=False):
        print("held-out file differs here:", rel, p.stat().st_size, q.stat().st_size if q.exists() else None)
PY
python3 scripts/train_tiny.py --device cuda --minutes "$MIN" --out "$OUT/k3-tiny" "$@" 2>&1 \
  | tee "$OUT/train.log" | tr '\r' '\n' | grep -v '^train:'
tr '\r' '\n' < "$OUT/train.log" | grep '^train:' | awk 'NR%15==0' | tail -12
python3 scripts/eval_bpb.py --model "$OUT/k3-tiny" --device cuda --stdlib .heldout/stdlib --batch-size 64 \
  --json "$OUT/eval.json" 2>&1 | tr '\r' '\n' | grep -v '^scoring' | tee "$OUT/eval.log"
