"""A fleet on one machine (docs/DESIGN.md §6, I7): visits as runs of the bcd-visit deployment on a work pool, preemption
under real workers, one writer per run and per visit, pre-inference on Dask.

Real processes: the session's Prefect test server (a uvicorn server on loopback, as ``prefect server start``
runs one), two ``bcdflow worker`` processes on one pool (the pool and deployment from prefect.yaml, as docs/guide/fleet.md sets them up), moto's S3 as the
store every process shares, and the parent as a ``bcdflow train`` process. Every run must end bitwise equal to the
same config trained in one process.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bcdflow.core.context import RunContext, open_store
from bcdflow.flows.cli import main
from bcdflow.storage import layout
from bcdflow.storage import runs
from bcdflow.storage.store import Store
from tests.helpers import TINY, assert_same, finished_weights

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "bcdflow-gpu"
# a visit long enough to interrupt, checkpoints every 5 steps; a short lease and reschedule delay for tests
# (fixed visits: the adaptive budget may end c0-b1 before the step the tests interrupt it at). 80 steps, not 40: on
# two cores shared by make test's four workers a 40-step visit could end before the test, slowed by its Prefect
# server, had seen it running and signalled it (ProcessLookupError)
LONG = [*TINY, "bcd.blocks=2", "bcd.max_steps=80", "bcd.budget=fixed", "checkpoint.every_steps=5",
        "checkpoint.max_share=1", "checkpoint.every_seconds=1000", "tracking_uri=none"]
FLEET = [f"fleet.visit_pool={POOL}", "fleet.poll_seconds=0.5", "fleet.lease_seconds=6",
         "fleet.reschedule_delay_s=3", "fleet.visit_retries=2"]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _wait(cond, what: str, timeout: float = 240, every: float = 0.1):
    deadline = time.time() + timeout
    while True:
        out = cond()
        if out:
            return out
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


class Fleet:
    """The workers on the server at ``api``, and the environment every process of the fleet gets."""

    def __init__(self, root: Path, s3_endpoint: str, api: str):
        self.root, self.s3, self.api = root, s3_endpoint, api
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env = {**base, "PREFECT_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "DO_NOT_TRACK": "1", "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "INFO",
                    "PREFECT_CLI_PROMPT": "false", "PREFECT_HOME": str(root / "client-home"),
                    "BCDFLOW_RETRY_BACKOFF": "0.2", "OMP_NUM_THREADS": "1"}
        self.workers: dict[str, subprocess.Popen] = {}

    def prefect(self, *args: str) -> str:
        env = {k: v for k, v in self.env.items() if k != "BCDFLOW_HOME"}  # read on each worker, not baked in
        p = subprocess.run([BIN / "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    def start_worker(self, name: str) -> subprocess.Popen:
        env = {**self.env, "PREFECT_HOME": str(self.root / f"{name}-home")}
        w = subprocess.Popen([BIN / "bcdflow", "worker", "--pool", POOL, "--grace", "60", "--", "--name", name],
                             cwd=self.root, env=env, stdout=open(self.root / f"{name}.log", "a"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[name] = w
        return w

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    @contextmanager
    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api}), get_client(sync_client=True) as c:
            yield c

    def visit_runs(self, run_id: str, cycle: int, block: int) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        tags = FlowRunFilterTags(all_=[f"run:{run_id}", f"cycle:{cycle}", f"block:{block}"])
        with self.client() as c:
            return c.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tags))

    def train(self, run_id: str, store: str, *sets: str, wait: bool = True, **kw):
        args = [BIN / "bcdflow", "train", "--run-id", run_id, "--store", store,
                *_sets(*sets, f"s3.endpoint_url={self.s3}")]
        out = open(self.root / f"parent-{run_id}.log", "w")
        p = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, **kw)
        if wait:
            p.wait(timeout=900)
        return p

    def parent_log(self, run_id: str) -> str:
        return (self.root / f"parent-{run_id}.log").read_text()

    def stop(self) -> None:
        for w in self.workers.values():
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in self.workers.values():
            try:
                w.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, s3_server, prefect_api_url):
    """The fleet on the session's test server (a second server costs its start, half a minute on 2 cores)."""
    f = Fleet(tmp_path_factory.mktemp("fleet"), s3_server.endpoint, prefect_api_url)
    f.env.update({k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    try:
        f.prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
        f.prefect("--no-prompt", "deploy", "--name", POOL)  # docs/guide/fleet.md's command, from prefect.yaml
        f.start_worker("w0")
        f.start_worker("w1")
        yield f
    finally:
        f.stop()


def _store(url: str, fleet: Fleet) -> Store:
    return Store(url, {"endpoint_url": fleet.s3})


@pytest.fixture(scope="module")
def reference(prefect_server, tmp_path_factory):
    """The in-process runs the fleet must reproduce bitwise: the short 3-block 2-cycle run and the long one."""
    root = tmp_path_factory.mktemp("fleet-ref")
    out = {}
    for name, sets in (("short", [*TINY, "bcd.cycles=2", "tracking_uri=none"]), ("long", LONG)):
        assert main(["train", *_sets(*sets), "--store", str(root / name), "--run-id", "ref"]) == 0
        out[name] = finished_weights(Store(str(root / name)), "ref")
    return out


def _pid(flow_run) -> int:
    return int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1])


