"""Storage layer: checkpoints (copy-on-write, checksums), activation groups (shards, markers, dtypes), run state.

Run: python -m pytest -q tests/test_storage.py   (CPU, a few seconds)
"""
from __future__ import annotations

import errno
import uuid

import pytest
import torch

from bcdflow.storage.activations import (ActivationError, ActivationReader, complete_shards, create_group,
                                 shard_complete, write_shard)
from bcdflow.storage.checkpoints import (CheckpointError, commit_version, load_blocks, read_manifest, save_block,
                                 write_manifest)
from bcdflow.storage.runs import (RunStateError, VisitRecord, append_visit, drop_committed_visits, list_runs,
                          read_config, read_state, run_exists, write_config, write_state)
from bcdflow.storage.store import Store
from tests.helpers import fill_disk, temporaries


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield Store(str(tmp_path / "root"))
        return
    s = Store(f"memory://bcdflow-test-{uuid.uuid4().hex}")
    yield s
    s.rm()


def _block(seed: int, n: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"b{seed}.w{i}": torch.randn(8, 4, generator=g) for i in range(n)}
    out[f"b{seed}.half"] = torch.randn(5, generator=g).to(torch.bfloat16)
    return out


def _block_files(store: Store, run: str) -> set[str]:
    return set(store.listdir(f"runs/{run}/blocks"))


# -- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_round_trip_bitwise(store):
    blocks = {b: _block(b) for b in range(3)}
    write_manifest(store, "r", 0, {b: save_block(store, "r", t) for b, t in blocks.items()})
    loaded = load_blocks(store, "r", 0)
    expected = {k: v for t in blocks.values() for k, v in t.items()}
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    only = load_blocks(store, "r", 0, blocks=[2])  # suffix only: other blocks' files are not read
    assert set(only) == set(blocks[2])
    assert read_manifest(store, "r", 0)["blocks"].keys() == {"0", "1", "2"}


def test_save_block_is_content_addressed(store):
    a, b = save_block(store, "r", _block(0)), save_block(store, "r", _block(0))
    assert a == b and a["file"] == f"blocks/{a['sha256'][:32]}.safetensors"
    assert len(_block_files(store, "r")) == 1


def test_commit_version_is_copy_on_write(store):
    v0 = {b: save_block(store, "r", _block(b)) for b in range(3)}
    write_manifest(store, "r", 0, v0)
    before = _block_files(store, "r")
    trained = {k: v + 1 for k, v in _block(1).items()}
    m1 = commit_version(store, "r", 0, 1, {1: save_block(store, "r", trained)})
    assert len(_block_files(store, "r") - before) == 1  # one block written, not the model
    assert m1["blocks"]["0"] == v0[0] and m1["blocks"]["2"] == v0[2]
    assert m1["blocks"]["1"] != v0[1] and read_manifest(store, "r", 1) == m1
    loaded = load_blocks(store, "r", 1)
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    assert all(torch.equal(loaded[k], v) for k, v in _block(0).items())
    with pytest.raises(CheckpointError, match="block 7 is not in base version"):
        commit_version(store, "r", 1, 2, {7: m1["blocks"]["0"]})


def test_flipped_byte_names_the_file(store):
    entry = save_block(store, "r", _block(0))
    write_manifest(store, "r", 0, {0: entry})
    key = f"runs/r/{entry['file']}"
    data = bytearray(store.read_bytes(key))
    data[-3] ^= 0x01
    store.write_bytes(bytes(data), key)
    with pytest.raises(CheckpointError, match=f"block file {key} is corrupt: sha256 .* != manifest"):
        load_blocks(store, "r", 0)


def test_missing_manifest_names_the_path(store):
    with pytest.raises(CheckpointError, match="runs/r/versions/3.json"):
        read_manifest(store, "r", 3)


# -- activations ---------------------------------------------------------------------------------

KEY = "runs/r/visits/c0-b1/activations.zarr"


def _acts(n: int, T: int = 4, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, d, generator=g), torch.randint(0, 50_000, (n, T), generator=g)


