#!/usr/bin/env bash
# make gpu-wheels: the pure-Python (and a few small binary) cp312 wheels the engine needs on the GPU machine this
# project is lent, which has no network and its own Python 3.12 with a CUDA torch, numpy, safetensors, tokenizers,
# pyarrow, pandas, xxhash, pytest and more, but not pydantic, zarr, prefect and what they need
# (benchmarks/gpu/requirements.txt: prefect 3.8.8, zarr 3.1, datasets 5, pydantic 2.14 resolved for cp312, minus
# what that image holds; the runs use tracking_uri=none and a local store, so no MLflow and no s3fs), and bitsandbytes
# (constraints.txt's version: optim.name=adamw8bit-bf16, gpu-check's light_rows) trimmed to its Python package and
# the native libraries of CUDA 12.8/12.9 and 13.x (benchmarks/gpu/trim_wheel.py: 41 MB -> 10 MB), since the whole
# wheel would not fit what travels. Into .whl/ (git-ignored), about 54 MiB: what travels to that machine is capped
# at 64 MiB, and this refuses more.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${GPU_WHEELS:-.whl}
PYVER=${GPU_PYVER:-3.12}
LIMIT_MIB=${GPU_CARRY_MIB:-64}
# bitsandbytes' native libraries kept: the CPU's, CUDA 12.8's (for 12.8 and 12.9), 13.0's (for every 13.x)
BNB_LIBS=${GPU_BNB_LIBS:-cpu cuda128 cuda130}
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" -r benchmarks/gpu/requirements.txt

# bitsandbytes: the version the project pins, its manylinux x86_64 wheel (py3-none) fetched aside, repacked trimmed
BNB=$(sed -n 's/^bitsandbytes==//p' constraints.txt)
[ -n "$BNB" ] || { echo "gpu-wheels: constraints.txt pins no bitsandbytes" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" "${PLATFORMS[@]}" \
  -d "$TMP" "bitsandbytes==$BNB"
rm -f "$DEST"/bitsandbytes-*.whl
# shellcheck disable=SC2086
python3 benchmarks/gpu/trim_wheel.py "$TMP"/bitsandbytes-"$BNB"-*.whl "$DEST" $BNB_LIBS

BYTES=$(find "$DEST" -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')
# the checkout travels too (its tracked and untracked files, not the ignored ones): counted with the wheels
TREE=$(git ls-files -z --cached --others --exclude-standard 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(mib "$BYTES") MiB in $DEST/, $(mib $((BYTES + TREE))) MiB with the" \
  "checkout (at most $LIMIT_MIB MiB travel to the GPU machine; make gpu-check installs them)"
if [ $((BYTES + TREE)) -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu-wheels: $DEST/ and the checkout hold $(mib $((BYTES + TREE))) MiB, over the $LIMIT_MIB MiB that travel" >&2
  exit 1
fi
