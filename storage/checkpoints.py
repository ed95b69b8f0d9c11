"""Versioned, copy-on-write model checkpoints (docs/DESIGN.md §2 step 5, §5).

Layout below a run::

    runs/{run_id}/blocks/{sha256[:32]}.safetensors   one block's tensors, content-addressed, immutable
    runs/{run_id}/versions/{v}.json                  manifest: {"version": v, "blocks": {"0": entry, ...}}

An entry is ``{"file": "blocks/<name>.safetensors", "sha256": <hex>, "bytes": n}``. A visit writes the one
block it trained (``save_block``) and then a manifest that references every other block's file of the base
version (``commit_version``): the model is never rewritten, and since block files are written before the
small manifest object, a crash leaves either the old version or the complete new one (object stores have no
rename). Every load verifies the sha256 of each file it reads (docs/DESIGN.md §3 I5). Tensors go through safetensors
only; nothing is ever unpickled.

Usage::

    entry = save_block(store, run_id, {"h.0.attn.c_attn.weight": w, ...})
    commit_version(store, run_id, base_version=3, new_version=4, changed={1: entry})
    state = load_blocks(store, run_id, 4, blocks=[1, 2, 3])   # only the suffix, docs/DESIGN.md §2 step 3
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import uuid
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file

from bcdflow.errors import DamagedArtifact

from .layout import (block_file, block_file_key, block_name, block_tmp_name, blocks_key, manifest_key, run_key,
                     versions_key)
from .store import Store, file_mode, raise_naming, sha256_bytes


class CheckpointError(DamagedArtifact):
    """A manifest or block file is missing, malformed or fails its checksum."""


def _to_cpu_contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; tensors that share storage are cloned, because safetensors refuses
    shared storage (a tied weight belongs to one block only, but a caller may pass views)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is a {type(t).__name__}, expected torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        elif t.numel():
            seen.add(ptr)
        out[name] = t
    return out


def save_block(store: Store, run_id: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one block's tensors as a content-addressed safetensors object and return its manifest entry.

    Identical tensors give identical bytes, hence the same object: an existing object of the right size is
    not rewritten (resume after a crash, or an unchanged block). The bytes are streamed to a temporary file
    and hashed from there (the same bytes ``safetensors.torch.save`` makes), so saving holds no second copy
    of the block in memory: tensors that are views of a mapped checkpoint are never materialised at all."""
    if not tensors:
        raise CheckpointError("save_block got no tensors")
    tensors = _to_cpu_contiguous(tensors)
    # a local store gets the temporary file beside its final name (an atomic rename); others upload it
    tmp_dir = store.path(blocks_key(run_id)) if store.is_local else tempfile.gettempdir()
    os.makedirs(tmp_dir, exist_ok=True)
    tmp = os.path.join(tmp_dir, block_tmp_name(uuid.uuid4().hex))
    try:  # the temporary file goes whatever happens (a full disk: docs/DESIGN.md §8)
        try:
            st_save_file(tensors, tmp)
            os.chmod(tmp, file_mode())  # safetensors makes it 0600: the umask's mode, as every object of the store
            h, size = hashlib.sha256(), 0
            with open(tmp, "rb+") as f:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    h.update(chunk)
                    size += len(chunk)
                os.fsync(f.fileno())
        except Exception as e:  # the error names where the block was written, not a temporary name
            raise_naming(e, os.path.dirname(tmp))
        sha = h.hexdigest()
        rel = block_file(sha)
        path = store.path(run_key(run_id, rel))
        if store.block_cache is not None:  # this box reads it back from its own disk (bcd.block_cache)
            store.block_cache.put(sha, src=tmp)
        if not (store.fs.exists(path) and store.fs.size(path) == size):
            if store.is_local:
                os.replace(tmp, path)
            else:
                store.fs.put_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"file": rel, "sha256": sha, "bytes": size}


