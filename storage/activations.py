"""Activation groups: the pre-inference output of one visit (paper §3.2.2; docs/DESIGN.md §2 step 2, §5).

``runs/{run_id}/visits/c{c}-b{b}/activations.zarr`` is a Zarr 3 group with two arrays::

    hidden   [n, T, d]  float32 | float16 | uint16 (bfloat16 bit pattern, attribute logical_dtype)
    targets  [n, T]     int32
    done/{shard}.json   completion marker per shard: row range, crc32 of the bytes as written, and an XXH3-64
                        checksum of each of its chunks

A *shard* (bcdflow's unit of pre-inference work, ``shard_rows`` rows) is stored as whole Zarr chunks of
~16 MB, one object each. Each pre-inference task owns whole chunks, so concurrent writers never share an
object, which is what makes concurrent writes safe. Zarr's sharding codec was tried and dropped: in
zarr 3.1 a region write of a whole shard still takes the partial-write path (zero-filled scratch chunks,
an all-zeros scan, a join), about 5x slower than writing the same bytes to a file. Whole-chunk objects
write at raw-file speed (benchmarks/store_throughput.py).

The array metadata is created once by the coordinator (``create_group``). Zarr has no native bfloat16, so
its 16-bit pattern is stored. Activations barely compress, so compressors are off by default (zstd level 1
on request). A shard counts as complete only when its marker exists and the stored bytes still match the
marker's checksum (docs/DESIGN.md §3 I5), so a truncated or altered shard is redone, never trained on.

Reading (``ActivationReader``): an uncompressed chunk object's bytes are the array bytes (Zarr's ``bytes`` codec,
little-endian, C order), so the reader fetches whole chunk objects straight from the store (one request each,
no Zarr call per batch), checks each against its marker's checksum the first time it is read (a shard altered after
its marker was written is refused at training time, naming the shard; a resume recomputes it), keeps the last
chunks so the batches inside one chunk do not read it again, and reads the next chunk in a thread while the
current one is used. Groups with zstd, or markers written before per-chunk checksums, are read through Zarr,
each shard verified whole on first use. Batches are pageable host tensors; a training loop stages them into
page-locked memory of its own for asynchronous copies to a GPU (tasks/engine.prefetched).

Usage::

    create_group(store, key, n_rows=n, seq_len=T, d_model=d, shard_rows=256, dtype="bfloat16")
    for s in range(n_shards): write_shard(store, key, s, hidden, targets)   # one task per shard
    reader = ActivationReader(store, key); h, y = reader.read(0, 32)          # (32, T, d) float32, (32, T) long
"""
from __future__ import annotations

import logging
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
import zarr

from bcdflow.errors import DamagedArtifact

from .act_layout import default_chunk_rows as _default_chunk_rows
from .layout import shard_done_key
from .store import Store

log = logging.getLogger(__name__)
DTYPES = ("float32", "float16", "bfloat16")
_STORED = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}


class ActivationError(DamagedArtifact):
    """An activation group is missing, incomplete, malformed or fails its checksum."""


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


def _crc(arr: np.ndarray) -> int:
    """crc32 of the bytes as stored: 2 GB/s here, twice sha256, and all a truncation or bit flip needs."""
    return zlib.crc32(np.ascontiguousarray(arr).data)


