"""How a visit holds its model on one device, chosen from the planner's figures (docs/DESIGN.md §10): whether the
frozen suffix is recomputed, which frozen layers stream from host memory (the fewest that make the visit fit its
budget, spread over the layers so each copy hides behind the most compute), and the predicted step time of each
choice; the same for the no-grad passes (pre-inference, evaluation), with their batch; and the smallest
``bcd.blocks`` whose every visit fits a device.

    b = device_budget(24 * GB)                                    # models/memory.py: context and reserve
    shape = StepShape(batch=2, seq=1024, precision="bf16")        # models/specs.py; a run's: cfg.step_shape()
    h = choose_holding(cfg, plan, 0, shape, b.usable)
    h.recompute, h.streamed, h.estimate.peak, h.time.resident_s, h.time.streamed_s
    rec = recommend(cfg, shape, b)                                # rec.blocks, rec.holdings

The step time (:func:`step_time`) is a per-phase pipeline of one compute stream and one copy engine: each layer's
matmuls and attention at ``tflops`` (forward 2NP; backward 2NP for input gradients, 2NP more over trainable
matrices, the forward again where recomputed; the head's input gradient is made in the forward by the chunked
loss), and each copy the stream's slot plan makes (models/stream.SlotPlan) at ``pcie_gbs``, started when it is
issued (the compute stream's work so far is done with the slot) and awaited by the layer that uses it. Two steps
are simulated and the second is timed (the first fills the slots). The optimizer step is left out of both sides.
Both rates are the shape's: a run's are its card kind's (``spend.train_device``, models/specs.CARD_RATES) or
``train.tflops`` / ``train.pcie_gbs``, so the same visit times differently on a 4090 and an H100.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from bcdflow.models.model_config import ModelConfig
from bcdflow.models.memory import (Budget, Estimate, GB, NoGradPass, layer_of, layer_saved_bytes, model_shapes,
                                   no_grad_memory, no_grad_rows, stream_uses, visit_memory)
from bcdflow.models.build import model_plan
from bcdflow.models.plan import Plan
from bcdflow.models import flops
from bcdflow.models.specs import StepShape, tflops_for


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step, its layers all resident and as held (streamed layers copied in)."""
    resident_s: float
    streamed_s: float
    copy_fwd_bytes: int = 0
    copy_bwd_bytes: int = 0
    tokens: int = 0
    hides_at_tokens: int | None = None
    """Tokens per step from which streaming costs at most 1% over resident (None: nothing streams)."""

    @property
    def overhead(self) -> float:
        return self.streamed_s / self.resident_s - 1 if self.resident_s else 0.0


def _events(cfg: ModelConfig, plan: Plan | None, block: int | None, seq: int, preinfer: bool,
            trainable: set[str], recompute: bool, recompute_active: bool, shapes: dict,
            moving: frozenset[str] = frozenset()) -> list[tuple]:
    """One training step as (layer or None, in the backward, FLOPs per token), in execution order. ``moving``: the
    suffix's parameters ``bcd.expand=sign`` steps (their weight gradients computed; the layers recompute as frozen
    ones)."""
    n, C, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    lo, hi = (0, n) if block is None else plan.visits[block].layers
    held_lo = lo if block is not None and plan.visits[block].reads_activations(preinfer) else 0
    mats, train, move = (flops.matrix_elements(shapes, only) for only in (None, trainable, moving))
    attn = flops.attention(seq, C)  # causal QK^T and AV per token
    head = "wte.weight" if cfg.tied else "lm_head.weight"
    out = [(i, False, 2 * mats.get(i, 0) + attn) for i in range(held_lo, n)]
    # logits, input and weight grads
    out.append((None, False, flops.head(V, C) * (2 + (head in trainable or head in moving))))
    for i in reversed(range(lo, n)):
        again = recompute_active if i < hi else recompute and not train.get(i)
        out.append((i, True, 2 * mats.get(i, 0) + 2 * (train.get(i, 0) + move.get(i, 0)) + 2 * attn
                    + (2 * mats.get(i, 0) + attn if again else 0)))
    return out


