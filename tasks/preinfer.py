"""Pre-inference (paper §3.2.2): run the frozen prefix (blocks 0..b-1 of version v) over the visit's
sampled rows, shard by shard, and store the hidden states and targets in the visit's Zarr group.

The coordinator creates the arrays once (``plan_shards``); each ``preinfer_shard`` task owns whole
Zarr shards, so any number of them can write concurrently (DESIGN §5). A shard that is already
complete and valid is never recomputed.
"""
from __future__ import annotations

import threading

import torch
from prefect import task

from storage import activations, checkpoints
from storage.store import Store
from storage.tokens import TokenDataset
from tasks import failpoints
from tasks.config import RunConfig
from tasks.data import visit_rows
from tasks.run import plan_for
from tasks.weights import autocast, load_part, resolve_device
from tasks.retry import retrying


def visit_key(run_id: str, cycle: int, block: int) -> str:
    return f"runs/{run_id}/visits/c{cycle}-b{block}"


def acts_key(run_id: str, cycle: int, block: int) -> str:
    return f"{visit_key(run_id, cycle, block)}/activations.zarr"


@task(name="plan-shards", **retrying())
def plan_shards(cfg: RunConfig, run_id: str, cycle: int, block: int, dataset_id: str) -> list[int]:
    """Create the visit's activation arrays (once) and return the shards still to compute."""
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    n = len(visit_rows(cfg, ds.n_train, cycle, block))
    mcfg, _ = plan_for(cfg, ds.vocab_size)
    key = acts_key(run_id, cycle, block)
    activations.create_group(store, key, n_rows=n, seq_len=ds.seq_len, d_model=mcfg.d_model,
                             shard_rows=cfg.bcd.shard_rows, dtype=cfg.bcd.act_dtype,
                             compression=cfg.bcd.act_compression)
    n_shards = -(-n // cfg.bcd.shard_rows)
    return [s for s in range(n_shards) if not activations.shard_complete(store, key, s)]


# one prefix per process: mapped shard tasks run in threads and share it
_prefix_lock = threading.Lock()
_prefix_cache: dict[tuple, torch.nn.Module] = {}


def _prefix(store: Store, run_id: str, version: int, mcfg, plan, block: int, device) -> torch.nn.Module:
    key = (store.url, run_id, version, block, str(device))
    with _prefix_lock:
        if key not in _prefix_cache:
            _prefix_cache.clear()
            manifest = checkpoints.read_manifest(store, run_id, version)
            model = load_part(store, run_id, manifest, mcfg, plan, (0, plan[block].layers[0]),
                              embed=True, head=False, device=device)
            _prefix_cache[key] = model.eval().requires_grad_(False)
        return _prefix_cache[key]


def run_prefix(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str,
               shard: int) -> dict:
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    mcfg, plan = plan_for(cfg, ds.vocab_size)
    device = resolve_device(cfg.train.device)
    rows = visit_rows(cfg, ds.n_train, cycle, block)
    lo = shard * cfg.bcd.shard_rows
    rows = rows[lo:lo + cfg.bcd.shard_rows]
    prefix = _prefix(store, run_id, version, mcfg, plan, block, device)
    tokens = torch.from_numpy(ds.train_rows(rows)).long()  # (n, T+1)
    hidden = []
    with torch.inference_mode(), autocast(device, cfg.train.precision):
        for x in tokens[:, :-1].split(cfg.train.batch_size):
            h = prefix.run_layers(prefix.embed(x.to(device)), 0, plan[block].layers[0])  # (B, T, C)
            hidden.append(h.float().cpu())
    marker = activations.write_shard(store, acts_key(run_id, cycle, block), shard, torch.cat(hidden),
                                     tokens[:, 1:].int())
    failpoints.hit("preinfer-shard")
    return marker


preinfer_shard = task(run_prefix, name="preinfer-shard", task_run_name="shard-{shard}", **retrying())
