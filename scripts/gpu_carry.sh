#!/bin/bash
# Build the folder that the device tool carries to the H200 for benchmarks/gpu_*.py and
# scripts/gpu/*.sh
# (the device image has torch / triton but none of the serving stack, no fla-core, no Mooncake,
# and reaches no registry). Run it HERE, in the checkout that the device tool ships, then name
# the folder in the run's `carry` and start the device command with `source .devcarry/setup.sh`.
#
#   bash scripts/gpu_carry.sh [SRC_WORKTREE]        # default: this checkout
#
# Produces (git-ignored through .git/info/exclude; ~17 MB, under the 64 MiB carry limit with
# the tree):
#   .devcarry/whl/        cp312 wheels: WHEELS below (fla-core 0.6.0, the HTTP stack, pydantic,
#                         jsonschema, msgspec, setproctitle, prometheus-client, aiohttp and
#                         their dependencies)
#   .devcarry/mc.tar.xz   mooncake-transfer-engine-cuda13 0.3.14 slimmed to the transfer engine:
#                         mooncake/{__init__.py,engine.so,libetcd_wrapper.so,libasio.so} and the
#                         wheel's glog/gflags/yaml-cpp/jsoncpp, stripped (the 50 MB wheel with
#                         the tree exceeds the carry limit; Store / EP / PG / bench binaries
#                         are most of it)
#   .devcarry/debs/       libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1
#   .devcarry/gpu/        a copy of SRC_WORKTREE's files (tracked + untracked, big data left out)
#   .devcarry/setup.sh    installs the wheels to /tmp/site, unpacks the rest, sets PYTHONPATH /
#                         LD_LIBRARY_PATH and cds into .devcarry/gpu
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
SRC=${1:-$ROOT}
D=$ROOT/.devcarry
grep -qx '/.devcarry/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/.devcarry/' >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$D/whl" "$D/debs"
T=$(mktemp -d)
PIP=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform any)
# What the serving path imports beyond the device image's packages (ON_IMAGE), with their
# dependencies; tests/test_gpu_carry.py checks that every third-party import of the runtime
# packages is in one of the two lists.
WHEELS=(fla-core==0.6.0 fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv
  annotated-types typing-inspection typing-extensions uvicorn sse-starlette tenacity pybreaker
  llguidance opentelemetry-api aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict
  propcache yarl idna jsonschema jsonschema-specifications referencing rpds-py msgspec
  setproctitle prometheus-client httptools)
# On the device image (its PyTorch / Hugging Face stack): not carried.
ON_IMAGE=(torch triton numpy safetensors tokenizers jinja2 httpx pyyaml tqdm uvloop)
"${PIP[@]}" -q -d "$D/whl" "${WHEELS[@]}"
"${PIP[@]}" -q -d "$T" mooncake-transfer-engine-cuda13==0.3.14
(cd "$T" && mkdir x slim && cd x && unzip -q ../mooncake_transfer_engine_cuda13-*.whl \
  && mkdir -p ../slim/mooncake ../slim/mooncake_transfer_engine_cuda13.libs \
  && cp mooncake/__init__.py mooncake/engine.so mooncake/libetcd_wrapper.so mooncake/libasio.so \
        ../slim/mooncake/ \
  && cp mooncake_transfer_engine_cuda13.libs/{libglog,libgflags,libyaml-cpp,libjsoncpp}-* \
        ../slim/mooncake_transfer_engine_cuda13.libs/ \
  && strip --strip-unneeded ../slim/mooncake/*.so ../slim/mooncake_transfer_engine_cuda13.libs/* \
  && cd ../slim && tar cJf "$D/mc.tar.xz" .)
(cd "$D/debs" && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 \
  libnuma1 2>/dev/null)
rm -rf "$D/gpu" && mkdir -p "$D/gpu"
(cd "$SRC" && git ls-files -co --exclude-standard \
  | grep -v -E '^(tests/data/|traces/|k3serve/assets/k3-tiny/model.safetensors|docs/.*\.png|docs/results/)' \
  | tar cf - -T - | tar xf - -C "$D/gpu")
cat > "$D/setup.sh" <<'EOF'
# sourced from the repo root on the device: wheels, mooncake (slimmed, unpacked), debs
C=$PWD/.devcarry
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $C/whl/*.whl 2>&1 | tail -3
mkdir -p /tmp/mc /tmp/debs
tar xJf $C/mc.tar.xz -C /tmp/mc
for f in $C/debs/*.deb; do dpkg -x $f /tmp/debs; done
export PYTHONPATH=$C/gpu:/tmp/site:/tmp/mc
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
# the embedded checkpoint is left out of the copy (the carry's size limit): the shipped tree has it
W=k3serve/assets/k3-tiny/model.safetensors
[ -e $C/gpu/$W ] || { [ -e $C/../$W ] && cp $C/../$W $C/gpu/$W; }
cd $C/gpu
EOF
rm -rf "$T"
du -sh "$D"
