"""The model's figures the run planner (``core/forecast.py``) takes, from the memory planner and its time model
(``models/holding.choose_holding``: torch, a meta-device model): each block's parameters, its prefix's forward FLOPs
per token, and the step time of its visit as held, reading stored activations and computing the prefix on the card.
``bcdflow plan`` (flows/plan.py) and ``bcd.preinfer=auto`` (``RunContext.preinfer_choice``) read them.

    figs = figures(cfg, mcfg, block_plan(cfg, mcfg), device_budget(24 * GB).usable)   # core/context's
"""
from __future__ import annotations

import math
from dataclasses import replace

from bcdflow.core.config import RunConfig
from bcdflow.core.forecast import BlockFigures, FullFigures, FullHeld, ModelFigures
from bcdflow.models import flops
from bcdflow.models.holding import choose_holding, step_time
from bcdflow.models.memory import expand_bytes, layer_of, model_shapes, visit_memory
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import Plan


def figures(cfg: RunConfig, mcfg: ModelConfig, plan_: Plan, budget: float | None) -> ModelFigures:
    """``core/forecast.ModelFigures`` of the run's model cut as ``plan_`` on a card with ``budget`` usable bytes (None:
    no limit): each block's parameters, its prefix's forward FLOPs per token, and the step time of its visit as held,
    reading stored activations and computing the prefix on the card."""
    shapes = model_shapes(mcfg)
    shape = cfg.step_shape()
    if cfg.train.world > 1:  # each process holds its slice of the batch (tasks/train_dist plans the same)
        shape = replace(shape, parallel="fsdp" if cfg.train.parallel == "fsdp" else "ddp")
    numel = {k: math.prod(s) for k, s in shapes.items()}
    T, C = cfg.data.seq_len, mcfg.d_model
    mats, attn = flops.matrix_elements(shapes), flops.attention(T, C)  # the time model's count (models/flops.py)
    per_layer = [2 * mats.get(i, 0) + attn for i in range(mcfg.n_layer)]
    # several processes split the batch (data parallel): the step time divided by them; the all-reduce of what the
    # visit trains is priced apart (core/cluster.py), overlapped with the backward that produces it
    gpus = cfg.train.world
    opt = OPTIMIZERS[cfg.optim.name]
    head = flops.head(mcfg.vocab_size, C)
    blocks = []
    for b, blk in enumerate(plan_.visits):
        lo, _ = blk.layers
        h_on = choose_holding(mcfg, plan_, b, replace(shape, preinfer=True), budget)
        h_off = choose_holding(mcfg, plan_, b, replace(shape, preinfer=False), budget) if lo else h_on
        stored = blk.stored  # the block file its commit writes (a row visit's: the one holding its matrix)
        owners = {o for o in range(len(plan_.blocks)) if o >= stored}
        names = {n for o in owners for n in plan_.blocks[o].params} | ({"wte.weight"} if lo and mcfg.tied else set())
        kind = blk.mechanism
        names_trained = blk.trainable(shape.freeze, mcfg.tied)
        trained = sum(math.prod(kind.trained_shape(blk, n, shapes[n])) for n in names_trained)
        hi = blk.layers[1]
        adapters = sum(expand_bytes(mcfg, shape, i)[0] for i in range(hi, mcfg.n_layer)) if (
            shape.expand_rank and kind.expands) else 0
        grad_bytes = sum(opt.param_bytes(kind.trained_shape(blk, n, shapes[n])) for n in names_trained) + 4 * adapters
        # the backward that runs while the reduced gradients are made: the block's layers (weights and inputs:
        # twice their forward), and the suffix's too where adapters train there; a share of the step's FLOPs
        block_f, suffix_f = sum(per_layer[lo:hi]), sum(per_layer[hi:]) + head
        step_f = block_f + suffix_f + 2 * block_f + suffix_f
        window = (2 * block_f + (suffix_f if adapters else 0)) / step_f
        blocks.append(BlockFigures(
            block=b, layers=tuple(blk.layers), params=sum(numel[n] for n in plan_.blocks[stored].params),
            trainable=trained, own=stored == blk.index,  # a visit of its own file, not another kind's into it
            prefix_flops=float(sum(per_layer[:lo])), step_s=h_on.time.streamed_s / gpus,
            step_computed_s=h_off.time.streamed_s / gpus,
            fits=h_on.fits, fits_computed=h_off.fits, holding=h_on.words(), holding_computed=h_off.words(),
            loaded_params=sum(numel[n] for n in names), grad_bytes=grad_bytes, backward_share=window,
            sharded=gpus > 1 and shape.parallel == "fsdp"))
    return ModelFigures(d_model=C, params=sum(numel.values()), forward_flops=float(sum(per_layer) + head),
                        blocks=tuple(blocks), tensors=len(shapes), full=full_figures(cfg, mcfg, budget),
                        compute_bytes=compute_bytes(cfg), layer_bytes=largest_layer(shapes) * compute_bytes(cfg))


