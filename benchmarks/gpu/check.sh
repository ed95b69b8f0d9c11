#!/usr/bin/env bash
# make gpu-check: the prepared GPU check (benchmarks/gpu_check.py) into OUT (default gpu-check-out): gpu_check.json,
# gpu_check.md, the GPU tests' JUnit XML and the visits' raw figures (streaming.json), at most 8 files (what a lent
# machine sends back). Under 5 minutes on one H100/H200 by the check's own estimate: its sections share a budget of
# GPU_BUDGET seconds (default 270; benchmarks/gpu_check.py SECTIONS), the wheels' install takes seconds, so a lent
# GPU's 15 minutes hold the machine's start, this and a rerun. Arguments after OUT go to benchmarks/gpu_check.py.
#
# Which Python: the project's .venv where its torch sees CUDA; else the machine's python3 (SYS_PY) where its torch
# does. The GPU machine this project is lent has no network and its own python3 (3.12, a CUDA torch) that lacks
# pydantic, zarr, prefect and the rest: `make gpu-wheels` here fetches those wheels into .whl/ (carried there), and
# this script installs them with --no-deps --target into GPU_SITE (/tmp/bcdflow-gpu-site: not under OUT, which sends
# back a few files); the project runs from the checkout itself.
# No CUDA anywhere and no GPU on the machine: a smoke run of the same code at tiny shapes on the CPU (exit 0, no GPU
# figures). A GPU on the machine but no Python with a CUDA torch: exit 2, naming the Pythons tried.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-check-out}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$OUT"
BUDGET=${GPU_BUDGET:-270}
WHEELS=${GPU_WHEELS:-.whl}
SYS_PY=${SYS_PY:-python3}
cuda_ok() { [ -x "$(command -v "$1")" ] && "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || ls /dev/nvidia0 >/dev/null 2>&1; }

unset PYTORCH_CUDA_ALLOC_CONF  # the allocator a run gets
export CUDA_MODULE_LOADING=LAZY TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PREFECT_HOME=${PREFECT_HOME:-$(mktemp -d)/prefect}  # before any import of prefect (it reads it then)

tried=()
PY=""
for cand in .venv/bin/python "$SYS_PY"; do
  tried+=("$cand")
  if cuda_ok "$cand"; then PY=$cand; break; fi
done

if [ -z "$PY" ]; then
  if gpu_present; then
    echo "gpu-check: this machine has a GPU, but no Python here has a CUDA torch (tried: ${tried[*]}; set SYS_PY)" >&2
    exit 2
  fi
  [ -x .venv/bin/python ] || make setup >/dev/null || exit 2
  echo "gpu-check: no GPU on this machine: a smoke run of the same code on the CPU (no GPU figures are taken)"
  exec .venv/bin/python -m benchmarks.gpu_check "$OUT" --smoke "$@"
fi

NEED="pydantic, zarr, prefect"
ls "$WHEELS"/bitsandbytes-*.whl >/dev/null 2>&1 && NEED="$NEED, bitsandbytes"  # the light sections' (make gpu-wheels)
if [ "$PY" != .venv/bin/python ] && ! "$PY" -c "import $NEED, bcdflow.tasks.engine" >/dev/null 2>&1; then
  # the wheels, with --target beside the machine's own packages (its CUDA torch above all), nothing resolved; the
  # project runs from this checkout (bcdflow/__init__.py: its layers are the repository's folders), so PYTHONPATH
  # holds the checkout first and the wheels after
  SITE=${GPU_SITE:-/tmp/bcdflow-gpu-site}  # not under OUT: what comes back from a lent machine is a few files
  if ! "$PY" -c "import $NEED" >/dev/null 2>&1; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu-check: $PY lacks pydantic/zarr/prefect and $WHEELS/ holds no wheels (run make gpu-wheels where there is network, and bring $WHEELS)" >&2; exit 2; }
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || exit 2
  fi
  export PYTHONPATH="$PWD:$(cd "$SITE" 2>/dev/null && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import bcdflow.tasks.engine' || exit 2
fi
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda)'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# bitsandbytes (the light sections): the native library it would load for this torch's CUDA; none means those sections
# say "skipped: bitsandbytes absent" (wheels.sh keeps CUDA 12.8/12.9 and 13.x's)
"$PY" -c 'import importlib.util as u, pathlib, torch
s = u.find_spec("bitsandbytes")
libs = [] if s is None else sorted(p.name for p in pathlib.Path(s.origin).parent.glob("libbitsandbytes_cuda*"))
print("bitsandbytes:", " ".join(libs) if s else "absent", "for CUDA", torch.version.cuda)' || true
# the check keeps to its budget (a section starts only if its estimate fits what is left); timeout is the backstop
timeout -k 10 $((BUDGET + 20)) "$PY" -m benchmarks.gpu_check "$OUT" --budget "$BUDGET" "$@"