def _running_visit(fleet: Fleet, run_id: str, cycle: int, block: int):
    def find():
        return next((r for r in fleet.visit_runs(run_id, cycle, block)
                     if r.state and r.state.is_running() and r.infrastructure_pid), None)
    return _wait(find, f"visit c{cycle}-b{block} of {run_id} running")


def _checkpoint(store: Store, run_id: str, cycle: int, block: int, at_least: int = 1) -> dict:
    key = f"{layout.train_ckpt_key(layout.visit_key(run_id, cycle, block))}/ckpt.json"

    def found():
        try:
            pointer = store.read_json(key)
        except FileNotFoundError:
            return None
        return pointer if pointer["step"] >= at_least else None
    return _wait(found, f"a checkpoint of c{cycle}-b{block} at step >= {at_least}", every=0.05)


def test_a_dispatched_visit_that_died_after_its_commit_leaves_no_working_objects(tmp_path, monkeypatch):
    """Issue 17: a visit run whose process died between its commit and the removal of its folder left the folder
    for ever (the parent, alive, went on and finished). The dispatcher that finds the visit committed removes it."""
    import logging
    from types import SimpleNamespace

    from prefect.states import Crashed

    from bcdflow.core.config import load_config
    from bcdflow.flows import fleet as fleet_mod
    from bcdflow.storage.runs import VisitRecord

    cfg = load_config(sets=[*TINY, f"store={tmp_path / 'store'}", "tracking_uri=none", *FLEET])
    store = open_store(cfg)
    rec = VisitRecord(cycle=0, block=1, version=1, steps=4, step_end=4, stopped_by="max_steps", rows=32, tokens=1024,
                      first_loss=5.0, train_loss=4.0, val_loss=4.1, val_ppl=60.0, tokens_per_s=1e3, seconds=1.0)
    runs.append_visit(store, "r", rec)
    store.write_json({"step": 2}, "runs/r/visits/c0-b1/train-ckpt/ckpt.json")
    store.write_json({"step": 2}, "runs/r/visits/c0-b2/train-ckpt/ckpt.json")  # not committed: kept
    monkeypatch.setattr(fleet_mod, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(fleet_mod, "run_deployment", lambda *a, **k: SimpleNamespace(id="fr1"))
    monkeypatch.setattr(fleet_mod, "_wait_for", lambda *a: SimpleNamespace(state=Crashed()))
    assert fleet_mod.dispatch_visit(cfg, "r", 0, 1, 0, "dataset") == rec
    assert store.listdir("runs/r/visits") == ["c0-b2"]


# -- visits as deployment runs ----------------------------------------------------------------------------------

def test_visits_on_two_workers_equal_one_process(fleet, s3_bucket, reference):
    url = f"{s3_bucket}/short"
    p = fleet.train("f1", url, *TINY, "bcd.cycles=2", "tracking_uri=none", *FLEET)
    assert p.returncode == 0, fleet.parent_log("f1")[-3000:]
    assert_same(finished_weights(_store(url, fleet), "f1"), reference["short"])
    done = [r for c in range(2) for b in range(3) for r in fleet.visit_runs("f1", c, b)]
    assert len(done) == 6 and all(r.state.is_completed() for r in done)
    assert {r.name for r in done} == {f"f1/c{c}-b{b}" for c in range(2) for b in range(3)}
    # every visit was taken by a worker of the pool (which of the two is the pool's choice: visits run one at a
    # time, so one worker may take all six; asserting both took some failed CI once)
    submitted = " ".join(fleet.log(w) for w in ("w0", "w1"))
    assert all(f"submitting flow run '{r.id}'" in submitted for r in done), "every visit submitted by a worker"


def test_kill9_of_a_visit_is_resubmitted_and_resumes_from_its_checkpoint(fleet, s3_bucket, reference):
    url = f"{s3_bucket}/kill"
    store = _store(url, fleet)
    parent = fleet.train("k1", url, *LONG, *FLEET, wait=False)
    victim = _running_visit(fleet, "k1", 0, 1)
    _checkpoint(store, "k1", 0, 1, at_least=10)
    os.kill(_pid(victim), signal.SIGKILL)  # the box vanished
    assert parent.wait(timeout=900) == 0, fleet.parent_log("k1")[-3000:]
    assert_same(finished_weights(store, "k1"), reference["long"])
    attempts = fleet.visit_runs("k1", 0, 1)
    assert sorted(r.state.type.value for r in attempts) == ["COMPLETED", "CRASHED"]
    (rec,) = [v for v in runs.read_state(store, "k1").visits if v.block == 1]
    assert rec.resumed_at >= 10  # continued from its checkpoint, not from zero


def test_sigterm_reschedules_the_visit_and_it_resumes_from_its_checkpoint(fleet, s3_bucket, reference):
    url = f"{s3_bucket}/term"
    store = _store(url, fleet)
    parent = fleet.train("t1", url, *LONG, *FLEET, wait=False)
    victim = _running_visit(fleet, "t1", 0, 1)
    first = _checkpoint(store, "t1", 0, 1, at_least=5)["step"]
    os.kill(_pid(victim), signal.SIGTERM)  # the spot rental's notice, to the flow-run process
    pointer = _wait(lambda: (p := store.read_json(f"{layout.train_ckpt_key(layout.visit_key('t1', 0, 1))}/ckpt.json"))["meta"].get(
        "why") == "signal" and p, "the SIGTERM checkpoint")
    assert pointer["step"] > first
    assert parent.wait(timeout=900) == 0, fleet.parent_log("t1")[-3000:]
    assert_same(finished_weights(store, "t1"), reference["long"])
    (run,) = fleet.visit_runs("t1", 0, 1)  # the same flow run, rescheduled and run again: its identity kept
    assert run.state.is_completed() and run.run_count == 2
    assert (run.name, run.parameters["cycle"], run.parameters["block"]) == ("t1/c0-b1", 0, 1)
    assert run.parameters["base_version"] == 1
    (rec,) = [v for v in runs.read_state(store, "t1").visits if v.block == 1]
    assert rec.resumed_at == pointer["step"]


def test_worker_shutdown_lets_its_visit_checkpoint_and_another_worker_finish_it(fleet, s3_bucket, reference):
    url = f"{s3_bucket}/shutdown"
    store = _store(url, fleet)
    parent = fleet.train("s1", url, *LONG, *FLEET, wait=False)
    victim = _running_visit(fleet, "s1", 0, 1)
    _checkpoint(store, "s1", 0, 1, at_least=5)
    owner = next(n for n, w in fleet.workers.items()
                 if w.poll() is None and _pid(victim) in {c.pid for c in __import__("psutil").Process(w.pid).children(
                     recursive=True)})
    fleet.workers[owner].send_signal(signal.SIGTERM)  # docker stop / the machine shutting down
    assert fleet.workers[owner].wait(timeout=120) is not None
    try:
        assert parent.wait(timeout=900) == 0, fleet.parent_log("s1")[-3000:]
    finally:
        fleet.start_worker(owner)
    assert_same(finished_weights(store, "s1"), reference["long"])
    pointer_why = [v for v in runs.read_state(store, "s1").visits if v.block == 1][0].resumed_at
    assert pointer_why >= 5


# -- one writer -----------------------------------------------------------------------------------------------------

def test_two_workers_handed_the_same_visit(fleet, s3_bucket, tmp_path):
    from bcdflow.core.config import load_config
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.run import init_run

    url = f"{s3_bucket}/twice"
    cfg = load_config(sets=[*LONG, *FLEET, f"store={url}", f"s3.endpoint_url={fleet.s3}"])
    ds = prepare_data.fn(cfg, open_store(cfg))
    init_run.fn(cfg, "w2", ds)
    params = {"run_id": "w2", "cycle": 0, "block": 0, "base_version": 0, "dataset_id": ds,
              "config": cfg.model_dump(mode="json")}
    with temporary_settings({PREFECT_API_URL: fleet.api}):
        ids = [run_deployment(f"bcd-visit/{POOL}", parameters=params, timeout=0, as_subflow=False,
                              tags=["run:w2", "cycle:0", "block:0"]).id for _ in range(2)]
    with fleet.client() as c:
        final = _wait(lambda: all((s := c.read_flow_run(i).state) and s.is_final() for i in ids) and
                      [c.read_flow_run(i) for i in ids], "both visit runs final", timeout=600, every=0.5)
    store = open_store(cfg)
    state = runs.read_state(store, "w2")
    assert [(v.cycle, v.block, v.version) for v in state.visits] == [(0, 0, 1)]  # committed once
    assert store.exists("runs/w2/versions/1.json") and not store.exists("runs/w2/versions/2.json")
    outcomes = sorted(r.state.type.value for r in final)
    # the other one either found the visit leased and stopped, naming the owner, or found it committed already
    if outcomes == ["COMPLETED", "FAILED"]:
        (failed,) = [r for r in final if r.state.is_failed()]
        assert "is in use by" in failed.state.message and "visit c0-b0 of run 'w2'" in failed.state.message
    else:
        assert outcomes == ["COMPLETED", "COMPLETED"]


def _one_line(path: Path) -> str:
    return path.read_text().strip().splitlines()[-1]


def test_two_cli_processes_on_one_run_id(prefect_api_url, tmp_path, reference):
    """Of two processes started on one run id, one trains and the other stops with one line naming it (or,
    once the run is done, finds nothing to do); started together, either may win. A second started after the
    first was killed takes the run over. The final weights are always a clean run's."""
    bcdflow = BIN / "bcdflow"
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    random.seed(1)
    delays = [0.0, random.uniform(2, 12), random.uniform(12, 30)]

    def start(i: int, name: str) -> subprocess.Popen:
        args = [bcdflow, "train", *_sets(*LONG), "--store", str(tmp_path / f"s{i}"), "--run-id", "r"]
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}{i}", "w"))

    # the three pairs at once, each on its own store: pair i's second process starts delays[i] after its first
    pairs = [{"a": start(i, "a")} for i in range(len(delays))]
    t0 = time.monotonic()
    for i in sorted(range(len(delays)), key=delays.__getitem__):
        time.sleep(max(0.0, t0 + delays[i] - time.monotonic()))
        pairs[i]["b"] = start(i, "b")
    for i, procs in enumerate(pairs):
        store = str(tmp_path / f"s{i}")
        codes = {name: p.wait(timeout=900) for name, p in procs.items()}
        assert 0 in codes.values() and set(codes.values()) <= {0, 2}, codes
        for name, code in codes.items():
            other = procs["b" if name == "a" else "a"]
            if code == 2:  # the loser names the winner
                line = _one_line(tmp_path / f"{name}{i}")
                assert "run 'r' is in use by" in line and f"pid {other.pid}" in line, line
            else:
                assert code == 0, (tmp_path / f"{name}{i}").read_text()[-3000:]
        assert_same(finished_weights(Store(store), "r"), reference["long"])

    # the first killed mid-run: its lease names a dead process on this machine, so the second takes over at once
    store = str(tmp_path / "takeover")
    args = [bcdflow, "train", *_sets(*LONG), "--store", store, "--run-id", "r"]
    first = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _checkpoint(Store(store), "r", 0, 1, at_least=5)
    first.kill()
    first.wait()
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same(finished_weights(Store(store), "r"), reference["long"])


