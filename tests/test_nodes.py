"""A visit across machines (``train.nodes``; issue 42): the visit's task is torchrun's node 0 and each other machine
runs ``bcdflow join RUN --node-rank K``, which reads the job from the store (tasks/train_dist.join). Checked here with
two "machines" of one gloo process each on this one: the weights are the one-process visit's (as DDP's are, to
float rounding), the bytes DDP's hook all-reduces are the plan's, and a machine killed with SIGKILL mid-visit fails
the visit, whose next attempt resumes from its last checkpoint and ends where an uninterrupted visit ends."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from bcdflow.core.context import RunContext
from bcdflow.core.figures import figures
from bcdflow.core.rules import VisitSpec
from bcdflow.storage.layout import nodes_key
from bcdflow.storage.store import Store
from bcdflow.tasks.train import train_block
from tests.test_distributed import LONG, SGD, block_of, max_diff, setup_visit

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two(tiny_cfg, *sets):
    return tiny_cfg(*sets, "train.nodes=2", "train.parallel=ddp", f"train.rdzv_endpoint=127.0.0.1:{_port()}")


def _join(cfg) -> subprocess.Popen:
    """The second machine: ``bcdflow join r --node-rank 1 --once`` in a session of its own."""
    exe = os.path.join(os.path.dirname(sys.executable), "bcdflow")
    return subprocess.Popen([exe, "join", "r", "--node-rank", "1", "--once", "--store", cfg.store],
                            start_new_session=True, env={**os.environ, "DO_NOT_TRACK": "1"})


def _visit_on_two(cfg, ds: str, block: int):
    """Block ``block``'s visit with the second machine joined; it must end cleanly with the visit."""
    node1 = _join(cfg)
    try:
        out = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, block, 0))
        assert node1.wait(timeout=120) == 0
    finally:
        node1.kill()
    return out


def test_a_visit_across_two_machines_gives_the_one_process_weights_and_the_plans_bytes(tiny_cfg):
    one = tiny_cfg(*SGD)
    ds = setup_visit(one, 1)
    ref = train_block.fn(RunContext.of(one, "r", ds), VisitSpec(0, 1, 0))
    two = _two(tiny_cfg, *SGD)
    out = _visit_on_two(two, ds, 1)
    assert (out.gpus, out.steps, out.tokens) == (2, ref.steps, ref.tokens)
    assert max_diff(block_of(one, 1, ref.block_file), block_of(one, 1, out.block_file)) <= 1e-6
    ctx = RunContext.of(two, "r", ds)
    planned = figures(two, ctx.model_cfg, ctx.plan, None).blocks[1].grad_bytes
    assert abs(out.comm_bytes - planned) <= 0.05 * planned, (out.comm_bytes, planned)
    assert not Store(two.store).exists(nodes_key("r", 0, 1))  # the job is gone with its attempt


def test_a_machine_killed_mid_visit_fails_it_and_the_next_attempt_resumes_from_its_checkpoint(tiny_cfg):
    one = tiny_cfg(*SGD, *LONG)
    ds = setup_visit(one, 0)
    store = Store(one.store)
    ckpt = "runs/r/visits/c0-b0/train-ckpt/ckpt.json"
    two = _two(tiny_cfg, *SGD, *LONG)
    node1 = _join(two)
    killed: list[int] = []

    def vanish():  # the second machine goes away: every process of it at once, no signal handler runs
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            if store.exists(ckpt):
                procs = [psutil.Process(node1.pid), *psutil.Process(node1.pid).children(recursive=True)]
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                killed.append(store.read_json(ckpt)["step"])
            time.sleep(0.02)

    watcher = threading.Thread(target=vanish, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Exception) as exc:  # the lost peer fails node 0's collectives: the visit fails
            train_block.fn(RunContext.of(two, "r", ds), VisitSpec(0, 0, 0))
    finally:
        watcher.join()
        node1.kill()
    assert "visit c0-b0 across 2 machines failed: a machine's processes failed or went away" in str(exc.value)
    assert killed and node1.wait(timeout=30) == -signal.SIGKILL
    pointer = store.read_json(ckpt)
    assert pointer["step"] >= killed[0] and pointer["step"] < 120
    # the next attempt: the second machine joins again, the visit resumes from the checkpoint
    resumed = _visit_on_two(_two(tiny_cfg, *SGD, *LONG), ds, 0)
    assert resumed.resumed_at == pointer["step"] and resumed.steps == 120 and resumed.gpus == 2
    store.rm("runs/r/visits/c0-b0")
    ref = train_block.fn(RunContext.of(one, "r", ds), VisitSpec(0, 0, 0))
    assert max_diff(block_of(one, 0, ref.block_file), block_of(one, 0, resumed.block_file)) <= 1e-6
