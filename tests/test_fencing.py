"""docs/DESIGN.md I7 and issue 17: a process that lost its lease can never change what a run has committed.

The run's state moves by exclusive creates of ``states/{seq}.json`` fenced by lease epochs (storage/runs.advance);
a paused writer thawed after a takeover fails with one line; a commit whose reply was lost is retried successfully.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from bcdflow.core.context import open_store
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.lease import Lease, LeaseLost
from bcdflow.storage.runs import RunState, VisitRecord
from bcdflow.storage.store import Store
from bcdflow.tasks.data import prepare_data
from bcdflow.tasks.run import commit_visit, init_run
from tests.helpers import TINY, assert_same, finished_weights

BCDFLOW = os.path.join(os.path.dirname(sys.executable), "bcdflow")


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def _record(version: int, block: int = 0, **kw) -> VisitRecord:
    return VisitRecord(cycle=0, block=block, version=version, steps=4, step_end=4 * version, stopped_by="max_steps",
                       rows=32, tokens=1024, first_loss=5.0, train_loss=4.0, val_loss=4.1, val_ppl=60.0,
                       tokens_per_s=1e3, **{"seconds": 1.0, **kw})


def test_two_writers_of_one_version_exactly_one_wins(store):
    base = runs.write_state(store, RunState(run_id="r"))
    a = runs.append_visit(store, "r", _record(1), base=base)
    with pytest.raises(LeaseLost, match="another process changed the run first"):
        runs.append_visit(store, "r", _record(1, seconds=2.0), base=base)  # read the same state, came second
    assert runs.read_state(store, "r") == a and a.seq == 1
    assert runs.append_visit(store, "r", _record(1), base=base) == a  # the winner's retry: its own object, success


def test_a_fenced_out_writer_changes_nothing(store):
    runs.write_state(store, RunState(run_id="r"), {"run": 0})
    stale = runs.read_state(store, "r")
    runs.fence(store, "r", {"run": 1})  # another process took the run over
    before = runs.read_state(store, "r")
    for write in (lambda: runs.append_visit(store, "r", _record(1), {"run": 0}),
                  lambda: runs.advance(store, stale, stale.model_copy(update={"status": "done"}), {"run": 0})):
        with pytest.raises(LeaseLost, match="taken over|changed the run first"):
            write()
    assert runs.read_state(store, "r") == before and before.fence == {"run": 1}


def test_an_old_single_state_json_is_read_and_continued(store):
    """Runs made before states/ existed: their state.json is the state, and the next commit goes on from it."""
    old = RunState(run_id="r", version=2, visits=[_record(1), _record(2, block=1)])
    store.write_bytes(old.model_dump_json(exclude={"seq", "fence"}).encode(), "runs/r/state.json")
    assert runs.read_state(store, "r") == old
    new = runs.append_visit(store, "r", _record(3, block=2))
    assert new.version == 3 and new.seq == 1 and runs.read_state(store, "r") == new


def _run(cfg):
    store = open_store(cfg)
    ds = prepare_data.fn(cfg, store)
    init_run.fn(cfg, "r", ds)
    entry = checkpoints.save_block(store, "r", {"x": torch.arange(4.0)})
    return store, entry


def test_a_commit_whose_reply_was_lost_is_retried_successfully(tiny_cfg):
    cfg = tiny_cfg()
    store, entry = _run(cfg)
    rec = _record(1)
    first = commit_visit.fn(cfg, "r", rec, {0: entry}, {"run": 0, "visit c0-b0": 0})
    again = commit_visit.fn(cfg, "r", rec, {0: entry}, {"run": 0, "visit c0-b0": 0})  # the retry of the same task
    assert again == first == runs.read_state(store, "r") and first.version == 1 and first.fence == {"run": 0}


def test_a_commit_after_a_takeover_writes_nothing(tiny_cfg):
    cfg = tiny_cfg()
    store, entry = _run(cfg)
    runs.fence(store, "r", {"run": 1})
    before = runs.read_state(store, "r")
    with pytest.raises(LeaseLost, match="taken over"):
        commit_visit.fn(cfg, "r", _record(1), {0: entry}, {"run": 0})
    assert runs.read_state(store, "r") == before and not store.exists("runs/r/versions/1.json")


def test_a_lease_not_renewed_for_a_ttl_is_not_trusted_at_commit(store):
    lease = Lease(store, "runs/r", "run 'r'", ttl=0.5).acquire()
    lease.check()
    time.sleep(0.6)  # the keep-alive thread did not run (a paused process, a store down)
    with pytest.raises(LeaseLost, match="not renewed"):
        lease.check()


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.slow
def test_a_writer_frozen_in_its_commit_cannot_change_the_run_after_a_takeover(prefect_api_url, tmp_path):
    """A freezes after its commit's checks (visit c0-b1); B takes the run over once A's lease expired and commits
    versions 2 and 3; A thawed exits non-zero with one line, the run is unchanged, and equals an uninterrupted run."""
    from bcdflow.flows.cli import main

    sets = []
    for s in TINY + ["checkpoint.every_steps=2", "checkpoint.max_share=1", "tracking_uri=none",
                     "fleet.lease_seconds=4"]:
        sets += ["--set", s]
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "BCDFLOW_RETRY_BACKOFF": "0.2"}
    ref = tmp_path / "ref"
    assert main(["train", *sets, "--store", str(ref), "--run-id", "k"]) == 0  # uninterrupted, in this process
    root = tmp_path / "store"
    args = ["train", *sets, "--store", str(root), "--run-id", "k"]
    err = open(tmp_path / "a.err", "w")
    a = subprocess.Popen([BCDFLOW, *args], stdout=subprocess.DEVNULL, stderr=err, text=True,
                         env={**env, "BCDFLOW_FAILPOINTS": "commit-checked:2:stop"})
    try:
        deadline = time.time() + 300
        while psutil.Process(a.pid).status() != psutil.STATUS_STOPPED:
            assert a.poll() is None and time.time() < deadline, (tmp_path / "a.err").read_text()[-3000:]
            time.sleep(0.1)
        assert runs.read_state(Store(str(root)), "k").version == 1
        t0 = time.monotonic()
        while True:  # B: the run is busy until A's lease expires (A is alive, so it is waited out)
            b = subprocess.run([BCDFLOW, *args], env=env, capture_output=True, text=True, timeout=400)
            if b.returncode != 2 or "is in use" not in b.stderr:
                break
            assert time.monotonic() - t0 < 60, b.stderr[-2000:]
            time.sleep(0.5)
        assert b.returncode == 0, b.stderr[-3000:]
        state = runs.read_state(Store(str(root)), "k")
        assert state.version == 3 and state.status == "done"
        before = _tree(root)
        os.kill(a.pid, signal.SIGCONT)
        rc = a.wait(timeout=120)
    finally:
        if a.poll() is None:
            a.kill()
    line = (tmp_path / "a.err").read_text().strip().splitlines()[-1]
    assert rc == 1 and "another process changed the run first" in line, line
    assert _tree(root) == before
    assert_same(finished_weights(Store(str(root)), "k"), finished_weights(Store(str(ref)), "k"))


# -- leases judged on the observer's own clock (issue 17) -----------------------------------------------------

def test_a_clock_skewed_ahead_by_more_than_the_ttl_does_not_take_a_live_lease(store, monkeypatch):
    import bcdflow.storage.lease as lease_mod
    from bcdflow.storage.lease import LeaseHeld

    a = Lease(store, "runs/r", "run 'r'", ttl=1.0, owner={"host": "a-host", "pid": 1, "started": 0.0})
    a.acquire()  # written with the true clock: expires = now + 1
    real = time.time
    monkeypatch.setattr(lease_mod.time, "time", lambda: real() + 100.0)  # every clock here now runs 100 s ahead
    stop = threading.Event()
    renewer = threading.Thread(target=lambda: [a.renew() for _ in iter(lambda: stop.wait(0.2), True)])
    renewer.start()
    try:
        b = Lease(store, "runs/r", "run 'r'", ttl=1.0, owner={"host": "b-host", "pid": 2, "started": 0.0})
        with pytest.raises(LeaseHeld, match="in use by a-host"):
            b.acquire()
        a.check()
    finally:
        stop.set()
        renewer.join()
    t0 = time.monotonic()  # a stops renewing: b takes it after one ttl of watching, by its own clock
    b.acquire()
    assert b.epoch == 1 and time.monotonic() - t0 >= 1.0


def test_same_hostname_in_another_pid_namespace_is_not_judged_dead(store):
    """Containers share a hostname, not a pid namespace: a pid we cannot see there is not a dead holder."""
    import subprocess

    from bcdflow.storage.lease import LeaseHeld, this_process

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    other = {**this_process(), "pid": p.pid, "started": 1.0, "pid_ns": 1}  # same host and boot, other namespace
    a = Lease(store, "runs/r", "run 'r'", ttl=1.0, owner=other)
    with a.held():
        with pytest.raises(LeaseHeld):
            Lease(store, "runs/r", "run 'r'", ttl=1.0).acquire()


# -- exclusive creates verified, failing closed (issue 17 part 3) ----------------------------------------------

def _files(s3_server, bucket: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint, skip_instance_cache=True)
    return fs.find(bucket.removeprefix("s3://"))


def test_a_store_that_ignores_if_none_match_is_refused_before_anything_is_written(s3_server, s3_bucket, s3_proxy,
                                                                                   capsys):
    """A conditional PUT that silently overwrites (the proxy drops If-None-Match): two processes would both take
    epoch 0 of a lease and a manifest could be overwritten, so `train` exits 2 with one line and writes nothing."""
    from bcdflow.errors import BadInput
    from bcdflow.flows.cli import main

    s3_proxy.mode = "strip"
    url = f"{s3_bucket}/x"
    with pytest.raises(BadInput, match="does not honour an exclusive create"):
        Store(url, {"endpoint_url": s3_proxy.endpoint}).probe()
    sets = [a for s in [*TINY, "tracking_uri=none", f"s3.endpoint_url={s3_proxy.endpoint}"] for a in ("--set", s)]
    capsys.readouterr()
    assert main(["train", *sets, "--store", url, "--run-id", "r"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert url in err and s3_proxy.endpoint in err and "does not honour an exclusive create" in err, err
    assert "If-None-Match" in err and "resume" not in err, err
    assert _files(s3_server, s3_bucket) == []  # no run state, no dataset, no probe object left


@pytest.mark.parametrize("reply", ["409", "412"])
def test_a_409_or_412_from_the_store_means_exists(s3_server, s3_bucket, s3_proxy, reply):
    """s3fs turns S3's 412 into FileExistsError only when the reply names the If-None-Match condition; a 412 without
    it (S3-compatible stores) and a 409 ConditionalRequestConflict come out as plain OSErrors: still "exists"."""
    s3_proxy.mode = reply
    store = Store(f"{s3_bucket}/{reply}", {"endpoint_url": s3_proxy.endpoint})  # (one bucket for both replies)
    store.probe()  # the probe's second create gets the 409/412: the store is exclusive
    assert store.create(b"one", "k") and not store.create(b"two", "k")
    assert store.read_bytes("k") == b"one"
    with pytest.raises(OSError) as raised:  # what s3fs itself raises for this reply
        store.fs.pipe_file(store.path("k"), b"three", mode="create")
    assert not isinstance(raised.value, FileExistsError) and raised.value.errno == {"409": 5, "412": 22}[reply]


def test_the_exclusive_create_probe_runs_once_per_store_and_process(s3_server, s3_bucket, s3_proxy):
    store = Store(f"{s3_bucket}/x", {"endpoint_url": s3_proxy.endpoint})
    store.probe()
    assert s3_proxy.requests.get("PUT") == 2 and s3_proxy.requests.get("DELETE") == 1  # create twice, remove
    Store(f"{s3_bucket}/x", {"endpoint_url": s3_proxy.endpoint}).probe()  # another Store of it: known already
    assert store.create(b"one", "k") and not store.create(b"two", "k")
    assert s3_proxy.requests.get("PUT") == 4 and s3_proxy.requests.get("DELETE") == 1
    assert _files(s3_server, s3_bucket) == [f"{s3_bucket.removeprefix('s3://')}/x/k"]



def test_a_filesystem_that_checks_then_writes_is_refused():
    """fsspec's generic create (``exists()``, then a write) is not exclusive between two processes."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from bcdflow.errors import BadInput

    class CheckThenWrite(MemoryFileSystem):
        protocol = "checkthenwrite"
        pipe_file = fsspec.AbstractFileSystem.pipe_file

    fsspec.register_implementation("checkthenwrite", CheckThenWrite, clobber=True)
    store = Store("checkthenwrite://x")
    with pytest.raises(BadInput, match="checkthenwrite://x does not honour an exclusive create .*checks for the "
                                       "object, then writes it"):
        store.probe()
    with pytest.raises(BadInput):
        store.create(b"one", "k")
    assert not store.exists("k")