def _fill(store: Store, n: int, shard_rows: int, dtype: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, targets = _acts(n)  # (n, T, d), (n, T)
    create_group(store, KEY, n_rows=n, seq_len=4, d_model=8, shard_rows=shard_rows, dtype=dtype, **kw)
    for s in range(-(-n // shard_rows)):
        lo, hi = s * shard_rows, min((s + 1) * shard_rows, n)
        write_shard(store, KEY, s, hidden[lo:hi], targets[lo:hi])
    return hidden, targets


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_activation_round_trip(store, dtype):
    hidden, targets = _fill(store, 10, 4, dtype, chunk_rows=2)  # partial last shard: rows [8, 10)
    expected = hidden.to(getattr(torch, dtype)).float()
    reader = ActivationReader(store, KEY, verify=True)
    assert (reader.n_rows, reader.n_shards, len(reader)) == (10, 3, 10)
    h, y = reader.read(0, 10)
    assert h.dtype == torch.float32 and y.dtype == torch.long
    assert torch.equal(h, expected) and torch.equal(y, targets)
    h, y = reader.read(3, 9)  # crosses shard boundaries
    assert torch.equal(h, expected[3:9]) and torch.equal(y, targets[3:9])


def test_partial_last_shard_and_markers(store):
    _fill(store, 10, 4, "float32")
    assert complete_shards(store, KEY) == {0, 1, 2}
    marker = store.read_json(KEY, "done", "2.json")
    assert (marker["lo"], marker["hi"]) == (8, 10)
    with pytest.raises(ActivationError, match=r"rows \[8, 10\)"):
        write_shard(store, KEY, 2, *_acts(4))  # a full-size shard does not fit the last one


def test_create_group_resume_and_recreate(store):
    _fill(store, 10, 4, "float32")
    create_group(store, KEY, n_rows=10, seq_len=4, d_model=8, shard_rows=4)  # identical: kept
    assert complete_shards(store, KEY) == {0, 1, 2} and shard_complete(store, KEY, 0)
    create_group(store, KEY, n_rows=10, seq_len=4, d_model=8, shard_rows=5)  # different: recreated
    assert complete_shards(store, KEY) == set()
    with pytest.raises(ActivationError, match="chunk_rows"):
        create_group(store, KEY, n_rows=10, seq_len=4, d_model=8, shard_rows=4, chunk_rows=3)


def _shard_object(store: Store, shard: int, shard_rows: int = 4, chunk_rows: int = 2) -> str:
    """The first chunk object of a shard (a shard is stored as whole chunks, one object each)."""
    return f"{KEY}/hidden/c/{shard * shard_rows // chunk_rows}/0/0"


def test_truncated_or_altered_shard_detected(store):
    _fill(store, 12, 4, "float32", chunk_rows=2)
    assert all(shard_complete(store, KEY, s) for s in range(3))
    data = store.read_bytes(_shard_object(store, 0))
    store.write_bytes(data[: len(data) // 2], _shard_object(store, 0))  # truncated
    altered = bytearray(store.read_bytes(_shard_object(store, 1)))
    altered[10] ^= 0xFF  # a data byte, the shard index stays valid
    store.write_bytes(bytes(altered), _shard_object(store, 1))
    store.rm(_shard_object(store, 2))  # lost: reads back as fill value
    assert complete_shards(store, KEY) == {0, 1, 2}  # markers alone cannot tell
    assert [shard_complete(store, KEY, s) for s in range(3)] == [False, False, False]
    with pytest.raises(ActivationError, match="shard 0"):
        ActivationReader(store, KEY, verify=True)


def test_missing_shard_raises(store):
    hidden, targets = _acts(12)
    create_group(store, KEY, n_rows=12, seq_len=4, d_model=8, shard_rows=4, dtype="bfloat16")
    write_shard(store, KEY, 0, hidden[0:4], targets[0:4])
    write_shard(store, KEY, 2, hidden[8:12], targets[8:12])
    assert not shard_complete(store, KEY, 1)
    with pytest.raises(ActivationError, match=r"shard 1 \(rows \[4, 8\)\) has no completion marker"):
        ActivationReader(store, KEY)
    with pytest.raises(ActivationError, match="does not exist"):
        ActivationReader(store, "runs/r/visits/c9-b9/activations.zarr")


# -- run state -----------------------------------------------------------------------------------


def test_run_state(store):
    assert read_state(store, "r") is None and not run_exists(store, "r") and list_runs(store) == []
    write_config(store, "r", {"model": "tiny", "n_blocks": 2})
    assert read_config(store, "r") == {"model": "tiny", "n_blocks": 2} and run_exists(store, "r")
    visit = VisitRecord(cycle=0, block=0, version=1, steps=10, step_end=10, stopped_by="max_steps", rows=80,
                        tokens=640, first_loss=4.0, train_loss=3.2, val_loss=3.4, val_ppl=30.0, tokens_per_s=100.0,
                        seconds=1.5, spend_usd=0.01)
    state = append_visit(store, "r", visit)
    assert state.version == 1 and state.status == "running" and state.visits == [visit]
    append_visit(store, "r", visit.model_copy(update={"block": 1, "version": 2}))
    with pytest.raises(RunStateError, match="another process committed"):
        append_visit(store, "r", visit.model_copy(update={"version": 2}))
    state = read_state(store, "r")
    assert state.version == 2 and [v.block for v in state.visits] == [0, 1]
    write_state(store, state.model_copy(update={"status": "done"}))
    assert read_state(store, "r").status == "done"
    write_config(store, "s", {})
    assert list_runs(store) == ["r", "s"]
    with pytest.raises(RunStateError, match="runs/t/config.json"):
        read_config(store, "t")


def test_a_resume_drops_only_committed_visits_working_objects(store):
    """A process that dies between a visit's commit and the removal of its folder leaves the folder; the next
    holder of the run removes it (flows/bcd._run), and never the folder of a visit not committed (docs/DESIGN.md
    §2.6): that one may be training on a worker, or hold the checkpoint its next attempt resumes from."""
    visit = VisitRecord(cycle=0, block=0, version=1, steps=10, step_end=10, stopped_by="max_steps", rows=80,
                        tokens=640, first_loss=4.0, train_loss=3.2, val_loss=3.4, val_ppl=30.0, tokens_per_s=100.0,
                        seconds=1.5, spend_usd=0.01)
    append_visit(store, "r", visit)
    for name in ("c0-b0", "c0-b1", "c1-b0"):
        store.write_json({"step": 2}, f"runs/r/visits/{name}/train-ckpt/ckpt.json")
    store.write_json({"epoch": 0}, "runs/r/visits/c0-b0/lease/000000000000.json")
    store.write_json({}, "runs/r/visits/notes.json")  # not a visit's folder: left alone
    assert drop_committed_visits(store, read_state(store, "r")) == ["c0-b0"]
    assert store.listdir("runs/r/visits") == ["c0-b1", "c1-b0", "notes.json"]
    assert drop_committed_visits(store, read_state(store, "r")) == []


# -- a full disk (docs/DESIGN.md §8): the error names the object, and no temporary file stays ---------------------

def _fail_os(monkeypatch, name: str) -> None:
    import os

    def fail(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, name, fail)


@pytest.mark.parametrize("write,fault", [("write_bytes", "write"), ("write_json", "write"), ("create", "write"),
                                         ("write_bytes", "fsync"), ("create", "fsync"), ("write_bytes", "rename")])
def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch, write, fault):
    """Issue 17: a local write that failed part way (ENOSPC) left its ``*.tmp-*`` file in the store for ever, and
    its error named no file. The object is as it was (absent, or its old bytes) and the error names its key."""
    from bcdflow.storage import store as store_mod

    s = Store(str(tmp_path / "root"))
    s.write_json({"old": 1}, "runs/r/state.json")
    key = "runs/r/states/000000000001.json" if write == "create" else "runs/r/state.json"
    if fault == "write":
        fill_disk(monkeypatch, store_mod)  # half the bytes written, then ENOSPC
    else:
        _fail_os(monkeypatch, {"fsync": "fsync", "rename": "replace"}[fault])
    with pytest.raises(OSError) as raised:
        if write == "write_json":
            s.write_json({"new": "x" * 10_000}, key)
        else:
            getattr(s, write)(b"x" * 10_000, key)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == s.path(key)
    monkeypatch.undo()
    assert temporaries(tmp_path) == []
    assert s.read_json("runs/r/state.json") == {"old": 1} and s.listdir("runs/r/states") == []


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_a_full_disk_while_saving_a_block(tmp_path, monkeypatch, error):
    """``save_block`` streams the block to a temporary file: on a full disk the file goes, and the error (safetensors
    raises its own type, holding "os error 28") is an OSError naming where the block was being written."""
    from safetensors import SafetensorError
    from safetensors.torch import save

    from bcdflow.storage import checkpoints

    def half(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(save(tensors)[:100])
        if error == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    s = Store(str(tmp_path / "root"))
    monkeypatch.setattr(checkpoints, "st_save_file", half)
    with pytest.raises(OSError) as raised:
        save_block(s, "r", _block(0))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == s.path("runs/r/blocks")
    assert temporaries(tmp_path) == [] and s.listdir("runs/r/blocks") == []


# -- one writer (docs/DESIGN.md I7): exclusive create, manifests never overwritten, the lease ------------------------------

def test_create_is_exclusive(store):
    assert store.create(b"one", "x/obj") and not store.create(b"two", "x/obj")
    assert store.read_bytes("x/obj") == b"one"


def test_a_manifest_is_never_overwritten(store):
    from bcdflow.storage.checkpoints import drop_uncommitted, write_manifest

    entry = save_block(store, "r", {"a": torch.ones(2)})
    other = save_block(store, "r", {"a": torch.zeros(2)})
    write_manifest(store, "r", 1, {0: entry})
    write_manifest(store, "r", 1, {0: entry})  # the same manifest again (a retried commit): fine
    with pytest.raises(CheckpointError, match="already exists with other blocks"):
        write_manifest(store, "r", 1, {0: other})
    assert read_manifest(store, "r", 1)["blocks"]["0"] == entry
    write_manifest(store, "r", 2, {0: other})
    assert drop_uncommitted(store, "r", 1) == [2] and not store.exists("runs/r/versions/2.json")


def test_lease_held_expired_taken_over_and_lost(store):
    from bcdflow.storage.lease import Lease, LeaseHeld, LeaseLost

    here = {"host": "elsewhere", "pid": 1, "started": 0.0, "flow_run_id": "f1"}
    # a short ttl: b watches a's renewals (every ttl/3) and a watches b's expired lease for one ttl
    a = Lease(store, "runs/r", "run 'r'", ttl=3, owner=here)
    b = Lease(store, "runs/r", "run 'r'", ttl=3, owner={**here, "host": "b-host", "flow_run_id": "f2"})
    with a.held():
        with pytest.raises(LeaseHeld, match="run 'r' is in use by elsewhere pid 1, flow run f1"):
            b.acquire()
        a.check()
    b.acquire()  # released by a: free at once
    # b's lease runs out (its owner stopped renewing): a may take the run over, and b has lost it
    store.write_json({**store.read_json("runs/r/lease/000000000001.json"), "expires": 1.0},
                     "runs/r/lease/000000000001.json")
    a.acquire()
    with pytest.raises(LeaseLost):
        b.check()
    with pytest.raises(LeaseLost):
        b.renew()
    a.check()


def test_lease_of_a_dead_process_on_this_machine_is_free_at_once(store):
    import subprocess
    import sys

    from bcdflow.storage.lease import Lease, this_process

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = {**this_process(), "pid": p.pid, "started": 1.0}  # a pid that no longer runs the process it named
    Lease(store, "runs/r", "run 'r'", ttl=3600, owner=dead).acquire()
    b = Lease(store, "runs/r", "run 'r'", ttl=3600).acquire()  # no wait for the hour
    assert b.epoch == 1


def test_each_store_backend_has_its_config_section_and_its_options():
    """storage/backends.py is the one home of a backend: its protocols pick it, its config section (named as it)
    gives its options, its defaults reach every store of it; a local path or memory:// has none."""
    from bcdflow.core.config import RunConfig
    from bcdflow.storage.backends import BACKENDS, backend_of

    for name, b in BACKENDS.items():
        assert name in RunConfig.model_fields and all(backend_of(f"{p}://bucket/x") is b for p in b.protocols)
    cfg = RunConfig(store="s3://bucket/x", s3={"endpoint_url": "http://127.0.0.1:1", "region": "eu-west-1"})
    assert cfg.storage_options() == {"endpoint_url": "http://127.0.0.1:1", "client_kwargs": {"region_name": "eu-west-1"}}
    assert Store("s3://bucket/x", cfg.storage_options()).storage_options["use_listings_cache"] is False
    assert backend_of("/tmp/x") is None and backend_of("memory://x") is None
    assert RunConfig(store="memory://x", s3={"endpoint_url": "http://127.0.0.1:1"}).storage_options() == {}


def test_a_store_protocol_is_spelled_only_in_its_backend_entry():
    """A new backend (gs://) is its ``storage/backends.BACKENDS`` entry and, with settings, its config section: no
    other module imports a protocol's packages, reads its errors' replies, or names its config section (the CLI's
    ``--endpoint-url`` and the compare flow built ``s3={...}``; the store's existence check read S3's replies)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    words = ("s3", "boto", "ResponseMetadata", "PreconditionFailed")
    found = []
    for layer in ("models", "storage", "core", "tracking", "tasks", "flows"):
        for path in sorted((root / layer).glob("*.py")):
            if path.name == "backends.py":
                continue
            tree = ast.parse(path.read_text())
            docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
            for n in ast.walk(tree):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in n.names] + [getattr(n, "module", None) or ""]
                    hit = [m for m in mods if m.split(".")[0] in ("boto3", "botocore", "s3fs", "aiobotocore")]
                elif isinstance(n, ast.Attribute):
                    hit = [n.attr] if n.attr == "s3" else []
                elif isinstance(n, ast.keyword):
                    hit = [n.arg] if n.arg == "s3" else []
                elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                    hit = [n.value[:60]] if any(w.lower() in n.value.lower() for w in words) else []
                else:
                    hit = []
                found += [f"{layer}/{path.name}:{n.lineno} {h!r}" for h in hit]
    assert not found, found