def load_file(store: Store, run_id: str, entry: dict[str, Any], what: str,
              device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one content-addressed file that ``save_block`` wrote (``entry``: its manifest entry), its
    checksum verified; ``what`` names it in errors (e.g. "the optimizer moments of block 1")."""
    key = block_file_key(run_id, entry.get("file")) if isinstance(entry, dict) else None
    if key is None or not isinstance(entry.get("sha256"), str):
        raise CheckpointError(f"{what}: the run state names {entry!r}, not a block file of run {run_id!r} (the "
                              "state is damaged; restore it)"[:400])
    try:
        data, sha = read_block_file(store, key, entry["sha256"])
    except FileNotFoundError as e:
        raise CheckpointError(f"{what}: file {key} is missing") from e
    if sha != entry["sha256"]:
        raise CheckpointError(f"{what}: file {key} is corrupt: sha256 {sha} != {entry['sha256']}")
    return {name: t.to(device) for name, t in st_load(data).items()}


def read_block_file(store: Store, key: str, sha256: str) -> tuple[bytes, str]:
    """A block file's bytes and their sha256: this box's copy where ``bcd.block_cache`` holds one that matches
    ``sha256``, else the store's object (kept in the cache once it matches). A copy that does not match is dropped
    and the store read: only the store's object can be corrupt (raises FileNotFoundError where it is gone)."""
    cache = store.block_cache
    if cache is not None and (data := cache.get(sha256)) is not None:
        if (sha := sha256_bytes(data)) == sha256:
            return data, sha
        cache.drop(sha256)
    data = store.read_bytes(key)
    sha = sha256_bytes(data)
    if cache is not None and sha == sha256:
        cache.put(sha, data)
    return data, sha


def _check_entry(block: Any, entry: Any, where: str = "manifest") -> dict[str, Any]:
    """A manifest entry as written (``save_block``): ``blocks/{name}`` (a plain name: store content never leads out of
    the run's prefix, storage/layout.py), a sha256 string and a byte count; anything else is damage of ``where``."""
    if not isinstance(entry, dict) or not {"file", "sha256", "bytes"} <= set(entry):
        why = f"must have file, sha256 and bytes; got {entry!r}"
    elif block_name(entry["file"]) is None:
        why = f"names {entry['file']!r}, not a file in the run's blocks/ folder"
    elif not isinstance(entry["sha256"], str) or type(entry["bytes"]) is not int or entry["bytes"] < 0:
        why = f"has a sha256 or byte count of the wrong type or range: {entry!r}"
    else:
        return entry
    raise CheckpointError(f"{where}: the entry of block {block} {why}"[:400])


def write_manifest(store: Store, run_id: str, version: int, blocks: dict[int, dict[str, Any]]) -> None:
    """Create ``runs/{run_id}/versions/{version}.json``, the pointer object, written after the block files. A
    manifest is never overwritten (docs/DESIGN.md I7): one that exists already is this very manifest (a retried write)
    or the work of another writer, which is an error."""
    if not isinstance(version, int) or version < 0:
        raise CheckpointError(f"version must be an int >= 0, got {version!r}")
    if not blocks:
        raise CheckpointError(f"manifest of version {version} has no blocks")
    manifest, key = _manifest(version, blocks), manifest_key(run_id, version)
    if not store.create(json.dumps(manifest, indent=2, sort_keys=True).encode(), key):
        if store.read_json(key) != manifest:
            raise CheckpointError(f"manifest {store.url_of(key)} already exists with other blocks: another process "
                                  f"committed version {version} of run {run_id!r}")


def drop_uncommitted(store: Store, run_id: str, version: int) -> list[int]:
    """Remove manifests above ``version`` (the run state's): left by a writer that crashed between its manifest
    and its state. Only the lease holder calls this (storage/lease.py), so no live writer's manifest goes."""
    dropped = []
    for name in store.listdir(versions_key(run_id)):
        v = name.removesuffix(".json")
        if v.isdigit() and int(v) > version:
            store.rm(versions_key(run_id), name)
            dropped.append(int(v))
    return sorted(dropped)


def _manifest(version: int, blocks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    items = sorted(blocks.items(), key=lambda kv: int(kv[0]))
    return {"version": version, "blocks": {str(int(b)): dict(_check_entry(b, e)) for b, e in items}}


def read_manifest(store: Store, run_id: str, version: int, blocks: list[int] | None = None) -> dict[str, Any]:
    """Manifest ``version`` of the run, checked: every entry names a block file of the run (``_check_entry``), it says
    its own version, and (``blocks``: the run's plan) it has exactly those blocks, so no reader takes a model with a
    block missing for a whole one. CheckpointError naming the file otherwise."""
    key = manifest_key(run_id, version)
    try:
        manifest = store.read_json(key)
    except FileNotFoundError:
        raise CheckpointError(f"manifest {store.url_of(key)} of version {version} is missing: the weights of that "
                              f"version are lost (export an earlier one with bcdflow export {run_id} OUT --version N, "
                              "or start a new run)") from None
    except ValueError as e:
        raise CheckpointError(f"manifest {store.url_of(key)} is damaged (not valid JSON: {e}); restore it, or export "
                              f"an earlier version with bcdflow export {run_id} OUT --version N") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("blocks"), dict):
        raise CheckpointError(f"manifest {store.url_of(key)} is damaged (no 'blocks' mapping); restore it")
    where = (f"manifest {store.url_of(key)} is damaged (restore it, or export an earlier version with bcdflow export "
             f"{run_id} OUT --version N)")
    if manifest.get("version") != version or type(manifest.get("version")) is not int:
        raise CheckpointError(f"{where}: it says version {manifest.get('version')!r:.40}")
    for b, e in manifest["blocks"].items():
        if not (isinstance(b, str) and b.isdigit()):
            raise CheckpointError(f"{where}: {b!r:.40} is not a block number")
        _check_entry(b, e, where)
    if blocks is not None and sorted(int(b) for b in manifest["blocks"]) != sorted(blocks):
        have = sorted(int(b) for b in manifest["blocks"])
        raise CheckpointError(f"{where}: it has blocks {have}, the run's plan {sorted(blocks)}")
    return manifest


def check_version(store: Store, run_id: str, version: int) -> None:
    """Raise CheckpointError unless version ``version``'s manifest and every block file it names are present
    at their recorded sizes (cheap: one listing per file, no data read)."""
    for b, entry in read_manifest(store, run_id, version)["blocks"].items():
        key = block_file_key(run_id, entry["file"])
        try:
            size = store.fs.size(store.path(key))
        except FileNotFoundError:
            size = None
        if size != entry["bytes"]:
            what = "missing" if size is None else f"{size} bytes, the manifest says {entry['bytes']}"
            raise CheckpointError(f"block file {store.url_of(key)} (block {b} of version {version}) is {what}: the "
                                  "run cannot continue from this version")


def load_blocks(store: Store, run_id: str, version: int, blocks: list[int] | None = None,
                device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load the tensors of some blocks (all when ``blocks`` is None) of a version, verifying each file's
    sha256 against the manifest before deserializing it."""
    return load_from_manifest(store, run_id, read_manifest(store, run_id, version), blocks, device=device)


def load_from_manifest(store: Store, run_id: str, manifest: dict[str, Any], blocks: list[int] | None = None,
                       names: list[str] | None = None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load blocks named by a manifest (possibly one not yet committed, for evaluation before the commit).
    ``names`` keeps only those tensors (a tied head needs one tensor of block 0, not the whole block)."""
    out: dict[str, torch.Tensor] = {}
    for b, key, data in _block_files(store, run_id, manifest, blocks):
        _add(out, st_load(data), names, manifest, device)
    return out


def iter_from_manifest(store: Store, run_id: str, manifest: dict[str, Any], blocks: list[int],
                       names: list[str] | None = None):
    """The tensors of ``blocks`` of a manifest as ``(name, tensor)``, one block file at a time, each tensor a read-only
    view of the file's bytes (verified first): a loader copies each where it belongs (a device parameter, a streamed
    layer's host buffer), so the host holds one block file, never a model part's tensors at once. A view is valid
    while its block is being iterated; copy it before the next."""
    seen: set[str] = set()
    keep = set(names) if names is not None else None
    for b, key, data in _block_files(store, run_id, manifest, blocks):
        views = _views(data, key)
        del data  # the views hold the bytes while they are iterated, and nothing holds them after
        for name, t in views:
            if keep is None or name in keep:
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} appears in more than one block of version "
                                          f"{manifest.get('version')}")
                seen.add(name)
                yield name, t
            del t  # no view of this file alive while the next is read (a filtered-out one neither)


