"""Pre-inference (paper §3.2.2): run the frozen prefix (blocks 0..b-1 of version v) over the visit's
sampled rows, shard by shard, and store the hidden states and targets in the visit's Zarr group (on
``bcd.act_store`` where set: ``RunContext.act_store``).

The coordinator creates the arrays once (``plan_shards``); each ``preinfer_shard`` task owns whole
storage objects, so any number of them can write concurrently (docs/DESIGN.md §5). A shard that is already
complete and valid is never recomputed.
"""
from __future__ import annotations

import torch
from prefect import task

from bcdflow.core import failpoints
from bcdflow.core.context import RunContext
from bcdflow.models.visit_compute import autocast, prefix_hidden
from bcdflow.storage import activations
from bcdflow.core.rules import visit_rows
from bcdflow.tasks.retry import retrying


@task(name="plan-shards", **retrying())
def plan_shards(ctx: RunContext, cycle: int, block: int) -> list[int]:
    """Create the visit's activation arrays (once) and return the shards still to compute."""
    cfg = ctx.cfg
    n = len(visit_rows(cfg, ctx.dataset.n_train, cycle, block))
    key = ctx.acts_key(cycle, block)
    activations.create_group(ctx.act_store, key, n_rows=n, seq_len=ctx.dataset.seq_len, d_model=ctx.model_cfg.d_model,
                             shard_rows=cfg.bcd.shard_rows, dtype=cfg.bcd.act_dtype,
                             compression=cfg.bcd.act_compression)
    n_shards = -(-n // cfg.bcd.shard_rows)
    marked = activations.complete_shards(ctx.act_store, key)  # one listing: a shard with no marker is not read at all
    return [s for s in range(n_shards) if s not in marked or not activations.shard_complete(ctx.act_store, key, s)]


@task(name="preinfer-shard", task_run_name="shard-{shard}", **retrying())
def preinfer_shard(ctx: RunContext, cycle: int, block: int, version: int, shard: int) -> dict:
    """Compute and write one shard: the frozen prefix over the shard's rows, batch by batch at the prefix's no-grad
    batch (``RunContext.preinfer_rows``), its states copied asynchronously into a page-locked host buffer."""
    cfg = ctx.cfg
    lo = shard * cfg.bcd.shard_rows
    rows = visit_rows(cfg, ctx.dataset.n_train, cycle, block)[lo:lo + cfg.bcd.shard_rows]
    prefix = ctx.frozen_prefix(version, block)
    inputs, targets = ctx.dataset.train_pairs(rows)  # (n, T) each; masked targets are -100
    layer = ctx.plan.visits[block].layers[0]
    cuda = ctx.device.type == "cuda"
    # the shard's token ids to the device in one copy (n, T) int64, a few MB: not through torch's pinned allocator
    # (rounded to a power of two, cached, uncounted), and the batches below are slices of it
    inputs = inputs.to(ctx.device)
    step = ctx.preinfer_rows(block)  # the no-grad batch: the most rows that fit the device, not the training batch
    with ctx.staging((len(rows), ctx.dataset.seq_len, ctx.model_cfg.d_model)) as hidden:  # (n, T, C) on the host
        # one shard computes at a time: shard tasks share the prefix (its stream, a batch's worth of memory); the
        # other writes its shard to the store meanwhile
        with ctx.prefix_lock, torch.inference_mode(), autocast(ctx.device, cfg.train.precision):
            for a in range(0, len(rows), step):  # each batch's states copied out without a host sync
                hidden[a:a + step].copy_(prefix_hidden(prefix, inputs[a:a + step], layer).float(), non_blocking=True)
            if cuda:
                torch.cuda.current_stream(ctx.device).synchronize()  # once per shard: the states are on the host
        failpoints.hit("preinfer-computed")
        # the targets go with the activations, mask included: the visit trains from this group alone
        marker = activations.write_shard(ctx.act_store, ctx.acts_key(cycle, block), shard, hidden, targets.int())
    failpoints.hit("preinfer-shard")
    return marker


# Dask ships this task to its workers by reference to this module, where the decorated name is the Task: the plain
# function is found as its attribute (pickle resolves dotted names), not pickled by value with its globals
preinfer_shard.fn.__qualname__ = "preinfer_shard.fn"