# -- training stops once its lease could have expired (issue 17 part 1) -----------------------------------------

class _Steps:
    """Slows every training step of this process by ``step_s`` and notes when each began; raises ``limit_s`` after
    the first, so that a loop that never stops fails the test instead of training for ever."""

    def __init__(self, monkeypatch, step_s: float, limit_s: float):
        import bcdflow.tasks.engine as engine_mod

        self.times: list[float] = []
        real = engine_mod.visit_loss

        def slow(*args, **kwargs):
            if self.times and time.monotonic() - self.times[0] > limit_s:
                raise RuntimeError(f"still training after {limit_s} s")
            time.sleep(step_s)
            self.times.append(time.monotonic())
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_mod, "visit_loss", slow)


def _renewals_fail(monkeypatch, only: str = "") -> dict:
    """Every renewal of a lease (of keys containing ``only``) raises, as a store that went away would; returns the
    monotonic times at which leases were acquired, by key."""
    acquired: dict[str, float] = {}
    real_write, real_acquire = Lease._write, Lease.acquire

    def write(self):
        if only in self.key:
            raise OSError("the store is unreachable")
        real_write(self)

    def acquire(self):
        acquired[self.key] = time.monotonic()
        return real_acquire(self)

    monkeypatch.setattr(Lease, "_write", write)
    monkeypatch.setattr(Lease, "acquire", acquire)
    return acquired


