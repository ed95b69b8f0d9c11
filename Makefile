# Two commands on a fresh machine:
#   make demo   # set up .venv and run the demo (tiny model, built-in corpus, embedded defaults)
#   make test   # set up .venv and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# make test's workers: four pytest-xdist workers, the end-to-end tests first (tests/conftest.py). Most tests wait on
# processes, so on 2 cores .ci/run took 20.9 min on a fresh clone (setup 1.6, 1,078 tests 19.3), and 20.4-22.1 with a
# benchmark sharing the cores (docs/guide/development.md). TEST_WORKERS=0 runs it in one process (32-36 min)
TEST_WORKERS ?= 4

.PHONY: setup demo test test-fast docs-check bench gpu-wheels gpu-check ui-shots clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel, not several GB of CUDA packages
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[test,peers,light]"  # peers, light: the suite tests the peer methods and the lighter states too
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/bcdflow demo

test: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=600 \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1

test-fast: $(STAMP)   # the inner loop: everything but the end-to-end runs (8 min on 2 cores)
	PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=600 \
	$(BIN)/python -m pytest -q -m "not slow"

docs-check: $(STAMP)   # every link and image of README.md and docs/ resolves; README.md at most 250 lines
	$(BIN)/python -m pytest -q tests/test_docs.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks run --quick

gpu-wheels:   # here, with network: the cp312 wheels the GPU machine lacks, bitsandbytes trimmed, into .whl/ (<64 MiB)
	bash benchmarks/gpu/wheels.sh

# on a GPU machine: the GPU tests and figures into $(GPU_OUT) (gpu_check.json, gpu_check.md; at most 8 files; under
# 5 min on an H100/H200 by its own estimate, GPU_BUDGET=270 s for its sections, so a rerun fits a lent GPU's 15 min),
# with the .venv's CUDA torch or the machine's own python3 and the wheels of .whl/; without a GPU a CPU smoke run
GPU_OUT ?= gpu-check-out
gpu-check:
	bash benchmarks/gpu/check.sh $(GPU_OUT)

ui-shots: $(STAMP)   # after make demo: the Prefect and MLflow UIs in headless Chromium, PNGs in docs/ui/ (apt-get install chromium)
	$(BIN)/python benchmarks/ui_shots.py

clean:
	rm -rf $(VENV) bcdflow-store
