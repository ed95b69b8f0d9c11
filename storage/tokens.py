"""Tokenized, packed token datasets in Zarr, content-addressed and shared across runs (docs/DESIGN.md §5).

    {root}/datasets/{id}/train.zarr      int32 [n_train, seq_len + 1]  (inputs = row[:-1], targets = row[1:])
    {root}/datasets/{id}/val.zarr        int32 [n_val,   seq_len + 1]  held-out tail of the corpus
    {root}/datasets/{id}/train_mask.zarr uint8 [n_train, seq_len + 1]  supervised formats only: 1 = trained as a target
    {root}/datasets/{id}/val_mask.zarr   uint8 [n_val,   seq_len + 1]
    {root}/datasets/{id}/tokenizer.json  the tokenizer that made the ids
    {root}/datasets/{id}/meta.json       written last: its presence marks the dataset complete

``data.format=text`` packs documents joined by the end-of-text token back to back; ``prompt_completion``
and ``chat`` pack whole examples with a loss mask (storage/sft.py says how). Every reader gets rows as
(inputs, targets) pairs from :meth:`TokenDataset.train_pairs` / :meth:`TokenDataset.val_pairs`, where a
masked target is ``IGNORE_INDEX`` (-100, ``F.cross_entropy``'s ignore_index), so training, pre-inference (which
stores the targets with the activations) and evaluation all see the same mask.

The id hashes everything that decides the arrays (input bytes, tokenizer, seq_len, split), so a
second run with the same inputs finds ``meta.json`` and reuses the dataset without reading or
tokenizing any text. Use::

    ds_id = prepare_token_dataset(store, files="~/corpus/*.txt", seq_len=256, vocab_size=8192)
    ds = TokenDataset.open(store, ds_id)
    x = ds.train_rows(np.array([5, 0, 17]))   # (3, 257) int32
    inputs, targets = ds.train_pairs(np.array([5, 0, 17]))   # (3, 256) int64 each, masked targets = -100
"""
from __future__ import annotations

import threading

import hashlib
import json
import os
from datetime import datetime, timezone

import numpy as np
import torch
import zarr
from tokenizers import Tokenizer

from . import corpus, sft
from bcdflow.constants import IGNORE_INDEX

from bcdflow.errors import DamagedArtifact

from .errors import DataError
from .layout import DATASET_META, DATASET_TOKENIZER, dataset_key
from .store import Store, sha256_bytes

FORMAT_VERSION = 1
CHUNK_BYTES = 2 << 20  # ~2 MB of rows per Zarr chunk: big enough for object stores, small for random reads


def dataset_id(*, files: list[str] | None = None, path: str | None = None, name: str | None = None,
               split: str = "train", text_field: str = "text", seq_len: int, vocab_size: int,
               tokenizer_file: str | None = None, val_fraction: float = 0.05,
               max_chars: int | None = None, **sft_keys) -> str:
    """First 16 hex chars of a sha256 over what decides the arrays. ``files`` are resolved
    paths; only their bytes (in order) count, not where they live. A hub dataset counts by
    path/name/split: a new upstream revision under the same name reuses the old arrays.
    ``sft_keys``: ``format``, ``eos_token``, ``chat_template``, ``special_tokens`` as prepare takes them."""
    return _id_of(_sources(files, path, name, split), text_field=text_field, seq_len=seq_len,
                  vocab_size=vocab_size, tokenizer_file=tokenizer_file, val_fraction=val_fraction,
                  max_chars=max_chars, **sft_keys)


def _id_of(sources: list[dict], *, text_field, seq_len, vocab_size, tokenizer_file, val_fraction, max_chars,
           format: str = "text", eos_token: str | None = None, chat_template: str | None = None,
           special_tokens: dict | None = None) -> str:
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
    # keys added for fine-tuning only where set, so a text dataset keeps the id it always had
    if format != "text":
        key["format"] = format
    if eos_token is not None:
        key["eos_token"] = eos_token
    if format == "chat":
        key["chat_template"] = sha256_bytes((chat_template or "").encode())
        key["special_tokens"] = special_tokens or {}
    return sha256_bytes(json.dumps(key, sort_keys=True).encode())[:16]


