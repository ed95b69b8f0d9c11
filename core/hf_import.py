"""Fine-tuning a Hugging Face checkpoint: check it against a run config, write it as a run's version 0.

The mapping tables are ``models/hf_names.py`` (pure), the file reading ``storage/hf_checkpoint.py``; this module joins them:

    mcfg = checkpoint_model(cfg)                       # config.json only, checked against the run config
    ck = check_checkpoint(cfg)                         # every file, tensor and the tokenizer: once per run start
                                                       # (the CLI's preflight; a file changed since: again)
    entries = write_version0(store, run_id, ck, mcfg, plan)   # block by block, never the whole model

Each block's tensors are read by name from the shards that hold them (views of the mapped file), mapped to
our names and layout, and written as that block's content-addressed file in the checkpoint's own dtype
(``bf16`` stays ``bf16``: loading a block upcasts it into the fp32 model, and an export casts back exactly),
so peak memory is about one block, and a later visit reads only the blocks it needs, as for any run.
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache

from tokenizers import Tokenizer

from bcdflow.core.config import RunConfig, check_model
from bcdflow.models import Plan, hf_names as hfmap
from bcdflow.models.build import param_shapes
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.errors import ConfigError
from bcdflow.storage import checkpoints
from bcdflow.storage.corpus import eos_id
from bcdflow.storage.errors import DataError
from bcdflow.storage.hf_checkpoint import KEY, ST_DTYPES, Checkpoint, read_config, resolve
from bcdflow.storage.store import Store


@lru_cache(maxsize=8)
def _config_at(path: str, mtime_ns: int, size: int) -> dict:
    return read_config(os.path.dirname(path))


def hf_config(spec: str) -> dict:
    """config.json of ``model.from_hf`` (re-read only when the file changes)."""
    path = os.path.join(resolve(spec), "config.json")
    try:
        st = os.stat(path)
    except OSError:
        return read_config(os.path.dirname(path))  # raises the DataError naming the missing file
    return _config_at(path, st.st_mtime_ns, st.st_size)


def checkpoint_model(cfg: RunConfig) -> ModelConfig:
    """Our model config of ``model.from_hf`` (its config.json only), checked against the run config: the block
    cuts, the sequence length against the context and against a sliding attention window."""
    try:
        raw = hf_config(cfg.model.from_hf)
    except DataError as e:  # no such directory, not in the HF cache, no config.json: the config key is at fault
        raise ConfigError(str(e)) from None
    mcfg = hfmap.config_from_hf(raw)
    check_model(cfg, mcfg)
    window = hfmap.attention_window(raw)
    if window is not None and cfg.data.seq_len > window:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds the checkpoint's sliding attention window "
                          f"{window} (bcdflow trains full causal attention; use data.seq_len <= {window})")
    return mcfg


def tensor_names(ck: Checkpoint, mcfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the name it has in the checkpoint's files (older GPT-2 files lack the
    ``transformer.`` prefix). A missing tensor, a shape that contradicts config.json or a dtype other than
    fp32/bf16/fp16 is bad input naming the tensor."""
    prefix = hfmap.hf_format(mcfg.family).base_prefix
    out = {}
    for ours, shape in param_shapes(mcfg).items():
        canonical = hfmap.hf_name(mcfg, ours)
        name = next((n for n in (canonical, canonical.removeprefix(prefix)) if n in ck.weight_map), None)
        if name is None:
            raise DataError(f"{KEY}: tensor {canonical!r} is missing from the checkpoint {ck.dir!r}")
        dtype, got = ck.info(name)
        want = hfmap.hf_shape(mcfg, ours, shape)
        if got != want:
            raise DataError(f"{KEY}: tensor {name!r} has shape {list(got)}, config.json implies {list(want)}")
        if dtype not in ST_DTYPES:
            raise DataError(f"{KEY}: tensor {name!r} is {dtype}; supported: {', '.join(ST_DTYPES)}")
        out[ours] = name
    return out


def source_dtype(ck: Checkpoint, mcfg: ModelConfig) -> str:
    """The checkpoint's weight dtype (of its token embedding), as torch names it: float32, bfloat16, float16."""
    return ST_DTYPES[ck.info(tensor_names(ck, mcfg)["wte.weight"])[0]]


_checked: dict[tuple, Checkpoint] = {}  # the last check in this process: what it read, as it was -> its checkpoint
_checked_lock = threading.Lock()


