"""Text in, tokenizer out: the corpus half of the data layer.

Texts come through Hugging Face ``datasets``: local files with the ``text`` / ``json`` /
``parquet`` builders, or a dataset name (hub or local script directory) when the user has
network. The tokenizer is a byte-level BPE that Hugging Face ``tokenizers`` trains on the
corpus, or a ``tokenizer.json`` the user gives. The built-in demo corpus is the running
Python's standard library: real text on every machine, no download.

    files = builtin_corpus_files(2_000_000)
    texts = load_texts(files, cache_dir="/tmp/hf")
    tok = train_tokenizer(texts, vocab_size=4096)

:mod:`storage.tokens` packs the encoded texts into a Zarr token dataset.
"""
from __future__ import annotations

import codecs
import glob
import itertools
import logging
import os
from collections.abc import Sequence
from contextlib import contextmanager

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .errors import DataError

EOS = "<|endoftext|>"
# A user's tokenizer.json may come from another family: GPT-2 uses <|endoftext|>, LLaMA </s>,
# LLaMA 3 <|end_of_text|>. The first one present separates documents.
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>")

# Stdlib directories that are not representative text (tests, GUIs, third-party packages).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
              "__pycache__", "ensurepip", "lib2to3", "pydoc_data"}
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # anything else: "text"


def builtin_corpus_files(max_bytes: int = 2_000_000) -> list[str]:
    """``.py`` files of the running Python's standard library, in sorted relative-path order,
    taken until adding the next file would pass ``max_bytes`` (at least one file)."""
    root = os.path.dirname(os.path.abspath(os.__file__))
    rel: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        rel += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    out, total = [], 0
    for r in sorted(rel, key=lambda p: p.replace(os.sep, "/")):  # same order on every OS
        path = os.path.join(root, r)
        size = os.path.getsize(path)
        if out and total + size > max_bytes:
            break
        try:  # the text builder reads UTF-8; a stray legacy encoding would fail the whole load
            with open(path, "rb") as f:
                f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(path)
        total += size
    return out


def resolve_files(spec: str | Sequence[str]) -> list[str]:
    """Expand ``~``, globs (``**`` recursive) and directories (every non-hidden file below)
    into a sorted, de-duplicated list of absolute file paths."""
    patterns = [spec] if isinstance(spec, str) else list(spec)
    if not patterns:
        raise DataError("data.files: empty list of files")
    found: set[str] = set()
    for pattern in patterns:
        p = os.path.expanduser(str(pattern))
        if glob.has_magic(p):
            matches = glob.glob(p, recursive=True)
            if not matches:
                raise DataError(f"data.files: no file matches {pattern!r}")
        elif os.path.exists(p):
            matches = [p]
        else:
            raise DataError(f"data.files: no such file {pattern!r}")
        files = [f for m in matches for f in _files_below(m)]
        if not files:
            raise DataError(f"data.files: {pattern!r} contains no files")
        for f in files:  # a FIFO would block the read for ever, /dev/zero never ends: regular files only
            if not os.path.isfile(f):
                what = ("a broken or looping symbolic link" if os.path.islink(f) and not os.path.exists(f)
                        else "not a regular file (a FIFO, device or socket, or a link to one)")
                raise DataError(f"data.files: {f} is {what}; give regular text, .json/.jsonl or .parquet files")
        found.update(os.path.abspath(f) for f in files)
    return sorted(found)


def check_text_files(files: list[str]) -> None:
    """Raise DataError (one line, naming the file) unless every text or json file is UTF-8: a binary file given as
    corpus is refused here, before ``datasets`` reads it. Parquet files are binary by design and skipped."""
    for path in files:
        if _BUILDERS.get(os.path.splitext(path)[1].lower()) == "parquet":
            continue
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    decoder.decode(block)
                    offset += len(block)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise DataError(f"data.files: {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                            f"{offset + e.start}); give text, .json/.jsonl or .parquet files") from None
        except OSError as e:
            raise DataError(f"data.files: cannot read {path} ({e.strerror or e})") from None


