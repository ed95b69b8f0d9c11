"""Activation reads for training (storage/activations.ActivationReader): whole chunk objects read straight from the
store, each checked against its marker's per-chunk crc32 on first read, so a shard altered after its marker was
written is refused at training time (naming the shard) and recomputed by the next pre-inference.

    python -m pytest -q tests/test_activation_reads.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from bcdflow.core.context import RunContext
from bcdflow.errors import DamagedArtifact
from bcdflow.storage.activations import ActivationError, ActivationReader, create_group, write_shard
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import train_block
from bcdflow.core.rules import VisitSpec
from tests.helpers import new_run

KEY = "runs/r/visits/c0-b1/activations.zarr"


def group(store, dtype="float32", compression="none", n=37, T=5, d=6, shard_rows=12, chunk_rows=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, T, d, generator=g)
    y = torch.randint(-100, 900, (n, T), generator=g)
    create_group(store, KEY, n_rows=n, seq_len=T, d_model=d, shard_rows=shard_rows, dtype=dtype,
                 chunk_rows=chunk_rows, compression=compression)
    for s in range(-(-n // shard_rows)):
        lo, hi = s * shard_rows, min((s + 1) * shard_rows, n)
        write_shard(store, KEY, s, h[lo:hi], y[lo:hi])
    return h, y


@pytest.mark.parametrize("dtype,compression", [("float32", "none"), ("bfloat16", "none"), ("float16", "none"),
                                               ("float32", "zstd")])
def test_reads_equal_zarr_reads_across_chunks_and_shards(tmp_path, dtype, compression):
    store = Store(str(tmp_path))
    group(store, dtype, compression)
    z = zarr.open_group(store.zarr_store(KEY, read_only=True), mode="r")
    want_h = np.asarray(z["hidden"][:])
    want_h = (torch.from_numpy(want_h.view(np.int16)).view(torch.bfloat16).float() if dtype == "bfloat16"
              else torch.from_numpy(want_h).float())
    want_y = torch.from_numpy(np.asarray(z["targets"][:])).long()
    reader = ActivationReader(store, KEY)
    assert reader._direct is (compression == "none")
    for lo, hi in [(0, 3), (3, 9), (9, 30), (30, 37), (0, 37), (36, 37), (5, 5)]:  # in chunks, across, ragged end
        h, y = reader.read(lo, hi)
        assert h.dtype == torch.float32 and y.dtype == torch.long
        assert torch.equal(h, want_h[lo:hi]) and torch.equal(y, want_y[lo:hi]), (lo, hi)
    reader.close()


def _flip_a_byte(store: Store, *parts: str, at: int = 17) -> None:
    path = store.path(*parts)
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x40
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("array,parts", [("hidden", ("hidden", "c", "5", "0", "0")),
                                         ("targets", ("targets", "c", "5", "0"))])
def test_a_byte_flipped_after_the_marker_is_refused_at_read_time(tmp_path, array, parts):
    store = Store(str(tmp_path))
    group(store)
    _flip_a_byte(store, KEY, *parts)  # chunk 5 = rows [20, 24): shard 1
    reader = ActivationReader(store, KEY)  # opening checks markers only
    h, _ = reader.read(0, 12)  # shard 0 is fine
    assert h.shape == (12, 5, 6)
    with pytest.raises(ActivationError, match=rf"shard 1 \(rows \[12, 24\)\).*corrupt: {array} chunk 5 checksum"):
        reader.read(18, 22)
    with pytest.raises(ActivationError, match="Resume the run"):
        ActivationReader(store, KEY, prefetch=False).read(20, 21)


def test_a_truncated_chunk_object_is_refused(tmp_path):
    store = Store(str(tmp_path))
    group(store)
    path = store.path(KEY, "hidden", "c", "2", "0", "0")
    open(path, "r+b").truncate(10)
    with pytest.raises(ActivationError, match="shard 0 .*truncated"):
        ActivationReader(store, KEY).read(8, 12)


def test_training_refuses_a_corrupt_shard_and_preinference_recomputes_it(tiny_cfg):
    cfg = tiny_cfg()
    ds = new_run(cfg)
    shards = plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1)
    for s in shards:
        preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, s)
    store = Store(cfg.store)
    _flip_a_byte(store, KEY, "hidden", "c", "0", "0", "0", at=1000)  # shard 0's first chunk
    with pytest.raises(DamagedArtifact, match="shard 0 .*corrupt"):
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
    assert plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1) == [0]  # the next pre-inference redoes exactly that shard
    preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, 0)
    assert train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0)).steps == cfg.bcd.max_steps
