"""docs/DESIGN.md I5 and many writers: corrupt shards are recomputed, corrupt block files refused, and four
pre-inference processes writing one visit's shards agree with a single process value for value."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
import zarr

from bcdflow.core.context import RunContext, open_store
from bcdflow.flows.cli import main
from bcdflow.storage import activations, checkpoints
from bcdflow.tasks.data import prepare_data
from bcdflow.storage.layout import acts_key
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.run import init_run


def _visit_setup(cfg, run_id="r"):
    store = open_store(cfg)
    ds = prepare_data.fn(cfg, store)
    init_run.fn(cfg, run_id, ds)
    return store, ds


def _hidden(store, key) -> np.ndarray:
    return zarr.open_group(store.zarr_store(key, read_only=True), mode="r")["hidden"][:]


def test_truncated_shard_is_detected_and_recomputed(tiny_cfg):
    cfg = tiny_cfg("bcd.shard_rows=8")
    store, ds = _visit_setup(cfg)
    todo = plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1)
    assert len(todo) >= 3
    for s in todo:
        preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, s)
    key = acts_key("r", 0, 1)
    before = _hidden(store, key)
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1) == []  # everything complete: nothing recomputed

    shard_file = store.path(key, "hidden", "c", "1", "0", "0")
    with open(shard_file, "r+b") as f:
        f.truncate(os.path.getsize(shard_file) // 2)
    assert not activations.shard_complete(store, key, 1)
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1) == [1]
    preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, 1)
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1) == []
    np.testing.assert_array_equal(_hidden(store, key), before)


def test_altered_shard_byte_is_detected(tiny_cfg):
    cfg = tiny_cfg("bcd.shard_rows=8")
    store, ds = _visit_setup(cfg)
    for s in plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1):
        preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, s)
    key = acts_key("r", 0, 1)
    shard_file = store.path(key, "hidden", "c", "0", "0", "0")
    with open(shard_file, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1) == [0]


def test_flipped_byte_in_block_file_is_refused(tiny_cfg, capsys):
    cfg = tiny_cfg()
    store, _ = _visit_setup(cfg)
    entry = checkpoints.read_manifest(store, "r", 0)["blocks"]["1"]
    path = store.path("runs", "r", entry["file"])
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(checkpoints.CheckpointError, match=entry["file"]):
        checkpoints.load_blocks(store, "r", 0, [1])
    rc = main(["export", "r", os.path.join(os.path.dirname(store.root), "out"), "--store", cfg.store])  # not in it
    err = capsys.readouterr().err
    assert rc == 1 and entry["file"] in err and "corrupt" in err


def _worker(cfg_json: str, ds: str, shards: list[int]) -> None:
    import torch

    from bcdflow.core.config import RunConfig

    torch.set_num_threads(1)
    cfg = RunConfig.model_validate_json(cfg_json)
    for s in shards:
        preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 2, 0, s)


@pytest.mark.slow
def test_four_processes_write_one_visit(tiny_cfg, tmp_path):
    cfg = tiny_cfg("bcd.shard_rows=4", "bcd.max_steps=8")
    store, ds = _visit_setup(cfg)
    todo = plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 2)
    assert len(todo) >= 8
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(cfg.model_dump_json(), ds, todo[i::4])) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 2) == []

    single = cfg.model_copy(update={"store": str(tmp_path / "single")})
    store1, ds1 = _visit_setup(single)
    for s in plan_shards.fn(RunContext.of(single, "r", ds1), 0, 2):
        preinfer_shard.fn(RunContext.of(single, "r", ds1), 0, 2, 0, s)
    key = acts_key("r", 0, 2)
    r4, r1 = activations.ActivationReader(store, key), activations.ActivationReader(store1, key)
    h4, y4 = r4.read(0, r4.n_rows)
    h1, y1 = r1.read(0, r1.n_rows)
    assert h4.equal(h1) and y4.equal(y1)
