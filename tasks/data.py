"""Data tasks: prepare the token dataset (content-addressed, shared by runs), and the files and id it is made from.

Which rows a visit trains on, and in what order, are the method's rules: ``core/rules.py`` (``visit_rows``,
``batch_ranges``)."""
from __future__ import annotations

import os
import tempfile
from prefect import task

from bcdflow.core.hf_import import check_checkpoint, eos_token
from bcdflow.storage.corpus import read_tokenizer
from bcdflow.storage.store import Store
from bcdflow.storage.tokens import dataset_id, prepare_token_dataset
from bcdflow.core.config import RunConfig
from bcdflow.core.context import data_files
from bcdflow.tasks.retry import retrying


def _dataset_inputs(cfg: RunConfig) -> dict:
    """What decides the run's token dataset, as ``prepare_token_dataset`` and ``dataset_id`` take it. With
    ``model.from_hf`` the checkpoint is checked in full first and its tokenizer, end-of-text token and chat
    template make the dataset."""
    d = cfg.data
    tok = {"tokenizer_file": d.tokenizer}
    if cfg.model.from_hf:
        ck = check_checkpoint(cfg)
        tok = {"tokenizer_file": ck.tokenizer_json, "eos_token": eos_token(ck, read_tokenizer(ck.tokenizer_json)),
               "chat_template": ck.chat_template if d.format == "chat" else None,
               "special_tokens": ck.special_tokens if d.format == "chat" else None}
    return dict(files=data_files(cfg), path=d.path if not d.files else None, name=d.name, split=d.split,
                text_field=d.text_field, seq_len=d.seq_len, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                max_chars=d.max_chars, format=d.format, **tok)


def data_id(cfg: RunConfig) -> str:
    """The id the run's token dataset has (a hash of the files' contents and the tokenizer), computed without
    writing anything: what a resumed run's data is checked against (docs/DESIGN.md §8)."""
    return dataset_id(**_dataset_inputs(cfg))


@task(name="prepare-data", **retrying())
def prepare_data(cfg: RunConfig, store: Store) -> str:
    """:func:`token_dataset` as the run's first task (Prefect retries a store that fails for a moment)."""
    return token_dataset(cfg, store)


def token_dataset(cfg: RunConfig, store: Store) -> str:
    """Tokenize and pack the corpus once; later runs with the same inputs reuse it. Returns its id (``bcdflow plan``
    calls it to size the run's dataset).

    With ``model.from_hf`` the checkpoint is checked in full first (this is the run's first write). The ``datasets``
    library converts local files to Arrow in a cache: a temporary one, removed when the dataset is made (the token
    dataset is the store's content-addressed copy; nothing reads the Arrow files again), unless
    ``BCDFLOW_HF_CACHE`` names one; a ``data.path`` dataset is read from the Hugging Face cache it lives in."""
    inputs = _dataset_inputs(cfg)
    if cache := os.environ.get("BCDFLOW_HF_CACHE"):
        return prepare_token_dataset(store, **inputs, cache_dir=cache)
    if inputs["files"] is None:  # data.path
        return prepare_token_dataset(store, **inputs, cache_dir=None)
    with tempfile.TemporaryDirectory(prefix="bcdflow-hf-") as cache:
        return prepare_token_dataset(store, **inputs, cache_dir=cache)