def _files_below(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
    return out


def load_texts(files: list[str] | None = None, path: str | None = None, name: str | None = None,
               split: str = "train", text_field: str = "text", max_chars: int | None = None,
               cache_dir: str | None = None) -> list[str]:
    """Documents as strings, in file order, empty ones dropped, cut to ``max_chars`` in total.

    ``files``: local files; the builder follows the extension (``.json``/``.jsonl`` → json,
    ``.parquet`` → parquet, else text with one file = one document). ``path``/``name``/``split``:
    ``datasets.load_dataset(path, name, split=split)``. ``cache_dir`` is the datasets cache
    (default: the user's ``~/.cache/huggingface``).
    """
    texts: list[str] = []
    for builder, ds, what in _datasets(files, path, name, split, cache_dir):
        # the text builder always names its column "text"; text_field is for json/parquet
        texts += _column(ds, "text" if builder == "text" else text_field, what)
    key, where = _where(files, path, split)
    texts = [t for t in texts if t and t.strip()]  # whitespace-only documents are empty too
    if max_chars is not None:
        texts = _truncate(texts, max_chars)
    if not texts:
        raise DataError(f"{key}: corpus is empty (0 characters in {where})")
    return texts


def load_records(fields: Sequence[str], files: list[str] | None = None, path: str | None = None,
                 name: str | None = None, split: str = "train", cache_dir: str | None = None) -> dict[str, list]:
    """Columns ``fields`` of json/jsonl/parquet records (or a ``datasets`` dataset), in file order: the
    supervised fine-tuning formats (``data.format``), one example per record."""
    out: dict[str, list] = {f: [] for f in fields}
    for builder, ds, what in _datasets(files, path, name, split, cache_dir):
        if builder == "text":
            raise DataError(f"data.format: {what} are plain text; supervised fine-tuning records come from json, "
                            "jsonl or parquet files")
        for f in fields:
            if f not in ds.column_names:
                raise DataError(f"data.files: no field {f!r} in {what} (fields: {', '.join(ds.column_names)})")
            col = list(ds[f])
            if f != "messages" and not all(isinstance(v, str) for v in col):
                raise DataError(f"data.files: field {f!r} in {what} must hold strings")
            out[f] += col
    if not out[fields[0]]:
        key, where = _where(files, path, split)
        raise DataError(f"{key}: no records in {where}")
    return out


def _where(files, path, split) -> tuple[str, str]:
    if files:
        return "data.files", f"{len(files)} file{'s' if len(files) != 1 else ''}"
    return "data.path", f"dataset {path!r} split {split!r}"


def _datasets(files, path, name, split, cache_dir):
    """(builder, datasets.Dataset, description) per run of consecutive files with the same builder, or for
    the one dataset ``path`` names."""
    import datasets  # heavy import, only when texts are really loaded (not on dataset reuse)

    if files:
        # one load per run of consecutive files with the same builder, so documents keep file order
        for builder, run in itertools.groupby(files, key=lambda f: _BUILDERS.get(os.path.splitext(f)[1].lower(), "text")):
            group = list(run)
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            try:
                with _quiet_datasets():
                    ds = datasets.load_dataset(builder, data_files=group, split="train",
                                               cache_dir=cache_dir, **kwargs)
            except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "unreadable"
                names = ", ".join(os.path.basename(f) for f in group[:3]) + (", ..." if len(group) > 3 else "")
                raise DataError(f"data.files: cannot read {builder} file(s) {names}: {_reason(e)}") from e
            yield builder, ds, f"{builder} files"
    elif path:
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(path, name, split=split, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"data.path: cannot load dataset {path!r} (name={name!r}, split={split!r}): "
                            f"{_reason(e)}") from e
        yield "dataset", ds, f"dataset {path!r}"
    else:
        raise DataError("data.files: give data.files or data.path")


@contextmanager
def _quiet_datasets():
    """``datasets`` logs a file it cannot parse (a ``.jsonl`` cut mid-line) before it raises, on its own handler and
    the root logger's: the one line bcdflow says (``DataError``) is the message, so its loggers are silent here."""
    lib = logging.getLogger("datasets")
    level = lib.level
    lib.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        lib.setLevel(level)


def _column(ds, field: str, what: str) -> list[str]:
    if field not in ds.column_names:
        raise DataError(f"data.text_field: no column {field!r} in {what} (columns: {', '.join(ds.column_names)})")
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"data.text_field: column {field!r} in {what} holds {dtype or ds.features[field]}, not text")
    return list(ds[field])  # datasets 5 returns a lazy Column; materialize


def _truncate(texts: list[str], max_chars: int) -> list[str]:
    out, left = [], max_chars
    for t in texts:
        if left <= 0:
            break
        out.append(t[:left])
        left -= len(out[-1])
    return out


def _reason(e: BaseException) -> str:
    """One line from an exception and its cause (datasets wraps the real error, e.g. a
    UnicodeDecodeError, in a DatasetGenerationError with a generic message)."""
    parts = []
    while e is not None and len(parts) < 3:
        msg = str(e).strip().splitlines()
        parts.append(f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: any byte string encodes, decode(encode(x)) == x) with
    ``<|endoftext|>`` as id 0. Deterministic for the same texts and vocab_size. The vocabulary
    can come out smaller than ``vocab_size`` on a tiny corpus (no more pairs to merge)."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < 257:
        raise DataError(f"data.vocab_size: must be at least 257 (256 bytes + {EOS}), got {vocab_size}")


def load_tokenizer(path: str) -> Tokenizer:
    """A user's ``tokenizer.json``; it must contain one of :data:`EOS_CANDIDATES`."""
    tok = read_tokenizer(path)
    eos_id(tok, key=f"data.tokenizer: {str(path)!r}")
    return tok


def read_tokenizer(path: str) -> Tokenizer:
    """A ``tokenizer.json`` (a checkpoint's names its own end-of-text token, so no candidate is required)."""
    p = os.path.expanduser(str(path))
    if not os.path.isfile(p):
        raise DataError(f"data.tokenizer: no such file {str(path)!r}")
    try:
        return Tokenizer.from_file(p)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise DataError(f"data.tokenizer: {str(path)!r} is not a valid tokenizer.json ({_reason(e)})") from e


def eos_id(tok: Tokenizer, key: str = "data.tokenizer") -> int:
    """Id of the document separator: the first of :data:`EOS_CANDIDATES` in the vocabulary."""
    for t in EOS_CANDIDATES:
        i = tok.token_to_id(t)
        if i is not None:
            return i
    raise DataError(f"{key} has no end-of-text token (one of {', '.join(EOS_CANDIDATES)})")