def _pipeline(events: list[tuple], uses: list[tuple[int, bool, list[int]]], sizes: dict[int, int],
              scale: float, rate: float, pcie: float) -> float:
    """Seconds of the second of two steps: compute on one stream, copies on one engine (see the module doc)."""
    t_c = t_x = 0.0
    ready: dict[int, float] = {}
    end_first = 0.0
    for rnd in range(2):
        it = iter(uses)
        for layer, backward, flops in events:
            if layer in sizes:  # a streamed layer's use: the copies the slot plan makes there, then its wait
                _, _, copies = next(it)
                issued = t_c
                for u in copies:
                    t_x = max(t_x, issued) + sizes[u] / pcie
                    ready[u] = t_x
                t_c = max(t_c, ready.get(layer, 0.0))
            t_c += flops * scale / rate
        if rnd == 0:
            end_first = t_c
    return t_c - end_first


def step_time(cfg: ModelConfig, plan: Plan | None, block: int | None, shape: StepShape,
              sizes: dict[int, int] | None = None) -> StepTime:
    """Predicted step time of a visit (``block`` None: full training), resident and with ``shape.streamed`` layers
    copied through ``shape.window`` slots (``sizes``: their flat bytes, ``Estimate.layer_sizes``); compute at
    ``shape.tflops``, else the precision's on the default kind (:func:`tflops_for`), copies at ``shape.pcie_gbs``."""
    batch, seq, preinfer, freeze, window = shape.batch, shape.seq, shape.preinfer, shape.freeze, shape.window
    recompute, recompute_active = shape.recompute in ("on", "all"), shape.recompute == "all"
    streamed = shape.streamed or ()
    shapes = model_shapes(cfg)
    trainable = set(shapes) if block is None else plan.visits[block].trainable(freeze, cfg.tied)
    lo = 0 if block is None else plan.visits[block].layers[0]
    moving = frozenset(plan.suffix(block, freeze, cfg.tied)) if block is not None and shape.suffix == "sign" else \
        frozenset()
    events = _events(cfg, plan, block, seq, preinfer, trainable, recompute, recompute_active, shapes, moving)
    N, rate, pcie = batch * seq, tflops_for(shape.precision, shape.tflops) * 1e12, shape.pcie_gbs * 1e9
    resident = sum(f for _, _, f in events) * N / rate
    if not streamed:
        return StepTime(resident, resident, tokens=N)
    sizes = {i: sizes[i] for i in streamed}
    uses = [u for u in stream_uses(list(streamed), lo, window) if u[0] in sizes]
    fwd = sum(sizes[c] for i, b, cs in uses if not b for c in cs)
    bwd = sum(sizes[c] for i, b, cs in uses if b for c in cs)
    timed = _pipeline(events, uses, sizes, N, rate, pcie)

    def hidden(scale: float) -> bool:
        return _pipeline(events, uses, sizes, N * scale, rate, pcie) <= 1.01 * resident * scale

    lo_s, hi_s = 1 / 1024, 1024.0
    if hidden(lo_s):
        hides = lo_s
    elif not hidden(hi_s):
        hides = math.inf
    else:
        for _ in range(30):  # bisect on a log scale: compute grows with the tokens, the copies do not
            mid = math.sqrt(lo_s * hi_s)
            lo_s, hi_s = (lo_s, mid) if hidden(mid) else (mid, hi_s)
        hides = hi_s
    return StepTime(resident, timed, fwd, bwd, N, None if math.isinf(hides) else max(seq, round(N * hides)))


def layer_params(cfg: ModelConfig) -> dict[int, int]:
    """Layer -> its parameter count."""
    out: dict[int, int] = {}
    for k, shp in model_shapes(cfg).items():
        if (i := layer_of(k)) is not None:
            out[i] = out.get(i, 0) + math.prod(shp)
    return out