def largest_layer(shapes) -> int:
    """Parameters of the model's largest decoder layer (what ZeRO-3 and FSDP gather at once)."""
    layers: dict[int, int] = {}
    for k, s in shapes.items():
        if (i := layer_of(k)) is not None:
            layers[i] = layers.get(i, 0) + math.prod(s)
    return max(layers.values())


def full_figures(cfg: RunConfig, mcfg: ModelConfig, budget: float | None) -> FullFigures:
    """Full training of the same model on the same cluster at the same tokens a step, as the memory planner holds it
    (every parameter trained, fp32 master weights: ``models/memory.visit_memory``), data parallel (a replica a GPU)
    and ZeRO-3 (sharded over every GPU), each without activation checkpointing where that fits the card, else with
    it: one process's step time on its slice of the batch, its peak, and whether it fits."""
    shapes = model_shapes(mcfg)
    world = cfg.train.world
    base = replace(cfg.step_shape(), preinfer=False, offload="off", streamed=None, expand_rank=0, suffix="off",
                   freeze=())

    def held(parallel: str) -> FullHeld:
        shape = replace(base, parallel=parallel, gpus=world) if world > 1 else base
        for recompute in ("off", "all"):
            s = replace(shape, recompute=recompute)
            peak = visit_memory(mcfg, None, None, s).peak
            fits = budget is None or peak <= budget
            if fits or recompute == "all":
                return FullHeld(step_time(mcfg, None, None, s).resident_s / world, peak, fits, recompute == "all")

    params = sum(math.prod(s) for s in shapes.values())
    compute = compute_bytes(cfg)
    single = single_card(cfg, mcfg, budget, base) if world == 1 else {}
    return FullFigures(ddp=held("ddp"), zero3=held("fsdp"), grad_bytes=params * compute, param_bytes=params * compute,
                       **single)


CPU_ADAM_PARAMS_S = 2.5e9
"""Parameters a second a host's AdamW steps (DeepSpeed's CPU Adam, AVX-512 on a rented box's cores; it reads and
writes about 16 bytes a parameter, so the host's memory bandwidth bounds it). Chosen so that the offload recipe's
step at Llama-3-8B, 8 x 1024 tokens on an RTX 4090 comes within 5% of the published 914 tokens/s (876: 6.15 s of
compute at the time model's 80 TFLOP/s + 3.2 s of host AdamW); at 32 x 1024 the time model gives 1,179 tokens/s
against the published 1,791, its 80 TFLOP/s being below what a long step reaches (docs/results/peers-2026-11-26)."""


def single_card(cfg: RunConfig, mcfg: ModelConfig, budget: float | None, base) -> dict:
    """The exact full-training recipes users run on one card too small for the model (issue 41's anchors), as this
    time and memory model sees them, with activation checkpointing (both recipes use it):

    - ``offload``: ZeRO-3 with parameters and optimizer on the host (ZeRO-Infinity). The card holds two layers' bf16
      weights (the current and the prefetched), the largest layer's gradients and the step's activations; each step
      copies the bf16 weights in twice (forward, backward) and the bf16 gradients out, overlapped with compute, then
      the host steps AdamW (:data:`CPU_ADAM_PARAMS_S`); the host holds fp32 masters and moments and the bf16 copy
      (18 bytes a parameter).
    - ``paged``: torchtune's single-device full fine-tune: bf16 weights on the card, each gradient applied and freed
      in backward (optimizer in backward), 8-bit AdamW state (2 bytes a parameter) paged: what does not fit the card
      moves out and back over PCIe every step.
    """
    shapes = model_shapes(mcfg)
    P = sum(math.prod(s) for s in shapes.values())
    layer = largest_layer(shapes)
    shape = replace(base, recompute="all")
    est = visit_memory(mcfg, None, None, shape)
    compute_s = step_time(mcfg, None, None, shape).resident_s
    pcie = shape.pcie_gbs * 1e9
    acts = est.activations + est.logits + est.input + est.temporaries
    off_peak = acts + 2 * 2 * layer + 2 * layer
    off_s = max(compute_s, 3 * 2 * P / pcie) + P / CPU_ADAM_PARAMS_S
    paged_peak = acts + 2 * P + 2 * layer  # bf16 weights, one layer's gradients at a time
    room = budget - paged_peak if budget is not None else 2 * P
    overflow = max(0.0, 2 * P - room)  # the 8-bit state the card cannot keep
    paged_s = compute_s + 2 * overflow / pcie

    def fits(peak: float) -> bool:
        return budget is None or peak <= budget

    return {"offload": FullHeld(off_s, int(off_peak), fits(off_peak), True, host_bytes=18 * P),
            "paged": FullHeld(paged_s, int(min(paged_peak + 2 * P, budget or paged_peak + 2 * P)), fits(paged_peak),
                              True, host_bytes=int(overflow))}


def compute_bytes(cfg: RunConfig) -> int:
    """Bytes of a weight as a step computes with it (what a gather moves): 2 in bf16, else 4."""
    return 2 if cfg.train.precision == "bf16" else 4
