"""Tokenized, packed token datasets in Zarr, content-addressed and shared across runs (DESIGN §5).

    {root}/datasets/{id}/train.zarr      int32 [n_train, seq_len + 1]  (inputs = row[:-1], targets = row[1:])
    {root}/datasets/{id}/val.zarr        int32 [n_val,   seq_len + 1]  held-out tail of the corpus
    {root}/datasets/{id}/tokenizer.json  the tokenizer that made the ids
    {root}/datasets/{id}/meta.json       written last: its presence marks the dataset complete

The id hashes everything that decides the arrays (input bytes, tokenizer, seq_len, split), so a
second run with the same inputs finds ``meta.json`` and reuses the dataset without reading or
tokenizing any text. Use::

    ds_id = prepare_token_dataset(store, files="~/corpus/*.txt", seq_len=256, vocab_size=8192)
    ds = TokenDataset.open(store, ds_id)
    x = ds.train_rows(np.array([5, 0, 17]))   # (3, 257) int32
"""
from __future__ import annotations

import threading

import hashlib
import json
import os
from datetime import datetime, timezone

import numpy as np
import zarr
from tokenizers import Tokenizer

from . import corpus
from .errors import DataError
from .store import Store, sha256_bytes

FORMAT_VERSION = 1
CHUNK_BYTES = 2 << 20  # ~2 MB of rows per Zarr chunk: big enough for object stores, small for random reads


def dataset_id(*, files: list[str] | None = None, path: str | None = None, name: str | None = None,
               split: str = "train", text_field: str = "text", seq_len: int, vocab_size: int,
               tokenizer_file: str | None = None, val_fraction: float = 0.05,
               max_chars: int | None = None) -> str:
    """First 16 hex chars of a sha256 over what decides the arrays. ``files`` are resolved
    paths; only their bytes (in order) count, not where they live. A hub dataset counts by
    path/name/split: a new upstream revision under the same name reuses the old arrays."""
    return _id_of(_sources(files, path, name, split), text_field=text_field, seq_len=seq_len,
                  vocab_size=vocab_size, tokenizer_file=tokenizer_file, val_fraction=val_fraction,
                  max_chars=max_chars)


def _id_of(sources: list[dict], *, text_field, seq_len, vocab_size, tokenizer_file, val_fraction, max_chars) -> str:
    """The id from already-hashed sources (prepare hashes each input file once, for id and meta)."""
    key = {
        "format": FORMAT_VERSION,
        "sources": [s.get("sha256") or [s["path"], s["name"], s["split"]] for s in sources],
        "text_field": text_field,
        # a user tokenizer fixes the vocabulary; vocab_size only matters when we train one
        "tokenizer": _file_sha256(tokenizer_file, "data.tokenizer") if tokenizer_file else None,
        "vocab_size": None if tokenizer_file else vocab_size,
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "max_chars": max_chars,
    }
    return sha256_bytes(json.dumps(key, sort_keys=True).encode())[:16]


