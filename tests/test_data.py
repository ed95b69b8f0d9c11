"""Data layer: corpus loading, tokenizer, packed Zarr token datasets (storage/corpus.py, storage/tokens.py).

Run: python -m pytest -q tests/test_data.py   (CPU, offline, a few seconds)
"""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
import zarr

import bcdflow.storage.corpus as corpus
from bcdflow.storage.errors import DataError
from bcdflow.storage.store import Store
from bcdflow.storage.tokens import DamagedDataset, TokenDataset, dataset_id, prepare_token_dataset

SMALL = dict(seq_len=32, vocab_size=400)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test may reach the hub. The env vars cover fresh imports; datasets and huggingface_hub
    read them once at import, so the module flags are patched too."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hf(tmp_path):
    return str(tmp_path / "hf")  # datasets cache, away from the user's home


@pytest.fixture(scope="module")
def stdlib_files():
    return corpus.builtin_corpus_files(max_bytes=150_000)  # real text, ~20k tokens


def test_builtin_corpus_is_real_text_and_deterministic():
    files = corpus.builtin_corpus_files(max_bytes=300_000)
    assert files and files == corpus.builtin_corpus_files(max_bytes=300_000)
    assert all(f.endswith(".py") and "site-packages" not in f and "/test/" not in f for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 300_000
    assert len(corpus.builtin_corpus_files(max_bytes=1)) == 1  # always at least one file


def test_same_inputs_same_id_and_bitwise_same_arrays(tmp_path, hf, stdlib_files):
    a, b = Store("memory://bcd-test-det"), Store(str(tmp_path / "root"))
    id_a = prepare_token_dataset(a, files=stdlib_files, cache_dir=hf, **SMALL)
    id_b = prepare_token_dataset(b, files=stdlib_files, cache_dir=hf, **SMALL)
    assert id_a == id_b == dataset_id(files=stdlib_files, **SMALL)
    da, db = TokenDataset.open(a, id_a), TokenDataset.open(b, id_b)
    idx = np.arange(da.n_train)
    assert np.array_equal(da.train_rows(idx), db.train_rows(idx))
    assert np.array_equal(da.val_rows(), db.val_rows())
    assert da.tokenizer().to_str() == db.tokenizer().to_str()
    # anything that changes the arrays changes the id
    assert dataset_id(files=stdlib_files, seq_len=33, vocab_size=400) != id_a
    assert dataset_id(files=stdlib_files[:-1], **SMALL) != id_a
    a.rm()


def test_second_prepare_reuses_without_tokenizing(tmp_path, hf, stdlib_files, monkeypatch):
    store = Store(str(tmp_path / "root"))
    first = prepare_token_dataset(store, files=stdlib_files, cache_dir=hf, **SMALL)
    meta_before = store.read_bytes("datasets", first, "meta.json")

    def boom(*a, **k):
        raise AssertionError("texts loaded again")

    monkeypatch.setattr(corpus, "load_texts", boom)
    monkeypatch.setattr(corpus, "train_tokenizer", boom)
    assert prepare_token_dataset(store, files=stdlib_files, cache_dir=hf, **SMALL) == first
    assert store.read_bytes("datasets", first, "meta.json") == meta_before


@pytest.mark.parametrize("url", ["memory://bcd-test-rt", "local"])
def test_zarr_round_trip_packs_the_token_stream(tmp_path, hf, stdlib_files, url):
    store = Store(str(tmp_path / "root") if url == "local" else url)
    ds = TokenDataset.open(store, prepare_token_dataset(store, files=stdlib_files, cache_dir=hf, val_fraction=0.1, **SMALL))
    T = SMALL["seq_len"]
    assert (ds.seq_len, ds.n_val) == (T, max(1, round((ds.n_train + ds.n_val) * 0.1)))
    assert ds.vocab_size == ds.tokenizer().get_vocab_size() <= SMALL["vocab_size"]

    # the packed rows, train then val, are exactly the documents encoded and joined by eos
    tok, texts = ds.tokenizer(), corpus.load_texts(stdlib_files, cache_dir=hf)
    eos = tok.token_to_id(corpus.EOS)
    stream = []
    for i, t in enumerate(texts):
        stream += ([eos] if i else []) + tok.encode(t).ids
    train, val = ds.train_rows(np.arange(ds.n_train)), ds.val_rows()
    assert train.dtype == val.dtype == np.int32 and train.shape[1] == val.shape[1] == T + 1
    packed = np.concatenate([train, val]).ravel()
    assert len(stream) - len(packed) < T + 1  # only the remainder is dropped
    assert np.array_equal(packed, np.array(stream[: len(packed)], dtype=np.int32))
    assert ds.meta["n_tokens"] == len(stream)

    # rows come back in the order asked for, cached and through orthogonal Zarr reads alike
    idx = np.array([3, 0, 3, ds.n_train - 1])
    assert np.array_equal(ds.train_rows(idx), train[idx])
    assert TokenDataset.open(store, ds.id) is ds  # one instance per process: loaded and checked once
    uncached = TokenDataset(store, ds.id, ds.meta)
    uncached.MAX_CACHE_BYTES = 0
    assert np.array_equal(uncached.train_rows(idx), train[idx]) and uncached._cache.get("train") is None

    z = zarr.open_array(store=store.zarr_store("datasets", ds.id, "train.zarr", read_only=True), mode="r")
    assert z.compressors == () and z.dtype == np.int32
    if url != "local":
        store.rm()


def test_val_split_is_nonempty_tail_and_disjoint(tmp_path, hf, stdlib_files):
    store = Store(str(tmp_path / "root"))
    ds = TokenDataset.open(store, prepare_token_dataset(store, files=stdlib_files, cache_dir=hf,
                                                        val_fraction=1e-6, **SMALL))
    assert ds.n_val == 1 and ds.n_train >= 1
    train = ds.train_rows(np.arange(ds.n_train))
    assert not any(np.array_equal(v, t) for v in ds.val_rows() for t in train)


def test_text_json_parquet_files(tmp_path, hf):
    (tmp_path / "a.txt").write_text("first document\nspans two lines\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "json one"}) + "\n" + json.dumps({"body": "json two"}) + "\n")
    pd.DataFrame({"body": ["parquet one", None, "parquet two"]}).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "d.md").write_text("# last\n")
    files = corpus.resolve_files(str(tmp_path / "*"))
    texts = corpus.load_texts(files, text_field="body", cache_dir=hf)
    # one text file = one document; json/parquet rows are documents; empty rows dropped; file order kept
    assert texts == ["first document\nspans two lines\n", "json one", "json two", "parquet one", "parquet two", "# last\n"]
    assert corpus.load_texts(files, text_field="body", max_chars=20, cache_dir=hf) == ["first document\nspans"]
    with pytest.raises(DataError, match=r"^data.text_field: no column 'text'"):
        corpus.load_texts(files, cache_dir=hf)


def test_resolve_files_globs_dirs_and_errors(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for p in ["d/b.txt", "d/sub/a.txt", "d/.hidden"]:
        (tmp_path / p).write_text("x")
    d = str(tmp_path / "d")
    assert corpus.resolve_files([d, f"{d}/*.txt"]) == [f"{d}/b.txt", f"{d}/sub/a.txt"]
    assert corpus.resolve_files(f"{d}/**/*.txt") == [f"{d}/b.txt", f"{d}/sub/a.txt"]
    with pytest.raises(DataError, match=r"^data.files: no file matches '.*\*\.md'"):
        corpus.resolve_files(f"{d}/*.md")
    with pytest.raises(DataError, match=r"^data.files: no such file '.*missing.txt'"):
        corpus.resolve_files([f"{d}/b.txt", f"{d}/missing.txt"])


def test_bad_input_names_the_key_and_writes_nothing(tmp_path, hf):
    store = Store(str(tmp_path / "root"))
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("just a few words")
    (tmp_path / "bad.json").write_text("{not json")
    cases = [
        (dict(files=str(tmp_path / "nope" / "*.txt")), r"^data.files: no file matches"),
        (dict(files=[str(tmp_path / "missing.txt")]), r"^data.files: no such file"),
        (dict(files=str(tmp_path / "e*.txt")), r"^data.files: corpus is empty \(0 characters in 2 files\)"),
        (dict(files=str(tmp_path / "tiny.txt")), r"^data.seq_len: corpus too small for seq_len=32"),
        (dict(files=str(tmp_path / "bad.json")), r"^data.files: cannot read json file\(s\) bad.json"),
        (dict(files=str(tmp_path / "tiny.txt"), tokenizer_file=str(tmp_path / "t.json")), r"^data.tokenizer: cannot read"),
        (dict(files=str(tmp_path / "tiny.txt"), val_fraction=1.0), r"^data.val_fraction"),
        (dict(path="no-such-user/no-such-dataset"), r"^data.path: cannot load dataset 'no-such-user/no-such-dataset'"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(DataError, match=pattern):
            prepare_token_dataset(store, cache_dir=hf, **{**SMALL, **kwargs})
    with pytest.raises(DataError, match=r"^data.vocab_size"):
        prepare_token_dataset(store, files=str(tmp_path / "tiny.txt"), cache_dir=hf, seq_len=2, vocab_size=100)
    assert not store.exists()  # nothing written for any of them
    with pytest.raises(DataError, match="'0123456789abcdef'"):
        TokenDataset.open(store, "0123456789abcdef")


def test_user_tokenizer_json_is_used(tmp_path, hf, stdlib_files):
    user_tok = corpus.train_tokenizer(corpus.load_texts(stdlib_files[:2], cache_dir=hf), vocab_size=300)
    user_tok.save(str(tmp_path / "tokenizer.json"))
    store = Store(str(tmp_path / "root"))
    ds_id = prepare_token_dataset(store, files=stdlib_files, tokenizer_file=str(tmp_path / "tokenizer.json"),
                                  cache_dir=hf, seq_len=32, vocab_size=9999)
    ds = TokenDataset.open(store, ds_id)
    assert ds.vocab_size == 300 and ds.meta["tokenizer"] == "file"
    assert ds.tokenizer().to_str() == user_tok.to_str()
    assert ds.train_rows(np.arange(ds.n_train)).max() < 300
    assert ds_id != dataset_id(files=stdlib_files, seq_len=32, vocab_size=9999)

    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(DataError, match=r"^data.tokenizer: '.*broken.json' is not a valid tokenizer.json"):
        corpus.load_tokenizer(str(tmp_path / "broken.json"))


def test_tokenizer_is_byte_level_and_deterministic(stdlib_files, hf):
    texts = corpus.load_texts(stdlib_files, cache_dir=hf)
    a, b = corpus.train_tokenizer(texts, 500), corpus.train_tokenizer(texts, 500)
    assert a.to_str() == b.to_str() and a.token_to_id(corpus.EOS) == 0
    odd = "naïve → 数据 \x00\t  def f():\n"
    assert a.decode(a.encode(odd).ids) == odd  # any unicode round-trips through bytes


def test_altered_dataset_is_detected(tmp_path, hf, stdlib_files):
    store = Store(str(tmp_path / "root"))
    ds_id = prepare_token_dataset(store, files=stdlib_files, cache_dir=hf, **SMALL)
    z = zarr.open_array(store=store.zarr_store("datasets", ds_id, "train.zarr"), mode="r+")
    z[0, 0] = z[0, 0] + 1
    with pytest.raises(DamagedDataset, match="train.zarr checksum mismatch"):
        TokenDataset.open(store, ds_id).train_rows(np.array([0]))
