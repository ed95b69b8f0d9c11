"""One storage root (any fsspec URL: a local path, ``memory://``, or a backend's: ``s3://bucket/prefix``).

Every artifact goes through :class:`Store`, so the rest of the code never builds URLs by hand.
Object stores have no rename: atomicity comes from writing immutable, content-addressed objects
first and a small pointer object (manifest, state) last (docs/DESIGN.md §5). Leases and commits rest on
:meth:`Store.create` being exclusive; an object store is checked once per process that it is (two creates of one
probe key, the second must find it there), and refused with one line when it is not (docs/DESIGN.md §9).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import uuid
from typing import Any, NoReturn

import fsspec
from fsspec.core import url_to_fs
from fsspec.utils import get_protocol

from bcdflow.errors import BadInput

from .backends import BACKENDS, backend_of
from .layout import UnsafeName, probe_key


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def check_url(url: str) -> str:
    """Raise BadInput (naming ``store``) unless fsspec can serve the URL's protocol here."""
    protocol = get_protocol(url)
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise BadInput(f"store: {url!r} has an unknown protocol {protocol!r} (use a local path, memory:// or "
                       f"{' or '.join(b.example for b in BACKENDS.values())})") from None
    except ImportError as e:
        raise BadInput(f"store: protocol {protocol!r} of {url!r} needs a package that is not installed ({e})") from None
    return url


# an object store's verdict on exclusive creates, per store (URL and options) and process: None when the probe found
# them exclusive, else what the store lacks. One probe per store and process; a fault during it is not a verdict.
_exclusive: dict[str, str | None] = {}
_exclusive_lock = threading.Lock()


def means_exists(e: BaseException, backend=None) -> bool:
    """Whether an exclusive create that raised ``e`` found an object at its key: FileExistsError anywhere in its
    chain of causes, or what the store's backend says its own errors mean (``Backend.found``: S3's 409/412 that s3fs
    passes on as another OSError). Such a create fails closed: the caller sees "exists" (a lease in use, a state made
    by another writer) and no two callers both win."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, FileExistsError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return backend is not None and backend.found(e)


_umask_lock = threading.Lock()


def file_mode() -> int:
    """The mode this process's umask gives a new file (0o644 under the usual 022). For files a library creates 0600
    (safetensors writes a temporary file and renames it): a block file of a shared store, or an exported model, is
    then as readable to the user's group as every other file they write."""
    try:
        with open("/proc/self/status") as f:  # Linux: read without changing it
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, ValueError, StopIteration, IndexError):
        with _umask_lock:  # elsewhere: set and restore; a file another thread makes meanwhile is only more private
            mask = os.umask(0o077)
            os.umask(mask)
    return 0o666 & ~mask


def _complete_tmp(path: str, data: bytes) -> str:
    """``data`` written and synced to a temporary file beside ``path`` (unique per process and thread), ready to
    be renamed or linked into place so that no reader sees half an object. A write that fails (a full disk) removes
    its temporary file before the error goes on, naming ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        _discard(tmp)
        raise_naming(e, path)
    return tmp


def _discard(tmp: str) -> None:
    """Remove a temporary file whose write or rename failed (it may never have been created)."""
    try:
        os.remove(tmp)
    except FileNotFoundError:
        pass


def raise_naming(e: BaseException, path: str) -> NoReturn:
    """Raise ``e``, an error while writing ``path`` (a file, or the directory a writer fills); an I/O error that
    does not name ``path`` as an OSError of its kind that does, so the CLI's one line says what could not be written
    (docs/DESIGN.md §8): ``write()`` and ``fsync()`` on a full disk name no file, ``open()`` names a temporary one, and
    safetensors' writer raises its own error type holding the OS error ("... (os error 28)")."""
    if isinstance(e, OSError):
        errno = e.errno if e.filename != path else None
    else:
        errno = int(m[1]) if (m := re.search(r"\(os error (\d+)\)", str(e))) else None
    if errno is not None:
        raise OSError(errno, os.strerror(errno), path) from e  # OSError(errno, ...) is ENOSPC's, EACCES's class
    raise e


