"""A Hugging Face checkpoint directory, read lazily by tensor name (the file half of ``model.from_hf``).

    ck = Checkpoint.open("~/models/Llama-3.2-1B")          # config.json, the weight index, no tensor data
    ck.config["architectures"], ck.weight_map["model.norm.weight"], ck.info("model.norm.weight")
    tensors = ck.read(["model.norm.weight", ...])          # only these tensors, one safe_open per shard
    ck.tokenizer_json, ck.chat_template, ck.special_tokens, ck.fingerprint()

What a directory holds: ``config.json``; ``model.safetensors``, or ``model.safetensors.index.json`` with the
shards it lists; ``tokenizer.json`` (a fast tokenizer: bcdflow never trains one for a checkpoint); optionally
``tokenizer_config.json`` (special tokens, maybe the chat template), ``chat_template.jinja`` (the template,
transformers 5), ``special_tokens_map.json`` and ``generation_config.json``. Opening reads only config.json,
the index and each shard's safetensors header (a few KB): tensor data is read by :meth:`Checkpoint.read`,
which maps the shard and hands out views, so converting a model holds one block at a time.

A hub id (``org/name``) is accepted only where the local Hugging Face cache already holds it; nothing is
downloaded. Every problem is a :class:`DataError` naming ``model.from_hf`` and the file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from functools import cached_property

import torch
from safetensors import SafetensorError, safe_open

from .errors import DataError

KEY = "model.from_hf"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the small files a run keeps a copy of, so its export needs no access to the source directory
SIDECARS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja")
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(spec: str) -> str:
    """The local directory of ``model.from_hf``: a path, or a hub id already in the local HF cache."""
    path = os.path.abspath(os.path.expanduser(str(spec)))
    if os.path.isdir(path):
        return path
    if _HUB_ID.match(str(spec)) and not os.path.exists(path):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(str(spec), local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise DataError(f"{KEY}: {spec!r} is neither a local directory nor in the local Hugging Face cache "
                            f"(bcdflow never downloads; fetch it first, e.g. `hf download {spec}`)") from None
    raise DataError(f"{KEY}: no such directory {str(spec)!r}")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{KEY}: {os.path.dirname(path)!r} has no {what}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{KEY}: {path!r} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise DataError(f"{KEY}: {path!r} does not hold a JSON object")
    return d


def read_config(directory: str) -> dict:
    """config.json of a checkpoint directory."""
    return _read_json(os.path.join(directory, "config.json"), "config.json")


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw safetensors header of a file and its parsed form (name -> dtype, shape, data_offsets), checked
    against the file's size without reading the data: each tensor's byte range must match its dtype and shape, the
    ranges must follow each other, and the last must end where the file ends (a file cut short, or with bytes after
    its data, is refused here rather than found part way through a run)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = f.read(n) if 0 < n <= min(100 << 20, size - 8) else b""
    except OSError as e:
        raise DataError(f"{KEY}: cannot read {path!r} ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict) or len(raw) != n or not isinstance(header.pop("__metadata__", {}), dict):
            raise ValueError
        end = _data_end(header)
    except (ValueError, TypeError, RecursionError):
        if 8 <= size and 8 + n > size:
            raise DataError(f"{KEY}: {path!r} is cut short (its header alone needs {8 + n} bytes, the file has "
                            f"{size}): copy or download it again") from None
        raise DataError(f"{KEY}: {path!r} is not a safetensors file (bad header)") from None
    if 8 + n + end != size:
        what = "is cut short" if 8 + n + end > size else "has bytes after its last tensor"
        raise DataError(f"{KEY}: {path!r} {what} (its header describes {8 + n + end} bytes, the file has {size}): "
                        "copy or download it again")
    return head + raw, header


# bytes per element of the safetensors dtypes whose size is whole bytes (sub-byte float formats are not checked)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def _data_end(header: dict) -> int:
    """Where the last tensor's data ends; ValueError unless every entry is well formed and the byte ranges follow
    each other from 0 without gaps or overlaps (what safetensors itself requires when it opens the file)."""
    spans = []
    for entry in header.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            raise ValueError
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):  # not bool
            raise ValueError
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError
        if entry["dtype"] in _ITEMSIZE and offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[entry["dtype"]]:
            raise ValueError
        spans.append(tuple(offsets))
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            raise ValueError
        end = hi
    return end


class Checkpoint:
    """One checkpoint directory: its config, weight index and headers; tensors read on request."""

    def __init__(self, directory: str, spec: str | None = None):
        self.dir, self.spec = directory, spec or directory
        self.config = read_config(directory)
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            d = _read_json(index, INDEX)
            wm = d.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise DataError(f"{KEY}: {index!r} has no weight_map of tensor name -> shard file")
            self.index_bytes = json.dumps(d, sort_keys=True).encode()
            self.weight_map: dict[str, str] = dict(wm)
            files = sorted(set(wm.values()))
        elif os.path.exists(os.path.join(directory, SINGLE)):
            self.index_bytes, files, self.weight_map = b"", [SINGLE], {}
        else:
            raise DataError(f"{KEY}: {directory!r} has neither {SINGLE} nor {INDEX}")
        self._raw: dict[str, bytes] = {}
        self._headers: dict[str, dict] = {}
        for name in files:
            path = os.path.join(directory, name)
            where = f" (listed in {INDEX})" if self.index_bytes else ""
            if os.path.dirname(os.path.normpath(name)) or name in ("", ".", ".."):
                raise DataError(f"{KEY}: shard {name!r}{where} is not a file name inside {directory!r}")
            if not os.path.isfile(path):
                raise DataError(f"{KEY}: shard {name!r}{where} is missing from {directory!r}")
            self._raw[name], self._headers[name] = read_header(path)
        if not self.index_bytes:
            self.weight_map = {t: SINGLE for t in self._headers[SINGLE]}
        for t, name in self.weight_map.items():
            if t not in self._headers[name]:
                raise DataError(f"{KEY}: tensor {t!r} is listed in {INDEX} under {name!r} but that shard lacks it")

    @classmethod
    def open(cls, spec: str) -> "Checkpoint":
        return cls(resolve(spec), spec)

    def __repr__(self) -> str:
        return f"Checkpoint({self.dir!r}, {len(self.weight_map)} tensors in {len(self._headers)} file(s))"

    # -- tensors ------------------------------------------------------------------------------------------
    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype as safetensors names it, shape) of a stored tensor; KeyError if absent."""
        h = self._headers[self.weight_map[name]][name]
        return h["dtype"], tuple(h["shape"])

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """These tensors only, grouped by shard: one ``safe_open`` per shard, closed before the next. The
        tensors are views of the mapped file (no copy) until something writes or converts them."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            path = os.path.join(self.dir, file)
            try:
                with safe_open(path, framework="pt") as f:
                    for n in group:
                        out[n] = f.get_tensor(n)
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                # the file changed or went bad since it was opened: input to fix, not a fault that a retry fixes
                raise DataError(f"{KEY}: cannot read {path!r} whole ({' '.join(str(e).split())[:200]}): copy or "
                                "download it again") from None
        return out

    # -- tokenizer ------------------------------------------------------------------------------------------
    @property
    def tokenizer_json(self) -> str:
        path = os.path.join(self.dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"{KEY}: {self.dir!r} has no tokenizer.json (bcdflow uses the checkpoint's fast "
                            "tokenizer as is)")
        return path

    @cached_property
    def tokenizer_config(self) -> dict:
        path = os.path.join(self.dir, "tokenizer_config.json")
        return _read_json(path, "tokenizer_config.json") if os.path.exists(path) else {}

    @cached_property
    def chat_template(self) -> str | None:
        """``chat_template.jinja`` (transformers 5) or ``tokenizer_config.json``'s ``chat_template`` (a string,
        or a list of named templates of which ``default`` is used)."""
        path = os.path.join(self.dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        t = self.tokenizer_config.get("chat_template")
        if isinstance(t, list):
            t = next((e.get("template") for e in t if isinstance(e, dict) and e.get("name") == "default"), None)
        return t if isinstance(t, str) and t.strip() else None

    @cached_property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/pad/unk token strings from tokenizer_config.json (then special_tokens_map.json)."""
        path = os.path.join(self.dir, "special_tokens_map.json")
        sources = [self.tokenizer_config, _read_json(path, "special_tokens_map.json") if os.path.exists(path) else {}]
        out: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            for src in sources:
                v = src.get(key)
                v = v.get("content") if isinstance(v, dict) else v  # AddedToken as a dict
                if isinstance(v, str) and v:
                    out[key] = v
                    break
        return out

    # -- identity -------------------------------------------------------------------------------------------
    def sidecars(self) -> dict[str, bytes]:
        """The small files a run copies into the store (config, tokenizer, generation config)."""
        out = {}
        for name in SIDECARS:
            path = os.path.join(self.dir, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out

    def fingerprint(self, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
        """sha256 over what decides the model and its tokens: the sidecar files, the index, every shard's name,
        size and safetensors header (each tensor's dtype, shape and byte range), and ``samples`` slices of
        ``sample_bytes`` spread evenly over each shard's tensor data. A checkpoint retrained or replaced under the
        same path changes every slice; reading ~1 MB per shard keeps this cheap for any model size, and it does
        not depend on file times, so a copy of the same checkpoint on another machine matches."""
        h = hashlib.sha256()
        for name, data in sorted(self.sidecars().items()):
            h.update(f"{name}\0{len(data)}\0".encode() + data)
        h.update(self.index_bytes)
        for name in sorted(self._raw):
            path = os.path.join(self.dir, name)
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\0".encode() + self._raw[name])
            start, span = len(self._raw[name]), max(0, size - len(self._raw[name]) - sample_bytes)
            with open(path, "rb") as f:
                for k in range(samples):
                    f.seek(start + span * k // max(1, samples - 1))
                    h.update(f.read(sample_bytes))
        return h.hexdigest()
