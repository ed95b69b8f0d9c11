"""One storage root (any fsspec URL: a local path, ``memory://``, ``s3://bucket/prefix``).

Every artifact goes through :class:`Store`, so the rest of the code never builds URLs by hand.
Object stores have no rename: atomicity comes from writing immutable, content-addressed objects
first and a small pointer object (manifest, state) last (DESIGN §5).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import fsspec
from fsspec.core import url_to_fs


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """A root URL plus the fsspec filesystem that serves it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if "://" not in url:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        if url.startswith(("s3://", "s3a://")):
            # other processes write shards and markers concurrently: never trust a cached listing
            self.storage_options.setdefault("use_listings_cache", False)
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.is_local = "file" in _protocols(self.fs)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) of a key below the root."""
        key = "/".join(p.strip("/") for p in parts if p)
        return f"{self.root}/{key}" if key else self.root

    def url_of(self, *parts: str) -> str:
        key = "/".join(p.strip("/") for p in parts if p)
        return f"{self.url}/{key}" if key else self.url

    # -- bytes and json ------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole object. Local files are written to a temporary name and renamed,
        so a reader never sees half an object; object stores publish a PUT atomically."""
        p = self.path(*parts)
        if self.is_local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            tmp = f"{p}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        else:
            self.fs.pipe_file(p, data)

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_json(self, obj: Any, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=True).encode(), *parts)

    def listdir(self, *parts: str) -> list[str]:
        p = self.path(*parts)
        if not self.fs.exists(p):
            return []
        return sorted(os.path.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))

    def rm(self, *parts: str) -> None:
        p = self.path(*parts)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=True)

    # -- zarr ----------------------------------------------------------------------------
    def zarr_store(self, *parts: str, read_only: bool = False):
        """A zarr v3 store rooted at a key below this root."""
        from zarr.storage import FsspecStore, LocalStore

        p = self.path(*parts)
        if self.is_local:
            return LocalStore(p, read_only=read_only)
        return FsspecStore.from_url(self.url_of(*parts), storage_options=self.storage_options or None,
                                    read_only=read_only)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
