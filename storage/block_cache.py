"""A box's own copies of the block files it reads from or writes to the run's store (``bcd.block_cache``).

Block files are content-addressed and immutable (storage/checkpoints.py), so a copy named by its sha256 can stand for
the object on the store: a visit that loads the model's other blocks reads them from the box's disk, not through the
bucket's paid, slow link. The copy is checked against the manifest's sha256 on every read, as the store's object is:
a torn or damaged copy is dropped and the store read again, never used. A copy is written whole to a temporary name
and renamed, so a box killed mid-write leaves no half copy under a sha's name.

The cache is best-effort: a full disk or an unwritable directory costs a store read, never the run. It holds at
most ``cap_bytes``: past that, the least recently used copies go (a read touches its copy).

    cache = BlockCache("/scratch/blocks", cap_bytes=64e9)
    data = cache.get(sha)          # None: not here (read the store, verify, then cache.put(sha, data))
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
TMP = ".tmp-"


class BlockCache:
    def __init__(self, root: str | os.PathLike, cap_bytes: float):
        self.root = Path(os.path.expanduser(os.fspath(root)))
        self.cap_bytes = int(cap_bytes)
        self.hits = 0  # copies read (what a test or a log line can count)
        self._warned = False

    def __repr__(self) -> str:
        return f"BlockCache({str(self.root)!r}, cap_bytes={self.cap_bytes})"

    def _path(self, sha: str) -> Path:
        if not (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"not a sha256: {sha!r}")
        return self.root / f"{sha}{SUFFIX}"

    def get(self, sha: str) -> bytes | None:
        """The copy's bytes (unchecked: the caller holds them to the manifest's sha256), or None."""
        path = self._path(sha)
        try:
            data = path.read_bytes()
            os.utime(path)  # most recently used
        except OSError:
            return None
        self.hits += 1
        return data

    def drop(self, sha: str) -> None:
        """Forget a copy that failed its check."""
        self._path(sha).unlink(missing_ok=True)

    def put(self, sha: str, data: bytes | None = None, src: str | os.PathLike | None = None) -> None:
        """Keep ``data`` (or the file ``src``) as the copy of ``sha``, already verified by the caller."""
        path = self._path(sha)
        if path.exists() or self.cap_bytes <= 0:
            return
        size = len(data) if data is not None else os.path.getsize(src)
        if size > self.cap_bytes:
            return
        tmp = self.root / f"{TMP}{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._evict(self.cap_bytes - size)
            if data is not None:
                with open(tmp, "wb") as f:
                    f.write(data)
            else:
                shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        except OSError as e:  # a full disk or a read-only directory: the store still has the object
            if not self._warned:
                log.warning("bcd.block_cache=%s: not kept (%s); reading the store instead", self.root, e)
                self._warned = True
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # no directory to have left it in

    def _evict(self, keep: int) -> None:
        """Remove the least recently used copies (and any temporary file a killed writer left) until at most
        ``keep`` bytes remain."""
        files = []
        for p in self.root.iterdir():
            try:
                st = p.stat()
            except OSError:
                continue
            if p.name.startswith(TMP):
                if st.st_mtime < time.time() - 3600:  # another writer's, an hour old: killed mid-write
                    p.unlink(missing_ok=True)
                continue
            if p.name.endswith(SUFFIX):
                files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= keep:
                break
            p.unlink(missing_ok=True)
            total -= size

    def bytes_held(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else 0