def _what_check_reads(cfg: RunConfig) -> tuple | None:
    """The settings :func:`check_checkpoint` checks and every file it reads as they are now (the checkpoint folder's
    and ``data.tokenizer``: name, size, modification time); None when they cannot be listed (the check says why)."""
    try:
        folder = resolve(cfg.model.from_hf)
        files = tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in os.scandir(folder) for st in [e.stat()]))
        tok = os.stat(os.path.expanduser(cfg.data.tokenizer)) if cfg.data.tokenizer else None
    except (OSError, DataError):
        return None
    d, b = cfg.data, cfg.bcd
    return (cfg.model.from_hf, folder, files, d.tokenizer, tok and (tok.st_size, tok.st_mtime_ns), d.format, d.seq_len,
            b.blocks, tuple(b.boundaries or ()))


def check_checkpoint(cfg: RunConfig) -> Checkpoint:
    """Everything about ``model.from_hf`` that needs its files, before anything is written: config.json, the
    index and every shard it lists, each tensor's presence, shape and dtype, the tokenizer (its ids must fit
    the embedding rows; padded rows beyond the tokenizer are normal), the chat template for
    ``data.format=chat``, and that ``data.tokenizer`` does not contradict the checkpoint's.

    Once per run start: the CLI's preflight checks, and the data check and the flow's first write (the token dataset,
    ``tasks/data.py``) take that check while nothing it read has changed (a file's size or time, a setting it
    checks); a change checks again."""
    key = _what_check_reads(cfg)
    with _checked_lock:
        if key is not None and key in _checked:
            return _checked[key]
    ck = _check(cfg)
    if key is not None:
        with _checked_lock:
            _checked.clear()
            _checked[key] = ck
    return ck


def _check(cfg: RunConfig) -> Checkpoint:
    ck = Checkpoint.open(cfg.model.from_hf)
    mcfg = checkpoint_model(cfg)
    tensor_names(ck, mcfg)
    try:
        tok = Tokenizer.from_file(ck.tokenizer_json)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise DataError(f"{KEY}: {ck.tokenizer_json!r} is not a valid tokenizer.json ({e})") from None
    ids = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if ids > mcfg.vocab_size:
        raise DataError(f"{KEY}: tokenizer.json has ids up to {ids - 1}, but the token embedding has only "
                        f"{mcfg.vocab_size} rows (vocab_size in config.json)")
    eos_token(ck, tok)
    if cfg.data.tokenizer:
        with open(os.path.expanduser(cfg.data.tokenizer), "rb") as a, open(ck.tokenizer_json, "rb") as b:
            if a.read() != b.read():
                raise DataError(f"data.tokenizer: {cfg.data.tokenizer!r} differs from the tokenizer.json of "
                                f"model.from_hf (a checkpoint brings its own tokenizer; drop data.tokenizer)")
    if cfg.data.format == "chat" and ck.chat_template is None:
        raise DataError(f"data.format: chat needs a chat template, and {ck.dir!r} has none "
                        "(no chat_template.jinja, no chat_template in tokenizer_config.json)")
    return ck


def eos_token(ck: Checkpoint, tok) -> str:
    """The token that ends a document or a completion: tokenizer_config's eos_token, else the first of
    storage.corpus.EOS_CANDIDATES in the vocabulary."""
    t = ck.special_tokens.get("eos_token")
    if t is not None and tok.token_to_id(t) is not None:
        return t
    return tok.id_to_token(eos_id(tok, key=f"{KEY}: tokenizer.json"))


def record(ck: Checkpoint, mcfg: ModelConfig) -> dict:
    """What the run's config.json keeps about its source (``hf``): resume refuses a changed checkpoint."""
    return {"source": ck.spec, "dir": ck.dir, "architecture": hfmap.architecture(ck.config),
            "dtype": source_dtype(ck, mcfg), "fingerprint": ck.fingerprint()}


def write_version0(store: Store, run_id: str, ck: Checkpoint, mcfg: ModelConfig, plan: Plan) -> dict[int, dict]:
    """Each block of ``plan`` as a block file: its tensors read by name, mapped, written, dropped. Returns the
    manifest entries; the caller writes the manifest."""
    names = tensor_names(ck, mcfg)
    entries = {}
    for blk in plan.blocks:
        raw = ck.read([names[n] for n in blk.params])
        tensors = {n: hfmap.from_hf(mcfg, n, raw.pop(names[n])) for n in blk.params}
        entries[blk.index] = checkpoints.save_block(store, run_id, tensors)
        del tensors, raw  # the mapped views go with them: the next block starts from nothing
    return entries

