"""The store's write and read rates, measured with activation shards of a run's layout (``bcdflow plan --probe``):
written, read back whole and removed, through the same code pre-inference and training use (storage/activations)."""
from __future__ import annotations

import errno
import time
import uuid

from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.storage import activations
from bcdflow.storage.act_layout import group_layout
from bcdflow.storage.layout import throughput_key
from bcdflow.storage.store import Store

GB = 1e9

PROBE_SHARDS = 4
PROBE_SHARD_BYTES = 256 * 10**6
"""The most hidden-state bytes (fp32, as pre-inference hands them over) one probe shard holds in memory: a run's shard
(``bcd.shard_rows`` rows) of a large model is tens of GB, which the probe allocated at once. The probe writes the run's
chunk objects (what the rate depends on), as few per shard as this allows, at least one."""


def probe_store(store: Store, seq_len: int, d_model: int, run_shard_rows: int, act_dtype: str,
                compression: str) -> dict:
    """Write ``PROBE_SHARDS`` activation shards of a run's layout (its chunk objects: ``seq_len``, ``act_dtype``, the
    chunk rows of a ``run_shard_rows`` shard; a shard at most ``PROBE_SHARD_BYTES`` in memory) to ``store`` through
    ``storage/activations`` and read them back whole with its reader, timing each; the probe's group is removed
    after. GB/s of the chunk objects' bytes. A store that stops answering meanwhile is one line naming it (OSError:
    exit 1), never a traceback."""
    import torch

    T = seq_len
    chunk = group_layout(run_shard_rows, T, d_model, run_shard_rows, act_dtype).chunk_rows  # the run's chunk objects
    shard_rows = chunk * max(1, min(run_shard_rows // chunk, PROBE_SHARD_BYTES // (chunk * T * d_model * 4)))
    rows = PROBE_SHARDS * shard_rows
    key = throughput_key(uuid.uuid4().hex[:12])
    lay = group_layout(rows, T, d_model, shard_rows, act_dtype, chunk_rows=chunk)
    gen = torch.Generator().manual_seed(0)
    done = False
    try:
        activations.create_group(store, key, n_rows=rows, seq_len=T, d_model=d_model, shard_rows=shard_rows,
                                 dtype=act_dtype, chunk_rows=chunk, compression=compression)
        hidden = torch.randn((shard_rows, T, d_model), generator=gen)
        # not zeros: Zarr skips writing a chunk that is all fill value (the reader would find it missing)
        targets = torch.randint(1, 1 << 15, (shard_rows, T), generator=gen, dtype=torch.int32)
        t0 = time.perf_counter()
        for s in range(PROBE_SHARDS):
            activations.write_shard(store, key, s, hidden, targets)
        write_s = time.perf_counter() - t0
        reader = activations.ActivationReader(store, key)
        t0 = time.perf_counter()
        for lo in range(0, rows, lay.chunk_rows):
            reader.read(lo, min(rows, lo + lay.chunk_rows))
        read_s = time.perf_counter() - t0
        reader.close()
        done = True
    except (BadInput, DamagedArtifact):
        raise
    except Exception as e:  # s3fs, botocore, aiohttp and zarr raise their own: the store went away mid-probe
        raise _probe_fault(store, key, e) from None
    finally:
        try:
            store.rm(key)
        except Exception as e:
            if done:  # measured, but the probe's objects could not be removed: the store went away at the end
                raise _probe_fault(store, key, e) from None
    return {"store": store.url, "bytes": lay.array_bytes, "shards": PROBE_SHARDS, "write_s": write_s,
            "read_s": read_s, "write_gbs": lay.array_bytes / write_s / GB, "read_gbs": lay.array_bytes / read_s / GB}


def _probe_fault(store, key: str, e: BaseException) -> OSError:
    """The one line of a store that stopped answering during ``--probe`` (the CLI prints an OSError's file name, the
    store, and its reason: exit 1)."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return OSError(errno.EIO, f"the store stopped answering during bcdflow plan --probe ({type(e).__name__}: {first}); "
                   f"its probe objects may be left under {key}/ (remove them once it answers); run the probe again, "
                   "or give --store-gbs", store.url)