def spread(layers: Sequence[int], k: int) -> list[int]:
    """``k`` of ``layers``, evenly spaced: a streamed layer's copy then hides behind the resident layers before it."""
    m = len(layers)
    return [layers[(2 * j + 1) * m // (2 * k)] for j in range(k)] if 0 < k < m else list(layers[:k] if k else [])


def streamed_choice(frozen: Sequence[int], lo: int, k: int) -> tuple[int, ...]:
    """The ``k`` frozen layers to stream: the prefix's first (held without pre-inference, copied for the forward
    only), then the suffix's, each group spread."""
    prefix, suffix = [i for i in frozen if i < lo], [i for i in frozen if i >= lo]
    if k <= len(prefix):
        return tuple(spread(prefix, k))
    return tuple(sorted(prefix + spread(suffix, k - len(prefix))))


@dataclass
class Holding:
    """How one visit holds its model: recompute or not, the streamed layers, what that holds and costs."""
    recompute: bool
    streamed: tuple[int, ...]
    estimate: Estimate
    time: StepTime | None
    fits: bool
    shape: StepShape
    """The step as held: its ``recompute`` (off, on, all) and ``streamed`` layers."""

    @property
    def frozen(self) -> int:
        return self.estimate.frozen_layers

    def words(self) -> str:
        rc = "recompute" if self.recompute else "no recompute"
        if not self.frozen:
            return rc
        return f"{rc}, {self.frozen - len(self.streamed)}/{self.frozen} frozen layers resident"


def _fewest_streamed(est: Estimate, budget: float, window: int) -> int:
    """The fewest frozen layers to stream for ``est`` to fit ``budget``: k > window layers save k times a layer's
    bytes and cost ``window`` slots of a flat layer (layers are alike; the caller checks the result)."""
    if est.peak <= budget or not est.layer_sizes:
        return 0
    raw = min(r for r, _ in est.layer_sizes.values())
    flat = max(f for _, f in est.layer_sizes.values())
    k = math.ceil((est.peak + window * flat - budget) / max(raw, 1))
    return min(len(est.layer_sizes), max(k, window + 1))


def _options(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, budget: float | None) -> list[Holding]:
    """Block ``block``'s visit held each way ``shape.recompute`` allows (``auto``: off and on), each with the frozen
    layers ``shape.offload`` streams: ``auto`` the fewest that make it fit ``budget`` bytes (None: no limit),
    ``stream`` all of them, ``off`` none."""
    kinds = ["off", "on"] if shape.recompute == "auto" else [shape.recompute]
    offload, window = shape.offload, shape.window
    options = []
    for rc in kinds:
        held = replace(shape, recompute=rc, streamed=())
        base = visit_memory(cfg, plan, block, held)
        frozen = sorted(base.layer_sizes)
        lo = plan.visits[block].layers[0]
        if offload == "stream":
            k = len(frozen)
        elif offload == "off" or budget is None:
            k = 0
        else:
            k = _fewest_streamed(base, budget, window)
        est = base
        while True:
            layers = streamed_choice(frozen, lo, k)
            est = visit_memory(cfg, plan, block, replace(held, streamed=layers)) if layers else base
            if offload != "auto" or budget is None or est.peak <= budget or k >= len(frozen):
                break
            k += 1
        options.append(Holding(rc != "off", tuple(layers), est, None, budget is None or est.peak <= budget,
                               replace(held, streamed=tuple(layers))))
    return options


def fit_holding(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, budget: float | None) -> Holding:
    """Whether block ``block``'s visit fits ``budget`` bytes held as ``shape`` allows, untimed (a fit check, the
    recommendation's search): the first way that fits (no recompute before recompute), else the smallest
    (``fits`` False)."""
    options = _options(cfg, plan, block, shape, budget)
    fitting = [o for o in options if o.fits]
    return fitting[0] if fitting else min(options, key=lambda o: o.estimate.peak)


def choose_holding(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, budget: float | None) -> Holding:
    """Block ``block``'s visit held within ``budget`` bytes (None: no limit): ``shape.recompute``
    (``bcd.recompute``: auto, on, off, all) and ``shape.offload`` (``train.offload``: auto streams the fewest frozen
    layers that make it fit, stream all of them, off none). Of the ways that fit, the fastest by :func:`step_time`;
    if none fits, the smallest (``fits`` False)."""
    options = _options(cfg, plan, block, shape, budget)
    fitting = [o for o in options if o.fits]
    if len(fitting) > 1:
        for o in fitting:
            o.time = _timed(cfg, plan, block, o)
        return min(fitting, key=lambda o: (o.time.streamed_s, len(o.streamed), o.recompute))
    pick = fitting[0] if fitting else min(options, key=lambda o: o.estimate.peak)
    pick.time = _timed(cfg, plan, block, pick)
    return pick


def _timed(cfg: ModelConfig, plan: Plan, block: int, h: Holding) -> StepTime:
    return step_time(cfg, plan, block, h.shape, {i: f for i, (_, f) in h.estimate.layer_sizes.items()})


def probe_bytes(cfg: ModelConfig, shape: StepShape) -> int:
    """What ``bcd.order=greedy``'s probe (models/visit_compute.block_grad_norms) of ``shape.batch`` rows holds beyond
    a no-grad pass: one layer's activations with autograd and its weight gradients, and the head's gradient (the
    largest of them at a time)."""
    s = shape.dtype_bytes
    layer = max(layer_params(cfg).values(), default=0)
    return max(shape.batch * shape.seq * layer_saved_bytes(cfg, shape, "trainable") + layer * s,
               cfg.vocab_size * cfg.d_model * s)


def no_grad_holding(cfg: ModelConfig, part: NoGradPass, shape: StepShape,
                    budget: float | None) -> tuple[tuple[int, ...], int]:
    """(streamed layers, rows per forward) of a no-grad pass over a model part (the pre-inference prefix, an
    evaluation model): every layer resident where a batch of ``shape.batch`` rows (``part.rows`` when set) fits
    ``budget`` (None: no limit), else the fewest streamed layers (spread) that make it fit (``shape.offload``:
    ``stream`` all of them, ``off`` none); then the most rows up to ``part.limit`` (``part.rows``: as given)."""
    lo, hi = part.layers
    all_layers = list(range(lo, hi))
    want = replace(shape, batch=part.rows or shape.batch)

    def peak(streamed) -> int:
        return no_grad_memory(cfg, part, replace(want, streamed=tuple(streamed))).peak

    if shape.offload == "stream":
        streamed: list[int] = all_layers
    elif shape.offload == "off" or budget is None or peak(()) <= budget:
        streamed = []
    else:
        streamed = all_layers
        for k in range(min(shape.window + 1, len(all_layers)), len(all_layers) + 1):
            if peak(spread(all_layers, k)) <= budget:
                streamed = spread(all_layers, k)
                break
    n = part.rows or no_grad_rows(cfg, part, replace(shape, streamed=tuple(streamed)), budget)
    return tuple(streamed), n


def choose_cuts(units: int, fits: Callable[[int, int, float], bool], budget: float, steps: int = 8
                ) -> list[int] | None:
    """Cut points ``[0, c1, ..., units]`` of ``units`` consecutive units (layers) into the fewest spans each of which fits: ``fits(lo, hi, cap)`` says
    whether the span ``[lo, hi)`` fits ``cap`` bytes, and a span inside one that fits must fit too (a smaller block
    holds less). Greedy (each span as long as it fits, which gives the fewest spans when fitting is monotone), then
    balanced: the smallest cap (bisected ``steps`` times between 0 and ``budget``) at which the greedy cut still
    needs no more spans, so the spans come out even in what they hold, not packed in front with a small remainder.
    None when one unit alone does not fit ``budget``."""

    def greedy(cap: float) -> list[int] | None:
        cuts, lo = [0], 0
        while lo < units:
            hi = lo
            while hi < units and fits(lo, hi + 1, cap):
                hi += 1
            if hi == lo:
                return None
            cuts.append(hi)
            lo = hi
        return cuts

    best = greedy(budget)
    if best is None or len(best) == 2:
        return best
    lo_cap, hi_cap = 0.0, float(budget)
    for _ in range(steps):
        mid = (lo_cap + hi_cap) / 2
        cut = greedy(mid)
        if cut is not None and len(cut) <= len(best):
            best, hi_cap = cut, mid
        else:
            lo_cap = mid
    return best


def fit_boundaries(cfg: ModelConfig, shape: StepShape, budget: float, vocab_blocks: int = 1) -> list[int] | None:
    """``bcd.boundaries`` for the fewest blocks whose every visit fits ``budget`` bytes, each block's layers sized
    to what its visit can hold (block 0 carries the embeddings, the last block the head, so they get fewer layers):
    :func:`choose_cuts` over the layers, each span's visit held as :func:`fit_holding` holds it. The inner cut
    points (``[]`` for one block); None when a one-layer block does not fit. ``vocab_blocks`` > 1: the vocabulary
    matrices train in row blocks of their own, so no layer block trains them (any count > 1 cuts the same)."""
    n = cfg.n_layer

    def fits(lo: int, hi: int, cap: float) -> bool:
        cut = [c for c in (lo, hi) if 0 < c < n]
        plan = model_plan(cfg, None if cut else 1, cut or None, freeze=shape.freeze, vocab_blocks=vocab_blocks)
        block = 0 if lo == 0 else 1
        return fit_holding(cfg, plan, block, shape, cap).fits

    cuts = choose_cuts(n, fits, budget)
    return None if cuts is None else cuts[1:-1]


VOCAB_SPLITS = (2, 4, 8, 16, 32, 64)
"""The row-block counts the planner tries for the vocabulary matrices (``bcd.vocab_blocks``), fewest first."""


@dataclass
class Recommendation:
    """The fewest blocks whose every visit fits the budget (``boundaries``: their cut points, chosen by fit; None:
    ``bcd.blocks`` equal splits), and how each visit is held."""
    blocks: int | None
    holdings: list[Holding]
    budget: Budget
    full_peak: int
    full_fits: bool
    host_bytes: int = 0
    """Pinned host memory the largest streaming visit (or its pre-inference prefix) needs."""
    hint: str = ""
    settings: dict = field(default_factory=dict)
    boundaries: list[int] | None = None
    optim: str = "adamw"
    """The optimizer the visits are planned with (``optim.name``; in ``settings`` where it is recommended)."""
    vocab_blocks: int = 1
    """Row blocks per vocabulary matrix (``bcd.vocab_blocks``; in ``settings`` where above 1): their visits follow
    the layer blocks' in ``holdings``."""

    @property
    def worst_peak(self) -> int | None:
        return max((h.estimate.peak for h in self.holdings), default=None) if self.blocks else None

    def line(self) -> str:
        usable = f"{self.budget.usable / GB:.1f} GB usable of {self.budget.card / GB:g} GB"
        if self.blocks is None:
            return (f"no bcd.blocks fits {usable}: even one layer per block with recompute and every frozen layer "
                    "streamed needs more (use more GPUs: train.gpus=N shards the visit, or a smaller "
                    "train.batch_size)")
        name = "AdamW" if self.optim == "adamw" else self.optim
        full = ("full training fits too" if self.full_fits else
                f"full {name} training does not fit ({self.full_peak / GB:.1f} GB)")
        keys = " ".join(f"{k}={v}" for k, v in self.settings.items())
        cut = f" bcd.boundaries=[{','.join(map(str, self.boundaries))}]" if self.boundaries else ""
        rc = sum(h.recompute for h in self.holdings)
        st = sum(bool(h.streamed) for h in self.holdings)
        rows = len(self.holdings) - self.blocks
        how = (f"{len(self.holdings)} visits, {rows} of them row blocks: {rc} recompute, {st} stream" if rows else
               f"{rc} of {len(self.holdings)} visits recompute, {st} stream")
        host = f", {self.host_bytes / GB:.1f} GB of pinned host memory" if st else ""
        return (f"recommended: bcd.blocks={self.blocks}{cut}{' ' + keys if keys else ''} ({how}{host}; worst visit "
                f"{self.worst_peak / GB:.1f} GB of {usable}; {full})")


def _prefix_host_bytes(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, budget: float | None,
                       shard_rows: int) -> int:
    """Pinned host bytes the pre-inference prefix of ``block``'s visit streams (0 when it fits resident)."""
    lo = plan.visits[block].layers[0]
    if not lo:
        return 0
    part = NoGradPass((0, lo), True, False, shard_rows)
    streamed, rows = no_grad_holding(cfg, part, shape, budget)
    return no_grad_memory(cfg, part, replace(shape, batch=rows, streamed=streamed)).host_bytes if streamed else 0


def recommend(cfg: ModelConfig, shape: StepShape, budget: Budget, split: str = "params",
              shard_rows: int = 256) -> Recommendation:
    """The fewest blocks whose every visit fits ``budget.usable``, each visit held as :func:`choose_holding`
    chooses with the ``shape``'s ``recompute``/``offload`` settings (more blocks cost more visits): their cut points
    chosen by fit (:func:`fit_boundaries`), or ``bcd.blocks`` equal splits (``split``) where those need no more
    blocks. ``shard_rows``: pre-inference's rows a shard (its prefix's streamed layers count toward the host
    memory)."""
    none = _no_fit(cfg, shape, budget)
    cuts = fit_boundaries(cfg, shape, budget.usable)
    if cuts is None:
        return none
    m = len(cuts) + 1
    plan = model_plan(cfg, m, split=split, freeze=shape.freeze)
    order = sorted(range(len(plan.visits)), key=lambda b: (b not in (0, len(plan.visits) - 1), b))  # the big ones first
    if all(fit_holding(cfg, plan, b, shape, budget.usable).fits for b in order):
        cuts = None  # the equal split fits as few blocks: bcd.blocks alone says it
    else:
        plan = model_plan(cfg, None, cuts, freeze=shape.freeze)  # cuts: not [] (one block fits as an equal split)
    return _held(cfg, plan, shape, none, shard_rows, boundaries=cuts)


def _no_fit(cfg: ModelConfig, shape: StepShape, budget: Budget) -> Recommendation:
    """The recommendation where nothing fits (``blocks`` None), with full training's peak and the shape's settings
    (the start of every recommendation)."""
    full = visit_memory(cfg, None, None, shape)
    settings = {k: v for k, v in (("bcd.recompute", shape.recompute), ("train.offload", shape.offload))
                if v != "auto"}
    return Recommendation(None, [], budget, full.peak, full.peak <= budget.usable, settings=settings,
                          optim=shape.optim)


def _held(cfg: ModelConfig, plan: Plan, shape: StepShape, none: Recommendation, shard_rows: int,
          **fields) -> Recommendation:
    """``none`` made the recommendation of ``plan``: every visit as :func:`choose_holding` holds it and the pinned
    host memory the largest streaming visit (or its pre-inference prefix) needs."""
    usable = none.budget.usable
    hs = [choose_holding(cfg, plan, b, shape, usable) for b in range(len(plan.visits))]
    host = max([h.estimate.host_bytes for h in hs] + [
        _prefix_host_bytes(cfg, plan, b, shape, usable, shard_rows)
        for b in range(len(plan.visits)) if shape.preinfer and any(h.streamed for h in hs)])
    return replace(none, blocks=len(plan.blocks), holdings=hs, host_bytes=host, **fields)


def recommend_rows(cfg: ModelConfig, shape: StepShape, budget: Budget, shard_rows: int = 256) -> Recommendation:
    """:func:`recommend` with the vocabulary matrices trained in row blocks (``bcd.vocab_blocks``): the layer blocks
    cut by fit without them (:func:`fit_boundaries`), then the fewest row blocks (:data:`VOCAB_SPLITS`) whose every
    visit fits too. For a model whose embedding or head keeps the block that owns it from fitting at all: a row
    visit holds its matrix frozen and trains a slice of its rows. ``blocks`` None when nothing fits."""
    none = _no_fit(cfg, shape, budget)
    if not model_plan(cfg, 1, freeze=shape.freeze, vocab_blocks=2).extra:
        return none  # nothing to split: the vocabulary matrices frozen (bcd.freeze)
    cuts = fit_boundaries(cfg, shape, budget.usable, vocab_blocks=2)
    if cuts is None:
        return none
    for k in VOCAB_SPLITS:
        plan = model_plan(cfg, None if cuts else 1, cuts or None, freeze=shape.freeze, vocab_blocks=k)
        if all(fit_holding(cfg, plan, b, shape, budget.usable).fits for b in range(len(plan.blocks), len(plan.visits))):
            break
    else:
        return none
    return _held(cfg, plan, shape, none, shard_rows, settings={**none.settings, "bcd.vocab_blocks": k},
                 boundaries=cuts or None, vocab_blocks=k)


LIGHTER = {"fp32": "adamw8bit", "bf16": "adamw8bit-bf16"}
"""The lighter state the planner weighs against fp32 AdamW, by ``train.precision`` (bf16 master weights need bf16
compute): models/optimizers.py, models/light.py."""


def recommend_state(cfg: ModelConfig, shape: StepShape, budget: Budget, split: str = "params",
                    shard_rows: int = 256) -> Recommendation:
    """:func:`recommend` with the run's optimizer, and, where that is fp32 AdamW, with the lighter state of its
    precision (:data:`LIGHTER`): recommended instead (``optim.name`` in its settings) where it needs at most half
    the blocks, or where fp32 AdamW fits in no block count. Fewer, larger blocks are the surest lever on the steps
    to a loss (docs/results/suite-2026-11-23); the light state's own figures: docs/results/light-state-*."""
    rec = _lighter(cfg, shape, lambda s: recommend(cfg, s, budget, split, shard_rows))
    if rec.blocks is None:  # the whole vocabulary matrices fit in no block: their rows in blocks of their own
        rows = _lighter(cfg, shape, lambda s: recommend_rows(cfg, s, budget, shard_rows))
        if rows.blocks is not None:
            rows.hint = "; ".join(h for h in ("whole vocabulary matrices fit in no block count", rows.hint) if h)
            return rows
    return rec


def _lighter(cfg: ModelConfig, shape: StepShape, plan_with: Callable[[StepShape], Recommendation]
             ) -> Recommendation:
    """``plan_with(shape)``, or with the lighter state of the precision where that needs at most half the blocks or
    the shape's fp32 AdamW fits in none (only where the shape's optimizer is ``adamw``)."""
    rec = plan_with(shape)
    if shape.optim != "adamw":
        return rec
    name = LIGHTER[shape.precision]
    alt = plan_with(replace(shape, optim=name))
    if alt.blocks is not None and (rec.blocks is None or 2 * alt.blocks <= rec.blocks):
        alt.settings = {"optim.name": name, **alt.settings}
        alt.hint = (f"fp32 AdamW needs bcd.blocks={rec.blocks}" if rec.blocks is not None else
                    "fp32 AdamW fits in no block count")
        return alt
    return rec