def prepare_token_dataset(store: Store, *, files: str | list[str] | None = None, path: str | None = None,
                          name: str | None = None, split: str = "train", text_field: str = "text",
                          seq_len: int, vocab_size: int, tokenizer_file: str | None = None,
                          val_fraction: float = 0.05, max_chars: int | None = None,
                          cache_dir: str | None = None) -> str:
    """Build (or find) the token dataset for these inputs and return its id.

    ``files`` (globs, directories) or ``path`` (a ``datasets`` name); neither means the built-in
    stdlib corpus. Every check runs before the first write, so bad input leaves the store untouched.
    """
    if seq_len < 1:
        raise DataError(f"data.seq_len: must be >= 1, got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    if not tokenizer_file:
        corpus.check_vocab_size(vocab_size)
    if files and path:
        raise DataError("data.files: give data.files or data.path, not both")
    if files is not None:
        files = corpus.resolve_files(files)
        corpus.check_text_files(files)
    elif not path:
        files = corpus.builtin_corpus_files()
    args = dict(files=files, path=path, name=name, split=split, text_field=text_field)
    sources = _sources(files, path, name, split)  # hashes every input file once
    ds_id = _id_of(sources, text_field=text_field, seq_len=seq_len, vocab_size=vocab_size,
                   tokenizer_file=tokenizer_file, val_fraction=val_fraction, max_chars=max_chars)
    if store.exists("datasets", ds_id, "meta.json"):
        return ds_id  # content-addressed: complete and identical, nothing to do

    texts = corpus.load_texts(**args, max_chars=max_chars, cache_dir=cache_dir)
    tok = corpus.load_tokenizer(tokenizer_file) if tokenizer_file else corpus.train_tokenizer(texts, vocab_size)
    eos = corpus.eos_id(tok)
    stream = _encode(tok, texts, eos)  # (n_tokens,) int32, documents joined by eos

    # Pack into non-overlapping rows of seq_len + 1 (stride seq_len + 1, remainder dropped):
    # a row gives seq_len next-token predictions, inputs row[:-1] and targets row[1:].
    width = seq_len + 1
    n_rows = len(stream) // width
    if n_rows < 2:
        raise DataError(f"data.seq_len: corpus too small for seq_len={seq_len} ({len(stream)} tokens make "
                        f"{n_rows} row(s) of {width}; need 2, one train and one validation)")
    rows = stream[: n_rows * width].reshape(n_rows, width)  # (N, T+1)
    n_val = min(n_rows - 1, max(1, round(n_rows * val_fraction)))
    train, val = rows[: n_rows - n_val], rows[n_rows - n_val:]  # val = tail: text the model never trains on

    for split_name, arr in (("train", train), ("val", val)):
        _write_array(store, ds_id, split_name, arr)
    store.write_bytes(tok.to_str().encode(), "datasets", ds_id, "tokenizer.json")
    meta = {
        "id": ds_id, "format": FORMAT_VERSION, "seq_len": seq_len, "vocab_size": tok.get_vocab_size(),
        "eos_id": eos, "n_train": len(train), "n_val": len(val), "n_tokens": int(len(stream)),
        "n_docs": len(texts), "val_fraction": val_fraction, "text_field": text_field,
        "tokenizer": "file" if tokenizer_file else "trained",
        "sources": sources,
        "train_sha256": _array_sha256(train), "val_sha256": _array_sha256(val),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    store.write_json(meta, "datasets", ds_id, "meta.json")  # last: the completion marker
    return ds_id


_OPEN: dict[tuple[str, str], "TokenDataset"] = {}
_OPEN_LOCK = threading.RLock()


class TokenDataset:
    """A finished token dataset, read-only. Train rows are served from memory when the array is
    small enough (one read, then numpy fancy indexing), else by orthogonal Zarr reads."""

    MAX_CACHE_BYTES = 1 << 30

    def __init__(self, store: Store, dataset_id: str, meta: dict):
        self.store, self.id, self.meta = store, dataset_id, meta
        self.seq_len: int = meta["seq_len"]
        self.vocab_size: int = meta["vocab_size"]
        self.n_train: int = meta["n_train"]
        self.n_val: int = meta["n_val"]
        self.eos_id: int = meta["eos_id"]
        self._train_arr = self._open("train")
        self._train: np.ndarray | None = None  # in-memory copy, loaded on first use
        self._val: np.ndarray | None = None

    @classmethod
    def open(cls, store: Store, dataset_id: str) -> TokenDataset:
        """Datasets are immutable (content-addressed), so one process shares one instance per store and
        id: every shard, train and eval task of a run reads and checksums the arrays once, not per task."""
        key = (store.url, dataset_id)
        with _OPEN_LOCK:
            if key not in _OPEN:
                if not store.exists("datasets", dataset_id, "meta.json"):
                    raise DataError(f"dataset {dataset_id!r}: not found "
                                    f"(no {store.url_of('datasets', dataset_id, 'meta.json')})")
                if len(_OPEN) >= 2:
                    _OPEN.pop(next(iter(_OPEN)))
                _OPEN[key] = cls(store, dataset_id, store.read_json("datasets", dataset_id, "meta.json"))
            return _OPEN[key]

    def __repr__(self) -> str:
        return f"TokenDataset({self.id!r}, n_train={self.n_train}, n_val={self.n_val}, seq_len={self.seq_len})"

    def train_rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the train array, in the order given: int32 (len(idx), seq_len + 1)."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.n_train * (self.seq_len + 1) * 4 <= self.MAX_CACHE_BYTES:
            with _OPEN_LOCK:
                if self._train is None:
                    self._train = self._load_checked("train", self._train_arr)
            return self._train[idx]
        return np.asarray(self._train_arr.oindex[idx, :], dtype=np.int32)

    def val_rows(self) -> np.ndarray:
        """All validation rows: int32 (n_val, seq_len + 1)."""
        if self._val is None:
            self._val = self._load_checked("val", self._open("val"))
        return self._val

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.store.read_bytes("datasets", self.id, "tokenizer.json").decode())

    def _open(self, split: str) -> zarr.Array:
        arr = zarr.open_array(store=self.store.zarr_store("datasets", self.id, f"{split}.zarr", read_only=True), mode="r")
        want = (self.meta[f"n_{split}"], self.seq_len + 1)
        if arr.shape != want:
            raise DataError(f"dataset {self.id!r}: {split}.zarr has shape {arr.shape}, meta.json says {want}")
        return arr

    def _load_checked(self, split: str, arr: zarr.Array) -> np.ndarray:
        data = np.asarray(arr[:], dtype=np.int32)
        if _array_sha256(data) != self.meta[f"{split}_sha256"]:  # DESIGN I5: never train on altered data
            raise DataError(f"dataset {self.id!r}: {split}.zarr checksum mismatch (truncated or altered)")
        return data


# -- helpers -------------------------------------------------------------------------------
def _encode(tok: Tokenizer, texts: list[str], eos: int, batch: int = 1024) -> np.ndarray:
    """All documents encoded and joined with ``eos`` between them: (n_tokens,) int32.
    Batches bound the memory held in ``Encoding`` objects; encode_batch runs them in parallel."""
    parts: list[np.ndarray] = []
    sep = np.array([eos], dtype=np.int32)
    for start in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[start:start + batch], add_special_tokens=False):
            if parts:
                parts.append(sep)
            parts.append(np.asarray(enc.ids, dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _write_array(store: Store, ds_id: str, split: str, arr: np.ndarray) -> None:
    rows_per_chunk = max(1, min(len(arr), CHUNK_BYTES // (arr.shape[1] * 4)))
    z = zarr.create_array(store=store.zarr_store("datasets", ds_id, f"{split}.zarr"), shape=arr.shape,
                          chunks=(rows_per_chunk, arr.shape[1]), dtype="int32", compressors=None,
                          overwrite=True)  # token ids barely compress; overwrite a crashed earlier attempt
    z[:] = arr


def _array_sha256(arr: np.ndarray) -> str:
    return sha256_bytes(np.ascontiguousarray(arr, dtype="<i4").tobytes())


def _sources(files, path, name, split) -> list[dict]:
    if files:
        return [{"file": f, "sha256": _file_sha256(f, "data.files")} for f in files]
    return [{"path": path, "name": name, "split": split}]


def _file_sha256(path: str, key: str) -> str:
    h = hashlib.sha256()
    try:
        with open(os.path.expanduser(path), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise DataError(f"{key}: cannot read {path!r} ({e.strerror or e})") from e
    return h.hexdigest()