def _xxh(arr: np.ndarray) -> int:
    """XXH3-64 of the bytes as stored, per chunk: checked on every training read, so it must outrun the disk; it
    hashes 30 GB/s here against zlib crc32's 2.6 GB/s (which alone costs 70% of a raw read of the same bytes)
    and catches truncations and flipped bits alike. The hash zstd frames carry; xxhash comes with ``datasets``."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(arr))


def _crcs(arr: np.ndarray, rows: int) -> tuple[int, list[int]]:
    """crc32 of the whole array, and XXH3-64 of each ``rows``-row chunk of it (the chunk objects' rows)."""
    return _crc(arr), [_xxh(arr[i:i + rows]) for i in range(0, len(arr), rows)]


def write_shard(store: Store, key: str, shard: int, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Write exactly the rows of one shard (one region write of whole chunks), then its marker."""
    h_arr, t_arr, attrs = _open(store, key, read_only=False)
    lo, hi = _rows(attrs, shard)
    T, d = attrs["seq_len"], attrs["d_model"]
    if tuple(hidden.shape) != (hi - lo, T, d) or tuple(targets.shape) != (hi - lo, T):
        raise ActivationError(f"shard {shard} of {key} holds rows [{lo}, {hi}): expected hidden {(hi - lo, T, d)} "
                              f"and targets {(hi - lo, T)}, got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    store.rm(shard_done_key(key, shard))  # a rewrite is incomplete until its new marker lands
    cr = attrs["chunk_rows"]
    if hi == attrs["n_rows"] and hi % cr:  # the ragged last chunk: never merge with a damaged old object
        store.rm(key, "hidden", "c", str(hi // cr))
        store.rm(key, "targets", "c", str(hi // cr))
    h = _hidden_to_stored(hidden, attrs["dtype"])  # (rows, T, d)
    y = targets.detach().to("cpu", torch.int32).contiguous().numpy()  # (rows, T)
    with ThreadPoolExecutor(1) as pool:  # zlib releases the GIL: checksum while zarr writes
        h_crc = pool.submit(_crcs, h, cr)
        h_arr[lo:hi] = h
        t_arr[lo:hi] = y
        h_whole, h_chunks = h_crc.result()
        y_whole, y_chunks = _crcs(y, cr)
        marker = {"shard": shard, "lo": lo, "hi": hi, "dtype": attrs["dtype"],
                  "hidden_crc32": h_whole, "targets_crc32": y_whole,
                  "chunks": {"rows": cr, "hidden_xxh3": h_chunks, "targets_xxh3": y_chunks}}
    store.write_json(marker, shard_done_key(key, shard))
    return marker


def complete_shards(store: Store, key: str) -> set[int]:
    """Shards with a completion marker (cheap: lists markers, reads no data)."""
    return {int(name[:-5]) for name in store.listdir(shard_done_key(key)) if name.endswith(".json") and name[:-5].isdigit()}


def verify_shard(store: Store, key: str, shard: int) -> None:
    """Raise ActivationError unless the shard has a marker and its stored bytes match the marker's checksums."""
    h_arr, t_arr, attrs = _open(store, key, read_only=True)
    lo, hi = _rows(attrs, shard)
    mkey = shard_done_key(key, shard)
    if not store.exists(mkey):
        raise ActivationError(f"shard {shard} (rows [{lo}, {hi})) of {key} has no completion marker {mkey}")
    try:
        marker = store.read_json(mkey)
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        raise ActivationError(f"marker {mkey} of shard {shard} is damaged (not a JSON object)")
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
    """True when the shard has a marker and its data re-read matches the marker (docs/DESIGN.md §3 I5). A shard with
    a marker that fails the check is logged (one line): its caller computes it again."""
    try:
        verify_shard(store, key, shard)
    except ActivationError as e:
        if store.exists(shard_done_key(key, shard)):  # written once, damaged since: say why it is redone
            log.warning("%s: it is computed again", e)
        return False
    return True


_LE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def _raw_bytes(arr: zarr.Array) -> bool:
    """True when a chunk object of ``arr`` holds exactly its little-endian array bytes (no filter, no compressor)."""
    endian = getattr(getattr(arr.serializer, "endian", None), "value", None)
    return (not arr.compressors and not arr.filters and type(arr.serializer).__name__ == "BytesCodec"
            and endian in (None, "little"))


def _to_float32(arr: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Stored hidden rows -> ``out`` (float32), exactly (bf16 -> fp32 is a 16-bit shift)."""
    if dtype == "bfloat16":
        np.left_shift(arr.astype(np.uint32), 16, out=out.view(np.uint32))
    else:
        np.copyto(out, arr, casting="safe" if dtype == "float16" else "no")


class ActivationReader:
    """Read-only view of a finished activation group; every shard must carry a completion marker.

    ``verify=True`` also re-hashes every shard on open (one full extra read of the group); without it each chunk
    is checked when first read. Batches are pageable host tensors (a view of a chunk where a batch lies inside one);
    the loop stages them into page-locked memory of its own (tasks/engine.prefetched)."""

    CACHE_CHUNKS = 2  # the chunks batches were last served from (a batch may straddle two)
    PREFETCH = 8  # chunks read ahead, each in its own thread: the disk sees several requests at once

    def __init__(self, store: Store, key: str, verify: bool = False, prefetch: bool = True):
        self.store, self.key = store, key
        self._hidden, self._targets, attrs = _open(store, key, read_only=True)
        self.attrs = attrs
        self.n_rows, self.seq_len, self.d_model = attrs["n_rows"], attrs["seq_len"], attrs["d_model"]
        self.dtype, self.shard_rows, self.n_shards = attrs["dtype"], attrs["shard_rows"], attrs["n_shards"]
        self.chunk_rows = attrs["chunk_rows"]
        done = complete_shards(store, key)
        for s in range(self.n_shards):
            if s not in done:
                lo, hi = _rows(attrs, s)
                raise ActivationError(f"activation group {key} is incomplete: shard {s} (rows [{lo}, {hi})) "
                                      f"has no completion marker")
            if verify:
                verify_shard(store, key, s)
        # whole chunk objects are the array bytes when nothing but Zarr's little-endian bytes codec sits between
        self._direct = attrs.get("compression", "none") == "none" and all(_raw_bytes(a) for a in (self._hidden,
                                                                                               self._targets))
        self._markers: dict[int, dict] = {}
        self._verified: set[int] = set()
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.PREFETCH, thread_name_prefix="acts-prefetch") if prefetch else None

    def __len__(self) -> int:
        return self.n_rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:
                pool.shutdown(wait=False, cancel_futures=True)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the pool's module may be gone already
                pass

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi): hidden (hi-lo, T, d) float32 and targets (hi-lo, T) long."""
        if not 0 <= lo <= hi <= self.n_rows:
            raise ActivationError(f"row range [{lo}, {hi}) is outside [0, {self.n_rows}) of {self.key}")
        T, d, cr = self.seq_len, self.d_model, self.chunk_rows
        first, end = lo // cr, max(lo // cr + 1, -(-hi // cr))
        if self._pool is not None:  # the chunks after this batch, read while it trains
            for c in range(end, min(end + self.PREFETCH, -(-self.n_rows // cr))):
                self._prefetch(c)
        if end - first == 1 and self.dtype == "float32":  # inside one chunk: a view, no copy
            ch, cy = self._chunk(first)
            a, b = lo - first * cr, hi - first * cr
            return torch.from_numpy(ch[a:b]), torch.from_numpy(cy[a:b].astype(np.int64))
        h = torch.empty((hi - lo, T, d), dtype=torch.float32)  # (B, T, d)
        y = torch.empty((hi - lo, T), dtype=torch.long)  # (B, T)
        hn, yn = h.numpy(), y.numpy()
        for c in range(first, end):
            ch, cy = self._chunk(c)
            a, b = max(lo, c * cr), min(hi, (c + 1) * cr)  # rows of this chunk in the batch
            _to_float32(ch[a - c * cr:b - c * cr], self.dtype, hn[a - lo:b - lo])
            np.copyto(yn[a - lo:b - lo], cy[a - c * cr:b - c * cr])
        return h, y

    # -- chunks --------------------------------------------------------------------------------------------
    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
            fut = self._pending.pop(c, None)
        data = fut.result() if fut is not None else self._load(c)
        with self._lock:
            self._cache[c] = data
            while len(self._cache) > self.CACHE_CHUNKS:
                self._cache.popitem(last=False)
        return data

    def _prefetch(self, c: int) -> None:
        with self._lock:
            if c in self._cache or c in self._pending:
                return
            self._pending[c] = self._pool.submit(self._load, c)

    def _marker(self, shard: int) -> dict:
        if shard not in self._markers:
            self._markers[shard] = self.store.read_json(shard_done_key(self.key, shard))
        return self._markers[shard]

    def _load(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``c``'s valid rows (stored dtype, int32 targets), checked against its shard's marker."""
        cr, T, d = self.chunk_rows, self.seq_len, self.d_model
        lo, hi = c * cr, min((c + 1) * cr, self.n_rows)
        shard = lo // self.shard_rows
        marker = self._marker(shard)
        chunks = marker.get("chunks")
        if not self._direct or not chunks or chunks.get("rows") != cr:
            if shard not in self._verified:  # older markers, zstd: the whole shard once, through Zarr
                try:
                    verify_shard(self.store, self.key, shard)
                except ActivationError as e:
                    raise self._damaged(shard, str(e)) from None
                self._verified.add(shard)
            return np.asarray(self._hidden[lo:hi]), np.asarray(self._targets[lo:hi])
        j = (lo - shard * self.shard_rows) // cr  # the chunk's index within its shard
        out = []
        for name, arr, shape, dt in (("hidden", self._hidden, (hi - lo, T, d), _LE[self.dtype]),
                                     ("targets", self._targets, (hi - lo, T), "<i4")):
            parts = (self.key, name, "c", str(c), *(["0"] * (len(shape) - 1)))
            need = int(np.prod(shape)) * np.dtype(dt).itemsize
            try:
                raw, got = self._read_object(parts, need)
            except FileNotFoundError:
                raise self._damaged(shard, f"chunk object {'/'.join(parts[1:])} is missing") from None
            if got < need:
                raise self._damaged(shard, f"chunk object {'/'.join(parts[1:])} is truncated ({got} of "
                                           f"{need} bytes)")
            rows = np.frombuffer(raw, dtype=dt, count=int(np.prod(shape))).reshape(shape)
            got_hash, want = _xxh(rows), chunks[f"{name}_xxh3"][j]
            if got_hash != want:
                raise self._damaged(shard, f"{name} chunk {c} checksum {got_hash:x} != marker {want:x}")
            out.append(rows)
        return out[0], out[1]

    def _read_object(self, parts: tuple[str, ...], need: int) -> tuple[bytearray, int]:
        """The first ``need`` bytes of a stored object into a fresh writable buffer (local files: read straight into
        it); returns the buffer and how many bytes the object had."""
        if self.store.is_local:
            buf = bytearray(need)
            with open(self.store.path(*parts), "rb", buffering=0) as f:
                view, got = memoryview(buf), 0
                while got < need:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            return buf, got
        raw = self.store.read_bytes(*parts)
        return bytearray(raw[:need]), len(raw)

    def _damaged(self, shard: int, why: str) -> ActivationError:
        lo, hi = _rows(self.attrs, shard)
        return ActivationError(f"activation shard {shard} (rows [{lo}, {hi})) of {self.store.url_of(self.key)} is "
                               f"corrupt: {why}; nothing is trained on it. Resume the run: pre-inference checks "
                               "every shard and recomputes this one")
