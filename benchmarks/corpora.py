"""Local text corpora for the validity suite, built from what is installed here (never the network) and
never the built-in corpus (the standard library, ``storage.corpus.builtin_corpus_files``).

``pysrc``: Python source of installed packages; ``docs``: their docstrings (module, class and function,
read with ``ast``, dedented by ``inspect.cleandoc``), from other packages than ``pysrc``'s; ``docsrc``: the
source of ``docs``' packages (Python that shares no file with ``pysrc``: a base for fine-tuning on ``pysrc``'s
functions that knows the language but not those packages). Missing packages are skipped. A corpus is a few
UTF-8 text files (``data.files``; each file is one document):

    files = build("docs", Path("benchmarks/out/corpora/docs-10000000"), 10_000_000)

Deterministic: the same bytes every time on the same machine (same package versions). Each package's
files are taken in sorted order, then shuffled with a fixed seed (named by corpus and package), and the
packages are interleaved by bytes (the next text comes from the package with the fewest bytes so far).
Why not plain sorted order: the token dataset holds out its *tail* as validation
(``storage.tokens.prepare_token_dataset``), so a sorted corpus would validate on the last package's last
subpackage alone; interleaved, the tail is a sample of the same mix the run trains on. Exact duplicate
texts (empty ``__init__.py``, copied docstrings) are kept once, so no validation text is a training text
verbatim. The corpus is cut at ``max_bytes`` (the last text cut on a character boundary).

Errors are ``bcdflow.errors.BadInput`` (a ValueError) naming the corpus. ``build`` caches: a destination holding a finished build (``corpus.json``, written last) of the same
corpus, size and recipe is reused as it is.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

from bcdflow.errors import BadInput

# pysrc: source; docs: docstrings (numpydoc-style reference prose), other packages than pysrc's; docsrc: their source
_DOC_PACKAGES = ("scipy", "sympy", "sklearn", "networkx", "matplotlib")
PACKAGES: dict[str, tuple[str, ...]] = {
    "pysrc": ("numpy", "pandas", "sqlalchemy", "torch"),
    "docs": _DOC_PACKAGES,
    "docsrc": _DOC_PACKAGES,
}
SOURCE_CORPORA = {"pysrc", "docsrc"}  # whole source files; the others: docstrings
SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "_vendor", "vendored"}
MAX_FILE_BYTES = 200_000  # larger sources are generated tables, not text a person wrote
MIN_DOC_CHARS = 40  # "Return self." and its kind say nothing
PART_BYTES = 2_000_000  # one text file (one document) of the corpus
MARKER = "corpus.json"
RECIPE = 1  # bump when what a build produces changes: older caches are rebuilt


def build(name: str, dest: Path, max_bytes: int) -> list[str]:
    """The corpus ``name`` (``pysrc``, ``docs`` or ``docsrc``) as text files under ``dest`` (at most ``max_bytes`` in
    all), reusing a finished build there; returns their absolute paths, for ``data.files``."""
    if name not in PACKAGES:
        raise BadInput(f"corpus {name!r}: unknown (choose from {', '.join(PACKAGES)})")
    if max_bytes < 1:
        raise BadInput(f"corpus {name!r}: max_bytes must be positive, got {max_bytes}")
    dest = Path(dest).resolve()
    want = {"corpus": name, "max_bytes": max_bytes, "recipe": RECIPE}
    marker = dest / MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        files = [str(dest / f) for f in done.get("files", [])]
        if {k: done.get(k) for k in want} == want and files and all(os.path.isfile(f) for f in files):
            return files
    roots = {p: r for p in PACKAGES[name] if (r := package_root(p))}
    seen: set[bytes] = set()  # digests of the texts taken, shared by the packages' streams
    texts = _interleave({p: (_sources if name in SOURCE_CORPORA else _docstrings)(r, f"{name}:{p}", seen)
                         for p, r in roots.items()})
    parts, taken, total = [], {p: 0 for p in roots}, 0
    buf: list[str] = []
    size = 0
    for pkg, text in texts:
        b = text.encode()
        full = total + len(b) >= max_bytes
        if full:
            b = b[:max_bytes - total].decode("utf-8", "ignore").encode()  # cut on a character boundary
        buf.append(b.decode())
        size, total, taken[pkg] = size + len(b), total + len(b), taken[pkg] + len(b)
        if size >= PART_BYTES or full:
            parts.append("".join(buf))
            buf, size = [], 0
        if full:
            break
    if buf:
        parts.append("".join(buf))
    if not total:
        raise BadInput(f"corpus {name!r}: no text found in the installed packages "
                         f"({', '.join(PACKAGES[name])}; found {', '.join(roots) or 'none of them'})")
    dest.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a half-rewritten build must not look finished
    for old in dest.glob("part-*.txt"):
        old.unlink()
    names = [f"part-{i:03d}.txt" for i in range(len(parts))]
    for n, text in zip(names, parts):
        (dest / n).write_text(text, encoding="utf-8")
    meta = {**want, "files": names, "bytes": total, "packages": {p: {"root": roots[p], "bytes": taken[p]}
                                                                 for p in roots},
            "missing": [p for p in PACKAGES[name] if p not in roots],
            "sha256": hashlib.sha256("".join(parts).encode()).hexdigest()}
    marker.write_text(json.dumps(meta, indent=2))  # last: the completion marker (docs/CONVENTIONS.md 15)
    return [str(dest / n) for n in names]


def info(dest: Path) -> dict:
    """What a finished build under ``dest`` holds (its ``corpus.json``)."""
    return json.loads((Path(dest) / MARKER).read_text())


def package_root(pkg: str) -> str | None:
    """Where an installed package's sources are, or None. Found by import machinery rather than under
    ``sysconfig.get_paths()["purelib"]``: a venv may see its packages through a ``.pth`` file."""
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or []) if spec else []
    return os.path.realpath(locs[0]) if locs else None


def package_files(root: str, seed: str) -> list[str]:
    """The package's ``.py`` files (tests and oversized generated files left out), sorted, then shuffled
    by ``seed``."""
    rel = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            path = os.path.join(dirpath, f)
            if f.endswith(".py") and not f.startswith("test_") and 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
                rel.append(os.path.relpath(path, root).replace(os.sep, "/"))
    rel.sort()
    random.Random(seed).shuffle(rel)  # str seeds hash with sha512: the same order in every process
    return [os.path.join(root, r) for r in rel]


def read_source(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _new(text: str, seen: set[bytes]) -> bool:
    """Whether ``text`` was not taken yet (and it is now)."""
    digest = hashlib.sha1(text.encode()).digest()
    if digest in seen:
        return False
    seen.add(digest)
    return True


def _sources(root: str, seed: str, seen: set[bytes]) -> Iterator[str]:
    for path in package_files(root, seed):
        text = read_source(path)
        if text and text.strip() and _new(text, seen):
            yield text.strip("\n") + "\n\n"


def _docstrings(root: str, seed: str, seen: set[bytes]) -> Iterator[str]:
    """Per source file, its docstrings not taken yet (module first, then classes and functions in source
    order)."""
    for path in package_files(root, seed):
        text = read_source(path)
        try:
            tree = ast.parse(text or "")
        except (SyntaxError, ValueError):
            continue
        nodes = [tree] + sorted((n for n in ast.walk(tree) if isinstance(
            n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda n: (n.lineno, n.col_offset))
        docs = []
        for node in nodes:
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc := inspect.cleandoc(doc)) >= MIN_DOC_CHARS and _new(doc, seen):
                docs.append(doc)
        if docs:
            yield "\n\n".join(docs) + "\n\n"


def _interleave(streams: dict[str, Iterator[str]]) -> Iterator[tuple[str, str]]:
    """(package, text) pairs: always from the package with the fewest bytes so far (ties: the name)."""
    taken = {p: 0 for p in streams}
    live = dict(sorted(streams.items()))
    while live:
        pkg = min(live, key=lambda p: (taken[p], p))
        text = next(live[pkg], None)
        if text is None:
            del live[pkg]
            continue
        taken[pkg] += len(text.encode())
        yield pkg, text
