"""Train the active block of a visit (docs/DESIGN.md §2.3), evaluate a version on the validation set, and pick
the next block of a greedy order.

Only blocks b..M-1 (and the head) of version v are loaded when training from pre-inferred
activations; ``requires_grad`` is set on block b only, and the optimizer holds block b only, so
gradients and optimizer state exist for the active block alone (invariant I6). The loss itself is
``models.visit.visit_loss``; this module wires the data, the mid-visit checkpoint and tracking to it.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from bcdflow.core import failpoints, preempt
from bcdflow.core.context import RunContext
from bcdflow.errors import BadInput
from bcdflow.models.errors import Diverged
from bcdflow.models.plan import block_tensors
from bcdflow.models.trainer import LoopState, make_optimizer, run_steps
from bcdflow.models.visit import autocast, visit_loss
from bcdflow.storage import activations, checkpoints, trainckpt
from bcdflow.storage.lease import check_leases, lost_lease
from bcdflow.tasks import preemption
from bcdflow.tasks.data import batch_ranges, sample_rows, visit_rows
from bcdflow.tasks.engine import (EvalResult, TrainResult, compile_layers, counted, diverged_message, evaluate_model,
                                  optimizer_state, optimizer_tensors, prefetched, use_recompute, val_batches,
                                  visit_val_batches, window_logger)
from bcdflow.tasks.progress import Progress
from bcdflow.tasks.retry import retrying
from bcdflow.tasks.train_dist import launch
from bcdflow.tracking.tracker import TrackTarget


@task(name="train-block", **retrying(2))
def train_block(ctx: RunContext, cycle: int, block: int, version: int, track: TrackTarget | None = None,
                progress: Progress | None = None, global_step: int = 0, min_rate: float | None = None,
                moments: dict | None = None) -> TrainResult:
    """Train block ``block`` of ``version`` to local convergence (a visit's training); returns its result, the
    block file written (content-addressed) but not committed. ``progress``: the visit's live line
    (tasks/progress.py), closed when the loop ends. ``global_step``: the run's steps before this visit (the
    learning-rate schedule's clock); ``min_rate``: the adaptive budget's rate to beat (``bcd.budget``);
    ``moments``: the optimizer state the block's last visit ended with (``bcd.moments=keep``)."""
    cfg, run_id = ctx.cfg, ctx.run_id
    if cfg.train.gpus > 1:  # torchrun: one process per GPU, rank 0 commits (tasks/train_dist.py)
        return launch(ctx, cycle, block, version, track, global_step=global_step, min_rate=min_rate, moments=moments)
    ds, device, n_layer = ctx.dataset, ctx.device, ctx.model_cfg.n_layer
    lo, hi = ctx.plan[block].layers
    from_acts = ctx.from_acts(block)
    # the validation rows as this visit's model sees them (the prefix's states where it starts at its block): the
    # new version's validation loss is this model's on them, so the visit needs no reload of the whole model
    exact = not from_acts or cfg.bcd.act_dtype == "float32"
    val = visit_val_batches(cfg, ctx, version, block) if cfg.bcd.eval_every or exact else []
    ctx.release_prefix()  # before the visit's model loads: the two are never held at once
    active = ctx.trainable(block)
    streamed = ctx.frozen_layers(block) if ctx.streams(block) else []  # train.offload: in host memory (I6)
    model = ctx.load_part(ctx.manifest(version), (lo if from_acts else 0, n_layer), embed=not from_acts, head=True,
                          trainable=active, stream=streamed)  # bf16 precision: frozen matrices in bf16 (I6)
    saving = model.stream.saving if model.stream else contextlib.nullcontext  # streamed weights saved by reference
    model.loss_chunk_rows = cfg.train.loss_chunk_rows
    for name, p in model.named_parameters():
        p.requires_grad_(name in active)
    names = [n for n, _ in model.named_parameters() if n in active]
    params = [p for n, p in model.named_parameters() if n in active]
    model.train()
    recompute = use_recompute(cfg, ctx, block)
    if cfg.train.compile:
        compile_layers(model)

    rows = visit_rows(cfg, ds.n_train, cycle, block)
    if from_acts:
        fetch = activations.ActivationReader(ctx.store, ctx.acts_key(cycle, block),
                                             pin=device.type == "cuda").read  # (B, T, C), (B, T)
    else:
        def fetch(a: int, b: int):
            return ds.train_pairs(rows[a:b])  # (B, T) inputs, (B, T) targets (masked: IGNORE_INDEX)

    def loss_fn(batch):  # (inputs, targets, trained tokens)
        with autocast(device, cfg.train.precision), saving():
            return visit_loss(model, *batch[:2], lo, from_acts, hi=hi, recompute=recompute,
                              recompute_active=cfg.bcd.recompute == "all")

    val_points: list[tuple[int, float]] = []
    on_window = window_logger(track, cfg.bcd.eval_every, model, lambda: evaluate_model(
        functools.partial(visit_loss, model, lo=lo, from_acts=from_acts), val, cfg, device), val_points)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    spec = cfg.optim_spec(block)
    opt = make_optimizer(params, spec)
    vkey = ctx.visit_key(cycle, block)
    state = None
    ck = trainckpt.load(ctx.store, vkey, device)
    if ck is not None and ck[0]["meta"].get("base_version") == version:  # resume mid-visit
        pointer, saved, opt_state = ck
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in active:
                    p.copy_(saved[n])
        opt.load_state_dict(opt_state)
        for g in opt.param_groups:  # a continued run may have lowered optim.lr (after a divergence)
            g["lr"] = spec.base_lr
        state = LoopState.from_dict(pointer["meta"]["loop"])
    elif moments is not None:  # bcd.moments=keep: where the block's last visit left its optimizer
        saved = checkpoints.load_file(ctx.store, run_id, moments, f"the optimizer moments of block {block}", device)
        opt.load_state_dict(optimizer_state(saved, names, opt.state_dict()["param_groups"]))

    def checkpoint(st: LoopState, why: str) -> None:
        # a holder whose lease could have expired writes nothing more: the next holder of the visit keeps its
        # checkpoint here too. On a lapsed lease (stop() below) this is where the loop ends, with LeaseLost.
        check_leases()
        trainckpt.save(ctx.store, vkey, st.steps, {n: p for n, p in model.named_parameters() if n in active},
                       opt.state_dict(), {"loop": st.to_dict(), "base_version": version, "why": why})
        failpoints.hit("train-checkpoint")

    def stop() -> bool:  # after each step: SIGTERM or Ctrl-C, or a lease of this process that could expire (§9)
        return preempt.requested() or lost_lease() is not None

    # the data cursor: a resumed loop skips the batches it already trained on
    resumed_at = state.steps if state else 0  # run_steps advances the state it is given
    ranges = itertools.islice(batch_ranges(len(rows), cfg.train.batch_size, cfg.seed, cycle, block), resumed_at, None)
    check_leases()  # a lease that lapsed while the visit set up (a slow load): not one step is trained
    try:
        with preempt.training():
            res = run_steps(loss_fn, params, prefetched(ranges, counted(fetch), device), opt, spec,
                            cfg.stop_rule(min_rate), on_window=on_window, should_stop=stop, state=state,
                            checkpoint=checkpoint, ckpt_steps=cfg.checkpoint.every_steps,
                            ckpt_seconds=cfg.checkpoint.every_seconds, progress=progress, global_step=global_step)
    except Diverged as e:
        raise BadInput(diverged_message(cfg, run_id, cycle, block, e)) from None
    finally:
        if progress is not None:
            progress.close()
    check_leases()  # a lease that lapsed during the last step: no evaluation, no block file
    if res.stopped_by == "interrupted":  # SIGTERM or Ctrl-C: the checkpoint is written
        preemption.after_checkpoint(cfg.fleet.reschedule_delay_s)
    val_loss, eval_s = None, 0.0
    if exact and res.stopped_by != "interrupted":
        if val_points and val_points[-1][0] == res.steps:  # validated at the last step already
            val_loss = val_points[-1][1]
        else:
            t0 = time.perf_counter()
            model.eval()
            val_loss = evaluate_model(functools.partial(visit_loss, model, lo=lo, from_acts=from_acts), val, cfg,
                                      device)
            eval_s = time.perf_counter() - t0
    if model.stream:
        model.stream.release()
    return TrainResult(
        steps=res.steps, first_loss=res.losses[0], train_loss=res.final_loss, stopped_by=res.stopped_by,
        seconds=res.seconds, resumed_at=resumed_at, tokens=res.tokens, rows=len(rows), val_points=val_points,
        rate=res.rate, moments_file=checkpoints.save_block(ctx.store, run_id, optimizer_tensors(opt.state_dict(), names))
        if cfg.bcd.moments == "keep" and res.stopped_by != "interrupted" else None,
        peak_mem_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        block_file=checkpoints.save_block(ctx.store, run_id, block_tensors(model, ctx.plan, block)),
        recompute=recompute, streamed=len(streamed), val_loss=val_loss, eval_seconds=eval_s)


@task(name="evaluate", **retrying(2))
def evaluate_version(ctx: RunContext, base_version: int, changed: dict[int, dict] | None = None) -> EvalResult:
    """Validation loss and perplexity of version ``base_version`` with ``changed`` blocks replaced."""
    cfg = ctx.cfg
    manifest = ctx.manifest(base_version)
    manifest = {**manifest, "blocks": {**manifest["blocks"], **{str(b): f for b, f in (changed or {}).items()}}}
    model = ctx.load_part(manifest, (0, ctx.model_cfg.n_layer), True, True, trainable=()).eval()  # bf16: all bf16
    model.loss_chunk_rows = cfg.train.loss_chunk_rows
    t0 = time.perf_counter()
    loss = evaluate_model(model, val_batches(ctx.dataset, cfg), cfg, ctx.device)
    return EvalResult(val_loss=loss, val_ppl=math.exp(min(loss, 50)), seconds=time.perf_counter() - t0)


@task(name="choose-block", cache_policy=NO_CACHE)
def choose_block(ctx: RunContext, version: int, cycle: int, candidates: list[int]) -> int:
    """The candidate block with the largest gradient norm on a probe batch (docs/DESIGN.md §2, order greedy)."""
    cfg = ctx.cfg
    model = ctx.load_part(ctx.manifest(version), (0, ctx.model_cfg.n_layer), True, True)
    probe = sample_rows(ctx.dataset.n_train, 1.0, cfg.seed, cycle, 10_000 + version)[: cfg.train.batch_size]
    x, y = ctx.dataset.train_pairs(np.sort(probe))
    model(x.to(ctx.device), y.to(ctx.device)).backward()
    grads = dict(model.named_parameters())
    norms = {b: float(torch.sqrt(sum((grads[n].grad.float() ** 2).sum() for n in ctx.trainable(b))))
             for b in candidates}
    return max(candidates, key=lambda b: (norms[b], -b))