def prepare_token_dataset(store: Store, *, files: str | list[str] | None = None, path: str | None = None,
                          name: str | None = None, split: str = "train", text_field: str = "text",
                          seq_len: int, vocab_size: int, tokenizer_file: str | None = None,
                          val_fraction: float = 0.05, max_chars: int | None = None,
                          cache_dir: str | None = None, format: str = "text", eos_token: str | None = None,
                          chat_template: str | None = None, special_tokens: dict | None = None) -> str:
    """Build (or find) the token dataset for these inputs and return its id.

    ``files`` (globs, directories) or ``path`` (a ``datasets`` name); neither means the built-in
    stdlib corpus. Every check runs before the first write, so bad input leaves the store untouched.
    ``format`` is ``data.format``; a checkpoint's tokenizer brings its ``eos_token`` (the document and
    completion end), and for ``chat`` its ``chat_template`` and the ``special_tokens`` the template sees.
    """
    files = _checked_sources(files, path, format, chat_template, seq_len, val_fraction, tokenizer_file, vocab_size)
    args = dict(files=files, path=path, name=name, split=split, text_field=text_field)
    sources = _sources(files, path, name, split)  # hashes every input file once
    sft_keys = dict(format=format, eos_token=eos_token, chat_template=chat_template, special_tokens=special_tokens)
    ds_id = _id_of(sources, text_field=text_field, seq_len=seq_len, vocab_size=vocab_size,
                   tokenizer_file=tokenizer_file, val_fraction=val_fraction, max_chars=max_chars, **sft_keys)
    if store.exists(dataset_key(ds_id, DATASET_META)):
        return ds_id  # content-addressed: complete and identical, nothing to do

    width = seq_len + 1
    tok, eos, rows, mask, counts = _encoded_rows(args, width, format, max_chars, cache_dir, tokenizer_file,
                                                 vocab_size, sft_keys)
    n_rows = len(rows)
    if n_rows < 2:
        dropped = f"; {counts['n_dropped']} example(s) dropped: a row of {width} tokens ends inside their prompt" \
            if counts.get("n_dropped") else ""
        raise DataError(f"data.seq_len: corpus too small for seq_len={seq_len} ({counts['n_tokens']} tokens make "
                        f"{n_rows} row(s) of {width}; need 2, one train and one validation{dropped})")
    n_val = min(n_rows - 1, max(1, round(n_rows * val_fraction)))
    cut = n_rows - n_val  # val = tail: text the model never trains on
    splits = {"train": rows[:cut], "val": rows[cut:]}
    if mask is not None:
        splits.update({"train_mask": mask[:cut], "val_mask": mask[cut:]})

    for split_name, arr in splits.items():
        _write_array(store, ds_id, split_name, arr)
    store.write_bytes(tok.to_str().encode(), dataset_key(ds_id, DATASET_TOKENIZER))
    meta = {
        "id": ds_id, "format": FORMAT_VERSION, "seq_len": seq_len, "vocab_size": tok.get_vocab_size(),
        "eos_id": eos, "n_train": cut, "n_val": n_val, **counts,
        "val_fraction": val_fraction, "text_field": text_field,
        "tokenizer": "file" if tokenizer_file else "trained",
        "sources": sources,
        **{f"{k}_sha256": _array_sha256(v) for k, v in splits.items()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if format != "text":
        meta["data_format"] = format
    store.write_json(meta, dataset_key(ds_id, DATASET_META))  # last: the completion marker
    return ds_id


def _checked_sources(files, path, format: str, chat_template, seq_len: int, val_fraction: float, tokenizer_file,
                     vocab_size: int) -> list[str] | None:
    """The inputs checked before anything is read or written (one line naming the key), and the text files they
    name: ``files`` resolved, the built-in corpus where neither ``files`` nor ``path`` is given, None for ``path``."""
    if format not in sft.FORMATS:
        raise DataError(f"data.format: unknown format {format!r} (choose from {', '.join(sft.FORMATS)})")
    if format == "chat" and not chat_template:
        raise DataError("data.format: chat needs a chat template (a checkpoint's tokenizer with one)")
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
    return files


def _encoded_rows(args: dict, width: int, format: str, max_chars, cache_dir, tokenizer_file, vocab_size: int,
                  sft_keys: dict):
    """The corpus read, its tokenizer (trained, or the checkpoint's) and its rows of ``width`` tokens: text packed
    into non-overlapping rows, remainder dropped; prompt/completion and chat examples packed with their loss mask.
    Returns (tokenizer, eos id, rows, mask or None, counts)."""
    eos_token, chat_template, special_tokens = (sft_keys[k] for k in ("eos_token", "chat_template", "special_tokens"))
    mask = None
    if format == "text":
        texts = corpus.load_texts(**args, max_chars=max_chars, cache_dir=cache_dir)
        tok, eos = _tokenizer(tokenizer_file, texts, vocab_size, eos_token)
        stream = _encode(tok, texts, eos)  # (n_tokens,) int32, documents joined by eos
        # Pack into non-overlapping rows of seq_len + 1 (stride seq_len + 1, remainder dropped):
        # a row gives seq_len next-token predictions, inputs row[:-1] and targets row[1:].
        n_rows = len(stream) // width
        rows = stream[: n_rows * width].reshape(n_rows, width)  # (N, T+1)
        counts = {"n_tokens": int(len(stream)), "n_docs": len(texts)}
    else:
        rec = corpus.load_records(sft.FIELDS[format], **_without(args, "text_field"), cache_dir=cache_dir)
        if format == "prompt_completion":
            texts = rec["prompt"] + rec["completion"]  # what a trained tokenizer learns from
            tok, eos = _tokenizer(tokenizer_file, texts, vocab_size, eos_token)
            examples = sft.encode_prompt_completion(tok, rec["prompt"], rec["completion"], eos)
        else:
            tok, eos = _tokenizer(tokenizer_file, [], vocab_size, eos_token)
            examples = sft.encode_chat(tok, rec["messages"], sft.ChatTemplate(chat_template, special_tokens))
        rows, mask, counts = sft.pack(examples, width, pad_id=eos)
        counts["n_tokens"] = int(sum(len(ids) for ids, _ in examples))
    return tok, eos, rows, mask, counts


def _without(args: dict, key: str) -> dict:
    return {k: v for k, v in args.items() if k != key}


def _tokenizer(tokenizer_file: str | None, texts: list[str], vocab_size: int,
               eos_token: str | None) -> tuple[Tokenizer, int]:
    """The given tokenizer.json, or a BPE trained on ``texts``; and the end-of-text id."""
    if not tokenizer_file and not texts:
        raise DataError("data.tokenizer: this format needs a tokenizer (a checkpoint's, via model.from_hf)")
    if not tokenizer_file:
        tok = corpus.train_tokenizer(texts, vocab_size)
    else:
        tok = corpus.read_tokenizer(tokenizer_file) if eos_token else corpus.load_tokenizer(tokenizer_file)
    if eos_token is not None:
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"data.tokenizer: end-of-text token {eos_token!r} is not in the vocabulary")
        return tok, eos
    return tok, corpus.eos_id(tok)


_OPEN: dict[tuple[str, str], "TokenDataset"] = {}
_OPEN_LOCK = threading.RLock()


class DamagedDataset(DamagedArtifact):
    """A stored token dataset whose arrays do not match its meta.json (truncated or altered): a damaged
    artifact (exit 1), not bad input; the dataset is content-addressed, so deleting it rebuilds it."""


class TokenDataset:
    """A finished token dataset, read-only. Train rows are served from memory when the array is
    small enough (one read, then numpy fancy indexing), else by orthogonal Zarr reads. A dataset of a
    supervised format also has a loss mask per row; :meth:`train_pairs` and :meth:`val_pairs` apply it."""

    MAX_CACHE_BYTES = 1 << 30

    def __init__(self, store: Store, dataset_id: str, meta: dict):
        self.store, self.id, self.meta = store, dataset_id, meta
        self.seq_len: int = meta["seq_len"]
        self.vocab_size: int = meta["vocab_size"]
        self.n_train: int = meta["n_train"]
        self.n_val: int = meta["n_val"]
        self.eos_id: int = meta["eos_id"]
        self.data_format: str = meta.get("data_format", "text")
        self.masked = "train_mask_sha256" in meta
        self._arrays = {"train": self._open("train")}
        if self.masked:
            self._arrays["train_mask"] = self._open("train_mask")
        self._cache: dict[str, np.ndarray] = {}  # in-memory copies, loaded on first use

    @classmethod
    def open(cls, store: Store, dataset_id: str) -> TokenDataset:
        """Datasets are immutable (content-addressed), so one process shares one instance per store and
        id: every shard, train and eval task of a run reads and checksums the arrays once, not per task."""
        key = (store.url, dataset_id)
        with _OPEN_LOCK:
            if key not in _OPEN:
                if not store.exists(dataset_key(dataset_id, DATASET_META)):
                    raise DataError(f"dataset {dataset_id!r}: not found "
                                    f"(no {store.url_of(dataset_key(dataset_id, DATASET_META))})")
                if len(_OPEN) >= 2:
                    _OPEN.pop(next(iter(_OPEN)))
                _OPEN[key] = cls(store, dataset_id, store.read_json(dataset_key(dataset_id, DATASET_META)))
            return _OPEN[key]

    def __repr__(self) -> str:
        return f"TokenDataset({self.id!r}, n_train={self.n_train}, n_val={self.n_val}, seq_len={self.seq_len})"

    def train_rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the train array, in the order given: int32 (len(idx), seq_len + 1)."""
        return self._train_array("train", idx)

    def val_rows(self) -> np.ndarray:
        """All validation rows: int32 (n_val, seq_len + 1)."""
        return self._whole("val")

    def train_pairs(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of train rows ``idx``: int64 (len(idx), seq_len) each; masked targets are IGNORE_INDEX.
        The one way training, pre-inference and the greedy probe read rows, so none can miss the mask."""
        rows = self.train_rows(idx)
        return self._pairs(rows, self._train_array("train_mask", idx) if self.masked else None)

    def trained_tokens(self, idx: np.ndarray) -> int:
        """How many target positions of train rows ``idx`` are trained (not ``IGNORE_INDEX``): every one of a
        text dataset, the unmasked ones of a supervised one (reads the mask only)."""
        if not self.masked:
            return len(idx) * self.seq_len
        return int((self._train_array("train_mask", idx)[:, 1:] != 0).sum())

    def val_pairs(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the first ``n`` validation rows (all when None), as :meth:`train_pairs`."""
        rows = self.val_rows()[:n]
        return self._pairs(rows, self._whole("val_mask")[:n] if self.masked else None)

    @staticmethod
    def _pairs(rows: np.ndarray, mask: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(rows).long()  # (n, T+1)
        inputs, targets = t[:, :-1], t[:, 1:]
        if mask is not None:  # position j is trained iff the token it predicts, row[j + 1], is
            targets = targets.masked_fill(torch.from_numpy(mask[:, 1:] == 0), IGNORE_INDEX)
        return inputs, targets

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.store.read_bytes(dataset_key(self.id, DATASET_TOKENIZER)).decode())

    def _train_array(self, name: str, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        arr = self._arrays[name]
        if self.n_train * (self.seq_len + 1) * arr.dtype.itemsize <= self.MAX_CACHE_BYTES:
            return self._whole(name)[idx]
        return np.asarray(arr.oindex[idx, :], dtype=arr.dtype)

    def _whole(self, name: str) -> np.ndarray:
        with _OPEN_LOCK:
            if name not in self._cache:
                arr = self._arrays.get(name)
                self._cache[name] = self._load_checked(name, arr if arr is not None else self._open(name))
            return self._cache[name]

    def _open(self, name: str) -> zarr.Array:
        arr = zarr.open_array(store=self.store.zarr_store(dataset_key(self.id, f"{name}.zarr"), read_only=True), mode="r")
        want = (self.meta[f"n_{name.split('_')[0]}"], self.seq_len + 1)
        if arr.shape != want:
            raise DamagedDataset(f"dataset {self.id!r}: {name}.zarr has shape {arr.shape}, meta.json says {want}")
        return arr

    def _load_checked(self, name: str, arr: zarr.Array) -> np.ndarray:
        data = np.asarray(arr[:], dtype=arr.dtype)
        if _array_sha256(data) != self.meta[f"{name}_sha256"]:  # docs/DESIGN.md I5: never train on altered data
            raise DamagedDataset(f"dataset {self.id!r}: {name}.zarr checksum mismatch (truncated or altered)")
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
    rows_per_chunk = max(1, min(len(arr), CHUNK_BYTES // (arr.shape[1] * arr.dtype.itemsize)))
    z = zarr.create_array(store=store.zarr_store(dataset_key(ds_id, f"{split}.zarr")), shape=arr.shape,
                          chunks=(rows_per_chunk, arr.shape[1]), dtype=arr.dtype.name, compressors=None,
                          overwrite=True)  # token ids barely compress; overwrite a crashed earlier attempt
    z[:] = arr


def _array_sha256(arr: np.ndarray) -> str:
    """sha256 of the little-endian bytes: int32 token rows, uint8 masks."""
    return sha256_bytes(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())


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