class Store:
    """A root URL plus the fsspec filesystem that serves it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if "://" not in url:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = check_url(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.backend = backend_of(url)
        if self.backend is not None:
            self.storage_options = {**self.backend.defaults, **self.storage_options}
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.is_local = "file" in _protocols(self.fs)
        self._probed: bool | None = None  # None: not yet; else whether for writing (probe: once per store object)
        self.block_cache = None  # storage/block_cache.BlockCache: this box's copies of block files (bcd.block_cache)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) of a key below the root."""
        key = _key(parts)
        return f"{self.root}/{key}" if key else self.root

    def url_of(self, *parts: str) -> str:
        key = _key(parts)
        return f"{self.url}/{key}" if key else self.url

    # -- bytes and json ------------------------------------------------------------------
    def size(self, *parts: str) -> int:
        """Bytes of every object below a key (0: none there)."""
        path = self.path(*parts)
        return int(self.fs.du(path, total=True)) if self.fs.exists(path) else 0

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole object. Local files are written to a temporary name and renamed,
        so a reader never sees half an object; object stores publish a PUT atomically."""
        p = self.path(*parts)
        if self.is_local:
            tmp = _complete_tmp(p, data)
            try:
                os.replace(tmp, p)
            except BaseException as e:
                _discard(tmp)
                raise_naming(e, p)
        else:
            self.fs.pipe_file(p, data)

    def create(self, data: bytes, *parts: str) -> bool:
        """Write a whole object only if none exists at that key; False when one does. Atomic on a local disk
        (a hard link of a complete temporary file) and on an object store (S3: a conditional PUT, ``If-None-Match:
        *``), so of two processes creating the same key exactly one wins: the basis of leases and of manifests that
        are never overwritten (docs/DESIGN.md I7)."""
        p = self.path(*parts)
        if not self.is_local:
            self.check_exclusive()
            return self._put_new(p, data)
        tmp = _complete_tmp(p, data)
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)
        return True

    def _put_new(self, path: str, data: bytes) -> bool:
        """An object store's create-if-absent (S3: a PUT with ``If-None-Match: *``); False when the store says an
        object is there (FileExistsError, or what its backend says an error means: ``means_exists``)."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except Exception as e:
            if means_exists(e, self.backend):
                return False
            raise
        return True

    def check_exclusive(self) -> None:
        """Raise BadInput, naming the store and what it lacks, unless an exclusive create here is exclusive: of two
        creates of one new probe key the first must succeed and the second must find the object there (a store
        that ignores ``If-None-Match`` lets both "win": two holders of one lease epoch, an overwritten manifest).
        Probed once per store and process (two conditional PUTs and a DELETE); a local store (hard links) is
        exclusive by construction. Called by ``probe()`` before a run writes anything and by the first ``create``."""
        if self.is_local:
            return
        ident = json.dumps([self.url, self.storage_options], sort_keys=True, default=str)
        with _exclusive_lock:  # one probe even when threads create at once
            if ident not in _exclusive:
                _exclusive[ident] = self._probe_exclusive()
            lacks = _exclusive[ident]
        if lacks:
            at = self.storage_options.get("endpoint_url")
            raise BadInput(f"store: {self.url}{f' at {at}' if at else ''} does not honour an exclusive create "
                           f"({lacks}); leases and commits need one: use a store with conditional writes")

    def _probe_exclusive(self) -> str | None:
        if getattr(self.fs.pipe_file, "__func__", None) is fsspec.AbstractFileSystem.pipe_file:
            return f"fsspec's {_protocols(self.fs)[0]!r} filesystem checks for the object, then writes it"
        p = self.path(probe_key(f"{uuid.uuid4().hex}.json"))
        try:
            try:
                first = self._put_new(p, b'{"probe": 1}')
            except (TypeError, NotImplementedError, ValueError) as e:  # no mode="create" in this filesystem
                return f"its filesystem has no create-if-absent ({type(e).__name__}: {e})"
            if not first:
                return "a create of a new key said it exists"
            if self._put_new(p, b'{"probe": 2}'):
                return "a second PUT of an existing key with If-None-Match: * overwrote it"
            return None
        finally:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_json(self, obj: Any, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=True).encode(), *parts)

    def listdir(self, *parts: str) -> list[str]:
        p = self.path(*parts)
        try:  # a prefix another process removes meanwhile (a visit's directory after its commit) lists empty
            names = self.fs.ls(p, detail=False) if self.fs.exists(p) else []
        except FileNotFoundError:
            names = []
        return sorted(os.path.basename(x.rstrip("/")) for x in names)

    def modified(self, *parts: str) -> float | None:
        """When the object was last written (seconds since the epoch), or None when it does not exist."""
        try:
            info = self.fs.info(self.path(*parts))
        except FileNotFoundError:
            return None
        when = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
        return when.timestamp() if hasattr(when, "timestamp") else None if when is None else float(when)

    def check_confined(self, *parts: str, act: str = "deletes nothing through a link; nothing was removed") -> None:
        """UnsafeName unless the object at this key is reached from the store's root without a symbolic link (a local
        store; an object store has none): what bcdflow deletes, it deletes inside the store as it resolves the key,
        never through a link that leads elsewhere (docs/DESIGN.md §5). Nothing is removed when this raises. ``act``:
        what the line says bcdflow does not do (a lease's writes say so: ``Lease.acquire``)."""
        if not self.is_local:
            return
        key = _key(parts)
        at = self.root
        for i, seg in enumerate(key.split("/") if key else []):
            at = os.path.join(at, seg)
            if os.path.islink(at):
                rel = "/".join(key.split("/")[:i + 1])
                raise UnsafeName(f"{self.url_of(rel)} is a symbolic link (to {os.readlink(at)}): bcdflow {act}")
            if not os.path.lexists(at):
                return

    def rm(self, *parts: str) -> None:
        """Remove an object or a whole prefix. What is gone already, or goes meanwhile (another process removing the
        same prefix: a visit's own cleanup after its commit and a resume's, docs/DESIGN.md §2.6), is no error. A key
        that leads through a symbolic link is refused (``check_confined``); links inside a removed prefix are
        removed, never followed."""
        self.check_confined(*parts)
        p = self.path(*parts)
        for _ in range(3):
            if not self.fs.exists(p):
                return
            try:
                self.fs.rm(p, recursive=True)
                return
            except FileNotFoundError:  # part of it went while we removed it: remove what is left
                continue

    def probe(self, write: bool = True) -> None:
        """Fail fast, with one line that says which, when the store cannot be used: a local root that is not a
        writable directory (``write=False``, for commands that only read: ``status``, ``export``, ``compare``: a
        read-only one is fine); a store its backend cannot reach (``storage/backends.py``: an S3 bucket without
        credentials, unreachable, missing or denied). ``write``: also that an exclusive create is exclusive
        (``check_exclusive``, once per store and process). Once per store object: a command probes the store it
        opened, and what it hands it to does not probe it again."""
        if self._probed or (self._probed is False and not write):
            return
        self._check(write)
        self._probed = write

    def _check(self, write: bool) -> None:
        if self.is_local:
            path = self.root
            if os.path.exists(path) and not os.path.isdir(path):
                raise BadInput(f"store: {self.url} exists and is not a directory")
            while not os.path.exists(path):
                if os.path.islink(path):  # exists() is False for a link to nothing or a link loop
                    where = "is" if path == self.root else f"leads through {path},"
                    raise BadInput(f"store: {self.url} {where} a broken or looping symbolic link")
                path = os.path.dirname(path)
            if not os.path.isdir(path):  # the store would be created below a file: it can never be a directory
                raise BadInput(f"store: {self.url} cannot be created: {path} is a file, not a directory")
            if write and not os.access(path, os.W_OK):
                raise BadInput(f"store: cannot create or write {self.url} (no write permission in {path})")
            return
        if self.backend is not None and self.backend.reachable is not None:
            self.backend.reachable(self.storage_options, self.url, self.root)
        if write:
            self.check_exclusive()

    # -- zarr ----------------------------------------------------------------------------
    def zarr_store(self, *parts: str, read_only: bool = False):
        """A zarr v3 store rooted at a key below this root."""
        from zarr.storage import FsspecStore, LocalStore

        p = self.path(*parts)
        if self.is_local:
            return LocalStore(p, read_only=read_only)
        return FsspecStore.from_url(self.url_of(*parts), storage_options=self.storage_options or None,
                                    read_only=read_only)


def _key(parts: tuple[str, ...]) -> str:
    """The ``/``-joined key of ``parts``, never one that climbs out of the root: keys come from storage/layout.py,
    whose names read from store content are plain names already (layout.is_plain_name); this is the last guard."""
    key = "/".join(p.strip("/") for p in parts if p)
    if any(seg in (".", "..") for seg in key.split("/")):
        raise UnsafeName(f"store key {key!r} has a '.' or '..' part: a name read from the store is damaged")
    return key


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
