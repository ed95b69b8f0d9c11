"""Activation groups: the pre-inference output of one visit (paper §3.2.2; DESIGN §2 step 2, §5).

``runs/{run_id}/visits/c{c}-b{b}/activations.zarr`` is a Zarr 3 group with two arrays::

    hidden   [n, T, d]  float32 | float16 | uint16 (bfloat16 bit pattern, attribute logical_dtype)
    targets  [n, T]     int32
    done/{shard}.json   completion marker per shard: row range + crc32 of the bytes as written

A *shard* (bcdflow's unit of pre-inference work, ``shard_rows`` rows) is stored as whole Zarr chunks of
~16 MB, one object each. Each pre-inference task owns whole chunks, so concurrent writers never share an
object, which is what makes concurrent writes safe. Zarr's sharding codec was tried and dropped: in
zarr 3.1 a region write of a whole shard still takes the partial-write path (zero-filled scratch chunks,
an all-zeros scan, a join), about 5x slower than writing the same bytes to a file. Whole-chunk objects
write at raw-file speed (benchmarks/store_throughput.py).

The array metadata is created once by the coordinator (``create_group``). Zarr has no native bfloat16, so
its 16-bit pattern is stored. Activations barely compress, so compressors are off by default (zstd level 1
on request). A shard counts as complete only when its marker exists and the stored bytes still match the
marker's checksum (DESIGN §3 I5), so a truncated or altered shard is redone, never trained on.

Usage::

    create_group(store, key, n_rows=n, seq_len=T, d_model=d, shard_rows=256, dtype="bfloat16")
    for s in range(n_shards): write_shard(store, key, s, hidden, targets)   # one task per shard
    reader = ActivationReader(store, key); h, y = reader.read(0, 32)          # (32, T, d) float32, (32, T) long
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import zarr

from core.errors import DamagedArtifact

from .store import Store

DTYPES = ("float32", "float16", "bfloat16")
_STORED = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
_CHUNK_BYTES = 16 << 20  # ~16 MB per chunk object: large enough for object stores, small enough for batches


class ActivationError(DamagedArtifact):
    """An activation group is missing, incomplete, malformed or fails its checksum."""


def _default_chunk_rows(shard_rows: int, row_bytes: int) -> int:
    """Largest divisor of shard_rows whose chunk fits in ~16 MB (at least one row)."""
    cap = max(1, _CHUNK_BYTES // max(1, row_bytes))
    return max(r for r in range(1, min(cap, shard_rows) + 1) if shard_rows % r == 0)


def create_group(store: Store, key: str, *, n_rows: int, seq_len: int, d_model: int, shard_rows: int,
                 dtype: str = "float32", chunk_rows: int | None = None, compression: str = "none") -> None:
    """Create the group's metadata (coordinator, once). An existing group with identical attributes is kept
    (resume: its completed shards stay valid); one with different attributes is deleted and recreated."""
    for name, v in (("n_rows", n_rows), ("seq_len", seq_len), ("d_model", d_model), ("shard_rows", shard_rows)):
        if not isinstance(v, int) or v < 1:
            raise ActivationError(f"{name} must be a positive int, got {v!r}")
    if dtype not in DTYPES:
        raise ActivationError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    row_bytes = seq_len * d_model * np.dtype(_STORED[dtype]).itemsize
    if chunk_rows is None:
        chunk_rows = _default_chunk_rows(shard_rows, row_bytes)
    elif not isinstance(chunk_rows, int) or chunk_rows < 1 or shard_rows % chunk_rows:
        raise ActivationError(f"chunk_rows must be a positive divisor of shard_rows={shard_rows}, got {chunk_rows!r}")
    if compression not in ("none", "zstd"):
        raise ActivationError(f"compression must be none or zstd, got {compression!r}")
    attrs = {"n_rows": n_rows, "seq_len": seq_len, "d_model": d_model, "shard_rows": shard_rows,
             "chunk_rows": chunk_rows, "dtype": dtype, "n_shards": -(-n_rows // shard_rows),
             "compression": compression}
    compressors = None if compression == "none" else zarr.codecs.ZstdCodec(level=1)
    if _existing_attrs(store, key) == attrs:
        return
    store.rm(key)  # different layout (or a half-created group): its shards and markers are meaningless
    group = zarr.open_group(store.zarr_store(key), mode="w")
    hidden_attrs = {"logical_dtype": "bfloat16"} if dtype == "bfloat16" else {}
    # whole-chunk writes never read back; skipping zarr's all-zeros scan per chunk halves write time
    fast = {"write_empty_chunks": True}
    group.create_array("hidden", shape=(n_rows, seq_len, d_model), dtype=_STORED[dtype],
                       chunks=(chunk_rows, seq_len, d_model), compressors=compressors, fill_value=0,
                       attributes=hidden_attrs, config=fast)
    group.create_array("targets", shape=(n_rows, seq_len), dtype="int32", chunks=(chunk_rows, seq_len),
                       compressors=None, fill_value=0, config=fast)
    group.attrs.update(attrs)  # written last: attributes present means both arrays exist


def _existing_attrs(store: Store, key: str) -> dict[str, Any] | None:
    try:
        group = zarr.open_group(store.zarr_store(key, read_only=True), mode="r")
        group["hidden"], group["targets"]  # noqa: B018 - both arrays must exist
        return dict(group.attrs)
    except (FileNotFoundError, KeyError, ValueError, zarr.errors.BaseZarrError):
        return None


def _open(store: Store, key: str, read_only: bool) -> tuple[zarr.Array, zarr.Array, dict[str, Any]]:
    try:
        group = zarr.open_group(store.zarr_store(key, read_only=read_only), mode="r" if read_only else "r+")
        hidden, targets = group["hidden"], group["targets"]
    except (FileNotFoundError, KeyError, zarr.errors.BaseZarrError) as e:
        raise ActivationError(f"activation group {store.url_of(key)} does not exist or is malformed: {e}") from e
    attrs = dict(group.attrs)
    if "n_shards" not in attrs:
        raise ActivationError(f"activation group {store.url_of(key)} was not fully created (no attributes)")
    return hidden, targets, attrs


def _rows(attrs: dict[str, Any], shard: int) -> tuple[int, int]:
    if not 0 <= shard < attrs["n_shards"]:
        raise ActivationError(f"shard must be in [0, {attrs['n_shards']}), got {shard}")
    lo = shard * attrs["shard_rows"]
    return lo, min(lo + attrs["shard_rows"], attrs["n_rows"])


def _hidden_to_stored(hidden: torch.Tensor, dtype: str) -> np.ndarray:
    hidden = hidden.detach().to("cpu")
    if dtype == "bfloat16":  # no native bf16 in Zarr: keep the exact 16-bit pattern
        return hidden.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return hidden.to(getattr(torch, dtype)).contiguous().numpy()


def _hidden_from_stored(arr: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(np.ascontiguousarray(arr)).float()


def _crc(arr: np.ndarray) -> int:
    """crc32 of the bytes as stored: 2 GB/s here, twice sha256, and all a truncation or bit flip needs."""
    return zlib.crc32(np.ascontiguousarray(arr).data)


def _marker_key(key: str, shard: int) -> str:
    return f"{key}/done/{shard}.json"


def write_shard(store: Store, key: str, shard: int, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Write exactly the rows of one shard (one region write of whole chunks), then its marker."""
    h_arr, t_arr, attrs = _open(store, key, read_only=False)
    lo, hi = _rows(attrs, shard)
    T, d = attrs["seq_len"], attrs["d_model"]
    if tuple(hidden.shape) != (hi - lo, T, d) or tuple(targets.shape) != (hi - lo, T):
        raise ActivationError(f"shard {shard} of {key} holds rows [{lo}, {hi}): expected hidden {(hi - lo, T, d)} "
                              f"and targets {(hi - lo, T)}, got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    store.rm(_marker_key(key, shard))  # a rewrite is incomplete until its new marker lands
    cr = attrs["chunk_rows"]
    if hi == attrs["n_rows"] and hi % cr:  # the ragged last chunk: never merge with a damaged old object
        store.rm(key, "hidden", "c", str(hi // cr))
        store.rm(key, "targets", "c", str(hi // cr))
    h = _hidden_to_stored(hidden, attrs["dtype"])  # (rows, T, d)
    y = targets.detach().to("cpu", torch.int32).contiguous().numpy()  # (rows, T)
    with ThreadPoolExecutor(1) as pool:  # zlib releases the GIL: checksum while zarr writes
        h_crc = pool.submit(_crc, h)
        h_arr[lo:hi] = h
        t_arr[lo:hi] = y
        marker = {"shard": shard, "lo": lo, "hi": hi, "dtype": attrs["dtype"],
                  "hidden_crc32": h_crc.result(), "targets_crc32": _crc(y)}
    store.write_json(marker, _marker_key(key, shard))
    return marker


def complete_shards(store: Store, key: str) -> set[int]:
    """Shards with a completion marker (cheap: lists markers, reads no data)."""
    return {int(name[:-5]) for name in store.listdir(key, "done") if name.endswith(".json") and name[:-5].isdigit()}


def verify_shard(store: Store, key: str, shard: int) -> None:
    """Raise ActivationError unless the shard has a marker and its stored bytes match the marker's checksums."""
    h_arr, t_arr, attrs = _open(store, key, read_only=True)
    lo, hi = _rows(attrs, shard)
    mkey = _marker_key(key, shard)
    if not store.exists(mkey):
        raise ActivationError(f"shard {shard} (rows [{lo}, {hi})) of {key} has no completion marker {mkey}")
    marker = store.read_json(mkey)
    if (marker.get("lo"), marker.get("hi"), marker.get("dtype")) != (lo, hi, attrs["dtype"]):
        raise ActivationError(f"marker {mkey} describes rows [{marker.get('lo')}, {marker.get('hi')}) "
                              f"{marker.get('dtype')}, the group expects [{lo}, {hi}) {attrs['dtype']}")
    try:
        h, y = h_arr[lo:hi], t_arr[lo:hi]
    except (ValueError, OSError, zarr.errors.BaseZarrError) as e:  # e.g. truncated shard: index checksum fails
        raise ActivationError(f"shard {shard} of {key} is unreadable: {e}") from e
    for name, arr in (("hidden", h), ("targets", y)):
        crc = _crc(arr)
        if crc != marker.get(f"{name}_crc32"):
            raise ActivationError(f"shard {shard} of {key} is corrupt: {name} crc32 {crc} != marker "
                                  f"{marker.get(f'{name}_crc32')}")


def shard_complete(store: Store, key: str, shard: int) -> bool:
    """True when the shard has a marker and its data re-read matches the marker (DESIGN §3 I5)."""
    try:
        verify_shard(store, key, shard)
    except ActivationError:
        return False
    return True


class ActivationReader:
    """Read-only view of a finished activation group; every shard must carry a completion marker.

    ``verify=True`` also re-hashes every shard on open (one full extra read of the group)."""

    def __init__(self, store: Store, key: str, verify: bool = False):
        self.store, self.key = store, key
        self._hidden, self._targets, attrs = _open(store, key, read_only=True)
        self.attrs = attrs
        self.n_rows, self.seq_len, self.d_model = attrs["n_rows"], attrs["seq_len"], attrs["d_model"]
        self.dtype, self.shard_rows, self.n_shards = attrs["dtype"], attrs["shard_rows"], attrs["n_shards"]
        done = complete_shards(store, key)
        for s in range(self.n_shards):
            if s not in done:
                lo, hi = _rows(attrs, s)
                raise ActivationError(f"activation group {key} is incomplete: shard {s} (rows [{lo}, {hi})) "
                                      f"has no completion marker")
            if verify:
                verify_shard(store, key, s)

    def __len__(self) -> int:
        return self.n_rows

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi): hidden (hi-lo, T, d) float32 and targets (hi-lo, T) long."""
        if not 0 <= lo <= hi <= self.n_rows:
            raise ActivationError(f"row range [{lo}, {hi}) is outside [0, {self.n_rows}) of {self.key}")
        h = _hidden_from_stored(self._hidden[lo:hi], self.dtype)  # (B, T, d)
        y = torch.from_numpy(np.ascontiguousarray(self._targets[lo:hi])).long()  # (B, T)
        return h, y