def test_training_stops_once_its_lease_could_have_expired(tiny_cfg, monkeypatch):
    """Renewals fail from the start: the step loop stops within the ttl (after two thirds of it, plus a step), with
    LeaseLost and no checkpoint written after that; the train task never retries it."""
    from bcdflow.core.context import RunContext
    from bcdflow.storage import layout, trainckpt
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block
    from tests.helpers import new_run

    ttl = 2.0
    cfg = tiny_cfg("bcd.max_steps=100000", "checkpoint.every_steps=5", "checkpoint.max_share=1")
    ds = new_run(cfg)
    store = Store(cfg.store)
    steps = _Steps(monkeypatch, step_s=0.02, limit_s=4 * ttl)
    saves: list[float] = []
    real_save = trainckpt.save
    monkeypatch.setattr(trainckpt, "save", lambda *a, **k: (saves.append(time.monotonic()), real_save(*a, **k))[1])
    acquired = _renewals_fail(monkeypatch)
    lease = Lease(store, layout.visit_key("r", 0, 0), "visit c0-b0 of run 'r'", ttl=ttl)
    with pytest.raises(LeaseLost) as lost:
        with lease.held():
            train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 0, 0))
    stopped = time.monotonic() - acquired[lease.key]
    message = str(lost.value)
    assert "visit c0-b0 of run 'r': its lease was not renewed for" in message and "\n" not in message
    assert "without committing" in message
    started = [t - acquired[lease.key] for t in steps.times]  # when each step began
    assert started[-1] >= ttl / 2 and stopped < ttl, (started[-3:], stopped)  # not at the first failed renewal
    assert saves and all(t - acquired[lease.key] < started[-1] for t in saves)  # checkpoints until the lapse only
    assert runs.read_state(store, "r").version == 0


