#!/usr/bin/env bash
# make gpu-wheels: the pure-Python (and a few small binary) cp312 wheels the engine needs on the GPU machine this
# project is lent, which has no network and its own Python 3.12 with a CUDA torch, numpy, safetensors, tokenizers,
# pyarrow, pandas, xxhash, pytest and more, but not pydantic, zarr, prefect and what they need
# (benchmarks/gpu/requirements.txt: prefect 3.8.8, zarr 3.1, datasets 5, pydantic 2.14 resolved for cp312, minus
# what that image holds; the runs use tracking_uri=none and a local store, so no MLflow and no s3fs). Into .whl/
# (git-ignored), about 44 MB: what travels to that machine is capped at 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${GPU_WHEELS:-.whl}
PYVER=${GPU_PYVER:-3.12}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any \
  -d "$DEST" -r benchmarks/gpu/requirements.txt
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST/ (carry it to the GPU machine; make gpu-check installs them)"
