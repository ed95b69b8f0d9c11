"""A box's own copies of the block files (``bcd.block_cache``, storage/block_cache.py): loads read them instead of the
store, every copy is held to the manifest's sha256, and the planner stops billing egress on model loads."""
from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from bcdflow.core.config import load_config
from bcdflow.core.context import open_store
from bcdflow.flows.cli import main
from bcdflow.storage import checkpoints
from bcdflow.storage.block_cache import BlockCache
from bcdflow.storage.store import Store, sha256_bytes
from tests.helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _store(tmp_path, cap_gb: float = 1.0) -> Store:
    """A store that is not this box's disk (memory://), with the box's copies under tmp_path."""
    cfg = load_config(sets=[*TINY, f"store=memory://bc-{tmp_path.name}", f"bcd.block_cache={tmp_path / 'blocks'}",
                            f"bcd.block_cache_gb={cap_gb}"])
    store = open_store(cfg)
    assert isinstance(store.block_cache, BlockCache) and not store.is_local
    return store


def _no_store_reads(monkeypatch, store: Store) -> None:
    def refuse(*parts):
        raise AssertionError(f"read the store: {parts}")
    monkeypatch.setattr(store, "read_bytes", refuse)


def test_a_block_written_on_this_box_loads_from_its_copy_not_the_store(tmp_path, monkeypatch):
    store = _store(tmp_path)
    w = {"h.0.w": torch.arange(12.0).reshape(3, 4)}
    entry = checkpoints.save_block(store, "r", w)
    checkpoints.write_manifest(store, "r", 1, {0: entry})
    assert (tmp_path / "blocks" / f"{entry['sha256']}.safetensors").exists()
    manifest = checkpoints.read_manifest(store, "r", 1)  # the manifest is not a block file: read before refusing
    _no_store_reads(monkeypatch, store)
    assert torch.equal(checkpoints.load_from_manifest(store, "r", manifest)["h.0.w"], w["h.0.w"])
    assert torch.equal(checkpoints.load_file(store, "r", entry, "block 0")["h.0.w"], w["h.0.w"])
    assert store.block_cache.hits == 2


def test_a_damaged_copy_is_dropped_and_the_store_read_and_a_damaged_object_still_fails(tmp_path):
    store = _store(tmp_path)
    w = {"h.0.w": torch.ones(4, 4)}
    entry = checkpoints.save_block(store, "r", w)
    copy = tmp_path / "blocks" / f"{entry['sha256']}.safetensors"
    copy.write_bytes(copy.read_bytes()[:-3] + b"bad")  # a bit flip on the box's disk
    assert torch.equal(checkpoints.load_file(store, "r", entry, "block 0")["h.0.w"], w["h.0.w"])
    assert sha256_bytes(copy.read_bytes()) == entry["sha256"]  # read from the store, and kept again
    copy.unlink()
    key = f"runs/r/{entry['file']}"
    store.write_bytes(b"not the block", key)  # the store's object damaged: nothing on the box stands in for it
    with pytest.raises(checkpoints.CheckpointError, match="corrupt"):
        checkpoints.load_file(store, "r", entry, "block 0")
    assert not copy.exists()  # what failed its check is never kept


def test_the_cache_keeps_at_most_its_cap_dropping_the_least_recently_used(tmp_path):
    cache = BlockCache(tmp_path / "c", cap_bytes=2500)
    blobs = {c: bytes([c]) * 1000 for c in range(4)}
    shas = {c: sha256_bytes(b) for c, b in blobs.items()}
    cache.put(shas[0], blobs[0])
    time.sleep(0.01)
    cache.put(shas[1], blobs[1])
    time.sleep(0.01)
    assert cache.get(shas[0]) == blobs[0]  # used: now the newest
    time.sleep(0.01)
    cache.put(shas[2], blobs[2])  # 3000 bytes would exceed 2500: the least recently used (1) goes
    assert cache.get(shas[1]) is None and cache.get(shas[0]) == blobs[0] and cache.get(shas[2]) == blobs[2]
    assert cache.bytes_held() <= 2500
    cache.put(shas[3], bytes(3000))  # larger than the cap: not kept, nothing evicted for it
    assert cache.get(shas[3]) is None and cache.bytes_held() == 2000
    stale = tmp_path / "c" / ".tmp-killed"  # a writer killed mid-copy an hour ago
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200,) * 2)
    cache.put(sha256_bytes(b"y"), b"y")
    assert not stale.exists()
    with pytest.raises(ValueError, match="not a sha256"):
        cache.get("../../etc/passwd")


def test_an_unwritable_cache_costs_a_store_read_never_the_run(tmp_path, caplog):
    store = _store(tmp_path)
    (tmp_path / "blocks").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="bcdflow.storage.block_cache"):
        entry = checkpoints.save_block(store, "r", {"w": torch.zeros(2)})
        assert torch.equal(checkpoints.load_file(store, "r", entry, "block 0")["w"], torch.zeros(2))
    assert sum("not kept" in r.getMessage() for r in caplog.records) == 1  # said once, not per file


def test_a_local_store_keeps_no_copies_and_the_key_must_be_a_local_directory(tmp_path, capsys):
    cfg = load_config(sets=[*TINY, f"store={tmp_path / 's'}", f"bcd.block_cache={tmp_path / 'blocks'}"])
    assert open_store(cfg).block_cache is None  # the store is this box's disk already
    assert main(["plan", "--tokens", "1e6", "--set", "bcd.block_cache=s3://b/cache", "--set",
                 f"store={tmp_path}/s"]) == 2
    err = capsys.readouterr().err
    assert "bcd.block_cache: must be a local directory" in err and not (tmp_path / "s").exists()


def test_the_plan_bills_the_model_once_a_run_with_the_cache_and_every_visit_without(capsys, tmp_path):
    """The planner's reading: without copies every visit's load crosses the store's link (egress each time); with
    them the run reads the model once, and the visits load at the disk's speed."""
    base = ["plan", "--set", "model.from_hf=benchmarks/shapes/llama-3-8b", "--set", "data.seq_len=1024",
            "--set", "train.precision=bf16", "--set", "optim.name=adamw8bit-bf16", "--set", "bcd.blocks=8",
            "--set", "train.batch_size=8", "--set", "bcd.max_steps=100", "--set", "store=s3://my-bucket/runs",
            "--set", "bcd.preinfer=false", "--tokens", "100e6", "--gpu-gb", "24", "--store-gbs", "0.2", "--json"]
    with pytest.MonkeyPatch.context() as m:
        m.chdir(ROOT)
        assert main(base) == 0
        off = json.loads(capsys.readouterr().out)
        assert main([*base, "--set", f"bcd.block_cache={tmp_path}/blocks"]) == 0
        on = json.loads(capsys.readouterr().out)
    model_gb = on["model_bytes"] / 1e9
    loaded_gb = sum(v["loaded_bytes"] for v in off["visits"]) / 1e9
    assert off["cycle"]["egress_usd"] == pytest.approx(loaded_gb * 0.09)
    assert on["cycle"]["egress_usd"] == 0 and on["run"]["egress_usd"] == pytest.approx(model_gb * 0.09)
    assert all(v["cached"] and v["load_s"] == pytest.approx(v["loaded_bytes"] / 2e9) for v in on["visits"])
    assert on["run"]["wall_s"] < off["run"]["wall_s"]
    assert any("bcd.block_cache=" in n for n in on["notes"]) and any("bcd.block_cache=DIR" in n for n in off["notes"])