def _block_files(store: Store, run_id: str, manifest: dict[str, Any], blocks: list[int] | None):
    """(block, key, bytes) of each wanted block file of ``manifest``, read whole and checked against its sha256."""
    entries, version = manifest["blocks"], manifest.get("version")
    wanted = sorted(int(b) for b in entries) if blocks is None else [int(b) for b in blocks]
    for b in wanted:
        if str(b) not in entries:
            raise CheckpointError(f"block {b} is not in manifest runs/{run_id}/versions/{version}.json "
                                  f"(blocks: {sorted(int(k) for k in entries)})")
        entry = _check_entry(b, entries[str(b)], f"manifest of version {version} of run {run_id!r}")
        key = block_file_key(run_id, entry["file"])
        try:
            data, sha = read_block_file(store, key, entry["sha256"])
        except FileNotFoundError as e:
            raise CheckpointError(f"block file {key} referenced by version {version} is missing") from e
        if sha != entry["sha256"]:
            raise CheckpointError(f"block file {key} is corrupt: sha256 {sha} != manifest {entry['sha256']}")
        yield b, key, data
        del data  # before the next file is read: one file's bytes at a time


def _add(out: dict, tensors: dict, names, manifest: dict, device) -> None:
    keep = set(names) if names is not None else None
    for name, t in tensors.items():
        if keep is not None and name not in keep:
            continue
        if name in out:
            raise CheckpointError(f"tensor {name!r} appears in more than one block of version "
                                  f"{manifest.get('version')}")
        out[name] = t.to(device)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _views(data: bytes, key: str):
    """The tensors of a safetensors file's bytes as zero-copy views, in file order (the format: an 8-byte
    little-endian header length, a JSON header of name -> dtype, shape, [begin, end) in the data, then the data).
    ``safetensors.torch.load`` would copy every tensor out at once; the file was verified by its sha256 already."""
    import warnings

    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"block file {key} is not a safetensors file ({e})"[:300]) from None
    for name, h in items:
        dtype = _ST_DTYPES.get(h.get("dtype"))
        a, b = h["data_offsets"]
        shape = tuple(h["shape"])
        if dtype is None or not 0 <= a <= b <= len(data) - 8 - n:
            raise CheckpointError(f"block file {key}: tensor {name!r} has an unreadable header entry {h!r}"[:300])
        size = torch.empty((), dtype=dtype).element_size()
        if (b - a) != math.prod(shape) * size:
            raise CheckpointError(f"block file {key}: tensor {name!r} has {b - a} bytes for shape {shape}"[:300])
        if a == b:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # bytes are read-only: the view is only ever read (copied from)
            warnings.simplefilter("ignore", UserWarning)
            yield name, torch.frombuffer(data, dtype=dtype, count=(b - a) // size, offset=8 + n + a).view(shape)


def commit_version(store: Store, run_id: str, base_version: int, new_version: int,
                   changed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Manifest of ``new_version`` = manifest of ``base_version`` with the ``changed`` blocks replaced.

    Copy-on-write (docs/DESIGN.md §2 step 5): unchanged blocks keep pointing at the base version's files. The changed
    blocks' files must already be written (``save_block``); this writes only the small manifest object."""
    if new_version <= base_version:
        raise CheckpointError(f"new_version ({new_version}) must be greater than base_version ({base_version})")
    base = read_manifest(store, run_id, base_version)
    blocks = {int(b): e for b, e in base["blocks"].items()}
    for b, entry in changed.items():
        if int(b) not in blocks:
            raise CheckpointError(f"changed block {b} is not in base version {base_version} "
                                  f"(blocks: {sorted(blocks)})")
        if not store.exists(block_file_key(run_id, _check_entry(b, entry)["file"])):
            raise CheckpointError(f"block file runs/{run_id}/{entry['file']} of changed block {b} was not written")
        blocks[int(b)] = entry
    write_manifest(store, run_id, new_version, blocks)
    return _manifest(new_version, blocks)