@pytest.mark.slow
def test_a_visit_whose_lease_is_not_renewed_stops_and_commits_nothing(prefect_server, tiny_cfg, monkeypatch, capsys):
    """`bcdflow train` (in-process) while the visit's lease renewals fail: the visit stops training within the ttl
    and the run fails with one line and exit 1; the run is still at version 0 with no visit and no manifest 1."""
    from bcdflow.flows.cli import main

    ttl = 2.0
    steps = _Steps(monkeypatch, step_s=0.02, limit_s=4 * ttl)
    acquired = _renewals_fail(monkeypatch, only="/visits/")
    store = Store(str(tiny_cfg().store))
    sets = [a for s in [*TINY, "tracking_uri=none", f"fleet.lease_seconds={ttl:g}", "bcd.max_steps=100000"]
            for a in ("--set", s)]
    capsys.readouterr()
    assert main(["train", *sets, "--store", store.url, "--run-id", "r"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "visit c0-b0 of run 'r': its lease was not renewed for" in err and "without committing" in err, err
    t0 = acquired["runs/r/visits/c0-b0"]
    # no step begins after the ttl (on a loaded machine the set-up alone can outlast it: then no step at all)
    assert all(t - t0 < ttl for t in steps.times), [t - t0 for t in steps.times[-3:]]
    state = runs.read_state(store, "r")
    assert state.version == 0 and state.visits == [] and state.status != "done"
    assert store.listdir("runs/r/versions") == ["0.json"]


@pytest.mark.slow
def test_a_distributed_visit_whose_lease_is_not_renewed_is_stopped_at_once(tiny_cfg, tmp_path, monkeypatch):
    """train.gpus=2 (torchrun, gloo): renewals start failing once the processes train (a checkpoint is there); the
    task kills every process without a checkpoint of its own and raises LeaseLost within the ttl."""
    from bcdflow.core.context import RunContext
    from bcdflow.storage import layout
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block
    from tests.helpers import new_run

    monkeypatch.setenv("BCDFLOW_DIST_DIR", str(tmp_path / "dist"))
    monkeypatch.setenv("BCDFLOW_DIST_KEEP", "1")
    (tmp_path / "dist").mkdir()
    ttl = 3.0
    cfg = tiny_cfg("bcd.max_steps=100000", "checkpoint.every_steps=5", "checkpoint.max_share=1", "train.gpus=2",
                   "train.parallel=ddp")
    ds = new_run(cfg)
    store = Store(cfg.store)
    ckpt = "runs/r/visits/c0-b0/train-ckpt/ckpt.json"
    failing: list[float] = []
    done = threading.Event()
    real_write = Lease._write

    def write(self):
        if failing:
            raise OSError("the store is unreachable")
        real_write(self)

    def fail_once_training():
        deadline = time.monotonic() + 240
        while not store.exists(ckpt) and time.monotonic() < deadline:
            time.sleep(0.05)
        failing.append(time.monotonic())
        if not done.wait(4 * ttl):  # still training (the old code): preempt the processes, so the test ends
            for p in (tmp_path / "dist").glob("*/pid-*"):
                os.kill(int(p.read_text()), signal.SIGTERM)

    monkeypatch.setattr(Lease, "_write", write)
    watcher = threading.Thread(target=fail_once_training, daemon=True)
    watcher.start()
    lease = Lease(store, layout.visit_key("r", 0, 0), "visit c0-b0 of run 'r'", ttl=ttl)
    try:
        with pytest.raises(LeaseLost, match="not renewed"):
            with lease.held():
                train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 0, 0))
    finally:
        done.set()
        watcher.join()
    assert failing and time.monotonic() - failing[0] < ttl
    pids = [int(p.read_text()) for p in (tmp_path / "dist").glob("*/pid-*")]
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    step = store.read_json(ckpt)["step"]
    time.sleep(1.0)
    assert store.read_json(ckpt)["step"] == step and store.read_json(ckpt)["meta"]["why"] == "steps"
