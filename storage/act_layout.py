"""How a visit's activation group lies in the store, as numbers: chunk rows, chunk objects and their bytes, with no
Zarr, no torch (docs/DESIGN.md §2.2, §5). ``storage/activations.py`` creates its arrays from these, and the run planner
(``core/forecast.py``) counts a visit's bytes from the same, so what the plan says a visit writes is what it writes.

    lay = group_layout(n_rows=90_000, seq_len=1024, d_model=4096, shard_rows=256, dtype="bfloat16")
    lay.hidden_bytes, lay.targets_bytes, lay.objects, lay.array_bytes

Zarr 3's regular chunk grid stores every chunk at its full shape, the last one too (its rows past the array's end are
the fill value), and an uncompressed chunk object is exactly its array bytes (the ``bytes`` codec), so the bytes are
``chunks x chunk_rows x row bytes`` for each array. With ``bcd.act_compression=zstd`` the figures are the bytes before
compression (an upper bound: activations barely compress).
"""
from __future__ import annotations

from dataclasses import dataclass

CHUNK_BYTES = 16 << 20
"""~16 MB per chunk object: large enough for object stores, small enough for batches."""
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per stored hidden value by ``bcd.act_dtype`` (bfloat16 is stored as its 16-bit pattern)."""
TARGET_ITEMSIZE = 4
"""Targets are int32."""


def default_chunk_rows(shard_rows: int, row_bytes: int) -> int:
    """Largest divisor of shard_rows whose chunk fits in ~16 MB (at least one row)."""
    cap = max(1, CHUNK_BYTES // max(1, row_bytes))
    return max(r for r in range(1, min(cap, shard_rows) + 1) if shard_rows % r == 0)


@dataclass(frozen=True)
class GroupLayout:
    """One visit's activation group: ``n_rows`` rows of ``seq_len`` positions, hidden width ``d_model``."""
    n_rows: int
    seq_len: int
    d_model: int
    shard_rows: int
    dtype: str
    chunk_rows: int

    @property
    def n_shards(self) -> int:
        return -(-self.n_rows // self.shard_rows)

    @property
    def n_chunks(self) -> int:
        """Chunk objects per array (the last one is stored whole)."""
        return -(-self.n_rows // self.chunk_rows)

    @property
    def hidden_chunk_bytes(self) -> int:
        return self.chunk_rows * self.seq_len * self.d_model * ITEMSIZE[self.dtype]

    @property
    def targets_chunk_bytes(self) -> int:
        return self.chunk_rows * self.seq_len * TARGET_ITEMSIZE

    @property
    def hidden_bytes(self) -> int:
        """Bytes of the ``hidden`` array's chunk objects."""
        return self.n_chunks * self.hidden_chunk_bytes

    @property
    def targets_bytes(self) -> int:
        return self.n_chunks * self.targets_chunk_bytes

    @property
    def array_bytes(self) -> int:
        """Both arrays' chunk objects: what pre-inference writes and one epoch over the rows reads."""
        return self.hidden_bytes + self.targets_bytes

    @property
    def objects(self) -> int:
        """Objects written: two chunk objects per chunk row range, one marker per shard (metadata aside)."""
        return 2 * self.n_chunks + self.n_shards


def group_layout(n_rows: int, seq_len: int, d_model: int, shard_rows: int, dtype: str = "float32",
                 chunk_rows: int | None = None) -> GroupLayout:
    """The layout ``storage/activations.create_group`` gives a group of these sizes (``chunk_rows`` None: its
    default, the largest divisor of ``shard_rows`` whose chunk fits ~16 MB)."""
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(shard_rows, seq_len * d_model * ITEMSIZE[dtype])
    return GroupLayout(n_rows, seq_len, d_model, shard_rows, dtype, chunk_rows)
