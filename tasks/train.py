"""Train the active block of a visit (docs/DESIGN.md §2.3), evaluate a version on the validation set, and pick
the next block of a greedy order.

Only blocks b..M-1 (and the head) of version v are loaded when training from pre-inferred
activations; ``requires_grad`` is set on block b only, and the optimizer holds block b only, so
gradients and optimizer state exist for the active block alone (invariant I6). A visit's recipe is
``tasks.engine.run_visit``; the loss itself is ``models.visit_compute.visit_loss``.
"""
from __future__ import annotations

import time

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from bcdflow.core.context import RunContext
from bcdflow.errors import BadInput
from bcdflow.models.errors import Diverged
from bcdflow.models.holding import probe_bytes
from bcdflow.models.memory import NoGradPass
from bcdflow.models.visit_compute import autocast, block_grad_norms
from bcdflow.tasks import preemption
from bcdflow.core.rules import VisitSpec, sample_rows
from bcdflow.tasks.engine import (EvalResult, Resident, TrainResult, diverged_message, evaluate_model, run_visit,
                                  val_batches)
from bcdflow.tasks.progress import Progress
from bcdflow.tasks.retry import retrying
from bcdflow.tasks.train_dist import launch
from bcdflow.tracking.tracker import TrackTarget


@task(name="train-block", **retrying(2))
def train_block(ctx: RunContext, spec: VisitSpec, track: TrackTarget | None = None,
                progress: Progress | None = None) -> TrainResult:
    """Train block ``spec.block`` of ``spec.version`` to local convergence (a visit's training; ``spec``: what the
    run's state hands the visit, core/rules.visit_spec); returns its result, the block file written
    (content-addressed) but not committed. The recipe is ``tasks.engine.run_visit``; this task picks how the model is
    held: in this process, or (``train.gpus`` or ``train.nodes`` > 1) in one torchrun process per GPU, rank 0
    committing (tasks/train_dist.py). ``progress``: the visit's live line (tasks/progress.py), closed when the loop ends."""
    cfg = ctx.cfg
    if cfg.train.world > 1:
        return launch(ctx, spec, track)
    try:
        res = run_visit(ctx, spec, Resident, track=track, progress=progress)
    except Diverged as e:
        raise BadInput(diverged_message(cfg, ctx.run_id, spec.cycle, spec.block, e)) from None
    if res.stopped_by == "interrupted":  # SIGTERM or Ctrl-C: the checkpoint is written; this never returns
        preemption.after_checkpoint(cfg.fleet.reschedule_delay_s)
    return res


@task(name="evaluate", **retrying(2))
def evaluate_version(ctx: RunContext, base_version: int, changed: dict[int, dict] | None = None) -> EvalResult:
    """Validation loss and perplexity of version ``base_version`` with ``changed`` blocks replaced, the whole model
    held within a visit's device budget (its layers resident where they fit, the rest streamed: the evaluation
    after a visit on several GPUs loads no more than one of them holds) at its no-grad batch."""
    cfg = ctx.cfg
    manifest = ctx.manifest(base_version)
    manifest = {**manifest, "blocks": {**manifest["blocks"], **{str(b): f for b, f in (changed or {}).items()}}}
    n = ctx.model_cfg.n_layer
    streamed, rows = ctx.no_grad_pass(NoGradPass((0, n), True, True, cfg.train.eval_rows, cfg.train.eval_batch_size))
    model = ctx.load_part(manifest, (0, n), True, True, trainable=(), stream=streamed).eval()  # bf16: all bf16
    model.loss_chunk_rows = cfg.train.loss_chunk_rows
    t0 = time.perf_counter()
    try:
        loss = evaluate_model(model, val_batches(ctx.dataset, cfg, rows), cfg, ctx.device)
    finally:
        if model.stream is not None:
            model.stream.close()
    return EvalResult.of(loss, time.perf_counter() - t0)


@task(name="choose-block", cache_policy=NO_CACHE)
def choose_block(ctx: RunContext, version: int, cycle: int, candidates: list[int]) -> int:
    """The candidate block with the largest gradient norm on a probe batch (docs/DESIGN.md §2, order greedy): the
    whole model held frozen as an evaluation holds it (streamed where it does not fit), the gradients taken one layer
    at a time (models/visit_compute.block_grad_norms), never every gradient of the model at once."""
    cfg = ctx.cfg
    n, B = ctx.model_cfg.n_layer, cfg.train.batch_size
    extra = probe_bytes(ctx.model_cfg, cfg.step_shape())  # one layer's backward at a time
    streamed, _ = ctx.no_grad_pass(NoGradPass((0, n), True, True, B, B), extra=extra)
    model = ctx.load_part(ctx.manifest(version), (0, n), True, True, trainable=(), stream=streamed,
                          grad_from=0).eval()
    model.loss_chunk_rows = cfg.train.loss_chunk_rows
    probe = sample_rows(ctx.dataset.n_train, 1.0, cfg.seed, cycle, 10_000 + version)[: cfg.train.batch_size]
    x, y = ctx.dataset.train_pairs(np.sort(probe))
    try:
        with autocast(ctx.device, cfg.train.precision):
            trains = {k: b for b in candidates for k in ctx.trainable(b)}  # bcd.freeze's parameters count nothing
            norms = block_grad_norms(model, x.to(ctx.device), y.to(ctx.device), trains.get, candidates)
    finally:
        if model.stream is not None:
            model.stream.close()
    return max(candidates, key=lambda b: (norms[b], -b))
