"""The model's figures the run planner (``core/runplan.py``) takes, from the memory planner and its time model
(``models/holding.choose_holding``: torch, a meta-device model): each block's parameters, its prefix's forward FLOPs
per token, and the step time of its visit as held, reading stored activations and computing the prefix on the card.
``bcdflow plan`` (flows/plan.py) and ``bcd.preinfer=auto`` (``RunContext.preinfer_choice``) read them.

    figs = figures(cfg, mcfg, block_plan(cfg, mcfg), device_budget(24 * GB).usable)   # core/context's
"""
from __future__ import annotations

import math
from dataclasses import replace

from bcdflow.core.config import RunConfig
from bcdflow.core.runplan import BlockFigures, ModelFigures
from bcdflow.models.holding import choose_holding
from bcdflow.models.memory import layer_of, model_shapes
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import Plan


def figures(cfg: RunConfig, mcfg: ModelConfig, plan_: Plan, budget: float | None) -> ModelFigures:
    """``core/runplan.ModelFigures`` of the run's model cut as ``plan_`` on a card with ``budget`` usable bytes (None:
    no limit): each block's parameters, its prefix's forward FLOPs per token, and the step time of its visit as held,
    reading stored activations and computing the prefix on the card."""
    shapes = model_shapes(mcfg)
    shape = cfg.step_shape()
    if cfg.train.gpus > 1:  # each process holds its slice of the batch (tasks/train_dist plans the same)
        shape = replace(shape, parallel="fsdp" if cfg.train.parallel == "fsdp" else "ddp")
    numel = {k: math.prod(s) for k, s in shapes.items()}
    T, C = cfg.data.seq_len, mcfg.d_model
    layer_flops = {}
    for k, s in shapes.items():
        if (i := layer_of(k)) is not None and len(s) >= 2:
            layer_flops[i] = layer_flops.get(i, 0) + 2 * numel[k]
    attn = 2 * T * C  # causal QK^T and AV per token (models/holding._events)
    per_layer = [layer_flops.get(i, 0) + attn for i in range(mcfg.n_layer)]
    # several processes split the batch (data parallel): the step time divided by them, the all-reduce left out
    gpus = cfg.train.gpus
    blocks = []
    for b, blk in enumerate(plan_):
        lo, _ = blk.layers
        h_on = choose_holding(mcfg, plan_, b, replace(shape, preinfer=True), budget)
        h_off = choose_holding(mcfg, plan_, b, replace(shape, preinfer=False), budget) if lo else h_on
        stored = plan_.stored(b)  # a row block (bcd.vocab_blocks): the block file holding its matrix
        owners = {o for o in range(len(plan_.blocks)) if o >= stored}
        names = {n for o in owners for n in plan_[o].params} | ({"wte.weight"} if lo and mcfg.tied else set())
        trained = ((blk.rows[1] - blk.rows[0]) * C if blk.rows is not None  # the slice's rows only
                   else sum(numel[n] for n in blk.trainable(shape.freeze, mcfg.tied)))
        blocks.append(BlockFigures(
            block=b, layers=tuple(blk.layers), params=sum(numel[n] for n in plan_[stored].params),
            trainable=trained, row=blk.rows is not None,
            prefix_flops=float(sum(per_layer[:lo])), step_s=h_on.time.streamed_s / gpus,
            step_computed_s=h_off.time.streamed_s / gpus,
            fits=h_on.fits, fits_computed=h_off.fits, holding=h_on.words(), holding_computed=h_off.words(),
            loaded_params=sum(numel[n] for n in names)))
    head = 2 * mcfg.vocab_size * C
    return ModelFigures(d_model=C, params=sum(numel.values()), forward_flops=float(sum(per_layer) + head),
                        blocks=tuple(blocks), tensors=len(shapes))