# -- pre-inference on Dask ------------------------------------------------------------------------------------------

def _preinfer_on(cfg, run_id: str, dataset_id: str) -> tuple[np.ndarray, np.ndarray]:
    from prefect import flow

    from bcdflow.flows.visit import preinfer
    from bcdflow.storage.activations import ActivationReader

    @flow
    def shards():
        preinfer(RunContext.of(cfg, run_id, dataset_id), 0, 1, 0)

    shards()
    reader = ActivationReader(open_store(cfg), layout.acts_key(run_id, 0, 1))
    h, y = reader.read(0, reader.n_rows)
    return h.numpy(), y.numpy()


def test_dask_preinference_equals_one_process_and_survives_a_lost_worker(prefect_server, tmp_path, monkeypatch):
    from bcdflow.core.config import load_config
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.run import init_run

    sets = [*LONG, "bcd.shard_rows=8", "bcd.max_steps=10"]  # 80 rows: 10 shards
    results = {}
    for name, extra in (("local", []), ("dask", ["fleet.preinfer=dask", "fleet.dask_workers=2"]),
                        ("dask-lost", ["fleet.preinfer=dask", "fleet.dask_workers=2"])):
        if name == "dask-lost":  # the first Dask worker to compute a shard dies before writing it
            monkeypatch.setenv("BCDFLOW_FAILPOINTS", "preinfer-computed:1")
            monkeypatch.setenv("BCDFLOW_FAILPOINTS_ONCE", str(tmp_path / "fired"))
        cfg = load_config(sets=[*sets, *extra, f"store={tmp_path / name}"])
        ds = prepare_data.fn(cfg, open_store(cfg))
        init_run.fn(cfg, "d", ds)
        results[name] = _preinfer_on(cfg, "d", ds)
    assert (tmp_path / "fired").exists()  # a worker really died mid-shard
    for name in ("dask", "dask-lost"):
        for a, b in zip(results[name], results["local"]):
            np.testing.assert_array_equal(a, b)
