"""DESIGN I4/I5 and the spot-preemption issue: kill -9 anywhere, SIGTERM, corrupt artifacts, S3.

Killed runs are real ``bcdflow`` subprocesses (pointed at the session's Prefect test server); each is
resumed with ``bcdflow resume`` and must end bitwise equal to an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flows.cli import main
from storage import checkpoints, runs
from storage.store import Store
from tests.conftest import TINY

BCDFLOW = os.path.join(os.path.dirname(sys.executable), "bcdflow")
RESUME = ["checkpoint.every_steps=2", "tracking_uri=none"]


def _sets(*extra: str) -> list[str]:
    out = []
    for s in TINY + RESUME + list(extra):
        out += ["--set", s]
    return out


def _cli(api_url: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PREFECT_API_URL": api_url, "BCDFLOW_RETRY_BACKOFF": "0.2", **(env or {})}
    return subprocess.run([BCDFLOW, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def _final(store: Store, run_id: str) -> dict[str, torch.Tensor]:
    state = runs.read_state(store, run_id)
    return checkpoints.load_blocks(store, run_id, state.version)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def reference(prefect_server, tmp_path_factory):
    """An uninterrupted run of the config every test here interrupts."""
    root = tmp_path_factory.mktemp("ref")
    assert main(["train", *_sets(), "--store", str(root), "--run-id", "ref"]) == 0
    return _final(Store(str(root)), "ref")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["preinfer-shard:2", "train-checkpoint:2", "before-commit:2"])
def test_kill9_then_resume_is_bitwise_equal(prefect_api_url, reference, tmp_path, point):
    store = str(tmp_path / "store")
    killed = _cli(prefect_api_url, "train", *_sets(), "--store", store, "--run-id", "k",
                  env={"BCDFLOW_FAILPOINTS": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = runs.read_state(Store(store), "k")
    assert state is not None and state.status == "running"
    done = _cli(prefect_api_url, "resume", "k", "--store", store)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(_final(Store(store), "k"), reference)
    visits = runs.read_state(Store(store), "k").visits
    assert [(v.cycle, v.block) for v in visits] == [(0, 0), (0, 1), (0, 2)]
    if point.startswith("train-checkpoint"):
        # killed right after the step-4 checkpoint of visit c0-b0: at most one interval lost
        assert visits[0].resumed_at == 4


@pytest.mark.slow
def test_sigterm_checkpoints_within_10s_and_resume_continues(prefect_api_url, tmp_path):
    sets = _sets("bcd.blocks=2", "bcd.max_steps=300", "checkpoint.every_steps=50",
                 "checkpoint.every_seconds=1000", "train.batch_size=16")
    store = str(tmp_path / "store")
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    proc = subprocess.Popen([BCDFLOW, "train", *sets, "--store", store, "--run-id", "t"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    s = Store(store)
    ckpt = "runs/t/visits/c0-b0/train-ckpt/ckpt.json"
    deadline = time.time() + 240
    while not s.exists(ckpt):
        assert proc.poll() is None and time.time() < deadline, "training never reached its first checkpoint"
        time.sleep(0.05)
    first = s.read_json(ckpt)["step"]
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    proc.wait(timeout=30)
    elapsed = time.time() - t0
    pointer = s.read_json(ckpt)
    assert proc.returncode != 0
    assert pointer["step"] > first and pointer["step"] % 50, "SIGTERM wrote no checkpoint of its own"
    assert elapsed < 10, f"checkpoint and exit took {elapsed:.1f}s"
    assert runs.read_state(s, "t").version == 0

    # resume continues from the SIGTERM checkpoint and ends where an uninterrupted run ends
    done = _cli(prefect_api_url, "resume", "t", "--store", store)
    assert done.returncode == 0, done.stderr[-3000:]
    visits = runs.read_state(s, "t").visits
    assert visits[0].resumed_at == pointer["step"]
    ref_store = str(tmp_path / "ref")
    assert main(["train", *sets, "--store", ref_store, "--run-id", "t"]) == 0
    _assert_same(_final(s, "t"), _final(Store(ref_store), "t"))


@pytest.mark.slow
def test_s3_run_matches_local_bitwise(prefect_server, s3_server, s3_bucket, tmp_path, reference):
    url = f"{s3_bucket}/runs-root"
    assert main(["train", *_sets(f"s3.endpoint_url={s3_server.endpoint}"), "--store", url,
                 "--run-id", "ref"]) == 0
    store = Store(url, {"endpoint_url": s3_server.endpoint})
    _assert_same(_final(store, "ref"), reference)
    # credentials never reach the store
    text = json.dumps(runs.read_config(store, "ref")) + runs.read_state(store, "ref").model_dump_json()
    assert "testing" not in text and "AWS_SECRET" not in text


@pytest.mark.slow
def test_s3_outage_fails_cleanly_then_resume_finishes(prefect_api_url, s3_server, s3_bucket, reference):
    url = f"{s3_bucket}/outage"
    store = Store(url, {"endpoint_url": s3_server.endpoint})
    sets = _sets(f"s3.endpoint_url={s3_server.endpoint}", "checkpoint.every_steps=1")
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "BCDFLOW_RETRY_BACKOFF": "0.2"}
    proc = subprocess.Popen([BCDFLOW, "train", *sets, "--store", url, "--run-id", "o"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while not store.exists("runs/o/versions/1.json"):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    s3_server.stop()
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        s3_server.start()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()
    assert any("bcdflow resume o" in line for line in last[-3:]), last[-5:]
    done = _cli(prefect_api_url, "resume", "o", "--store", url, "--endpoint-url", s3_server.endpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(_final(store, "o"), reference)
