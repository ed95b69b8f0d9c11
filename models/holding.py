"""How a visit holds its model on one device, chosen from the planner's figures (docs/DESIGN.md §10): whether the
frozen suffix is recomputed, which frozen layers stream from host memory (the fewest that make the visit fit its
budget, spread over the layers so each copy hides behind the most compute), and the predicted step time of each
choice; the same for the no-grad passes (pre-inference, evaluation), with their batch; and the smallest
``bcd.blocks`` whose every visit fits a device.

    b = device_budget(24 * GB)                                             # models/memory.py: context and reserve
    h = choose_holding(cfg, plan, 0, batch=2, seq=1024, precision="bf16", budget=b.usable)
    h.recompute, h.streamed, h.estimate.peak, h.time.resident_s, h.time.streamed_s
    rec = recommend(cfg, 2, 1024, "bf16", b)                               # rec.blocks, rec.holdings

The step time (:func:`step_time`) is a per-phase pipeline of one compute stream and one copy engine: each layer's
matmuls and attention at ``tflops`` (forward 2NP; backward 2NP for input gradients, 2NP more over trainable
matrices, the forward again where recomputed; the head's input gradient is made in the forward by the chunked
loss), and each copy the stream's slot plan makes (models/stream.SlotPlan) at ``pcie_gbs``, started when it is
issued (the compute stream's work so far is done with the slot) and awaited by the layer that uses it. Two steps
are simulated and the second is timed (the first fills the slots). The optimizer step is left out of both sides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from bcdflow.models.model_config import ModelConfig
from bcdflow.models.memory import (Budget, Estimate, GB, Step, _layer_act, _layer_of, _numel, _shapes,
                                   no_grad_memory, no_grad_rows, stream_uses, visit_memory)
from bcdflow.models.build import model_plan
from bcdflow.models.plan import Plan

PCIE_GBS = 25.0
"""Host-to-device copy bandwidth a streamed layer gets, GB/s: PCIe 4.0 x16 in practice (an RTX 4090's bus)."""
TFLOPS = {"fp32": 40.0, "bf16": 80.0}
"""Matmul throughput a training step reaches, TFLOP/s, by ``train.precision``: about half an RTX 4090's dense peak
in each (bf16 on tensor cores, 165; fp32 on the CUDA cores, 82.6: torch leaves TF32 off). ``train.tflops``
overrides it; ``make gpu-check`` measures both on the card it runs on."""


def tflops_for(precision: str, tflops: float | None = None) -> float:
    """The matmul throughput the time model uses: ``tflops`` where given, else :data:`TFLOPS` of the precision."""
    return float(tflops) if tflops else TFLOPS.get(precision, TFLOPS["fp32"])


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
            trainable: set[str], recompute: bool, recompute_active: bool, shapes: dict) -> list[tuple]:
    """One training step as (layer or None, in the backward, FLOPs per token), in execution order."""
    n, C, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    lo, hi = (0, n) if block is None else plan[block].layers
    held_lo = lo if block is not None and plan[block].reads_activations(preinfer) else 0
    mats: dict[int, int] = {}
    train: dict[int, int] = {}
    for k, shp in shapes.items():
        if (i := _layer_of(k)) is not None and len(shp) >= 2:
            mats[i] = mats.get(i, 0) + _numel(shp)
            train[i] = train.get(i, 0) + (_numel(shp) if k in trainable else 0)
    attn = 2 * seq * C  # causal QK^T and AV per token
    head = "wte.weight" if cfg.tied else "lm_head.weight"
    out = [(i, False, 2 * mats.get(i, 0) + attn) for i in range(held_lo, n)]
    out.append((None, False, 2 * V * C * (2 + (head in trainable))))  # logits, input gradient, weight gradient
    for i in reversed(range(lo, n)):
        again = recompute_active if i < hi else recompute and not train.get(i)
        out.append((i, True, 2 * mats.get(i, 0) + 2 * train.get(i, 0) + 2 * attn
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


def step_time(cfg: ModelConfig, plan: Plan | None, block: int | None, batch: int, seq: int, *, preinfer: bool = True,
              freeze: Sequence[str] = (), recompute: bool = False, recompute_active: bool = False,
              streamed: Sequence[int] = (), sizes: dict[int, int] | None = None, window: int = 2,
              pcie_gbs: float = PCIE_GBS, tflops: float | None = None, precision: str = "fp32") -> StepTime:
    """Predicted step time of a visit (``block`` None: full training), resident and with ``streamed`` layers copied
    through ``window`` slots (``sizes``: their flat bytes, ``Estimate.layer_sizes``); compute at ``tflops``, else
    the precision's (:func:`tflops_for`)."""
    shapes = _shapes(cfg)
    trainable = set(shapes) if block is None else plan[block].trainable(freeze, cfg.tied)
    lo = 0 if block is None else plan[block].layers[0]
    events = _events(cfg, plan, block, seq, preinfer, trainable, recompute, recompute_active, shapes)
    N, rate, pcie = batch * seq, tflops_for(precision, tflops) * 1e12, pcie_gbs * 1e9
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
    for k, shp in _shapes(cfg).items():
        if (i := _layer_of(k)) is not None:
            out[i] = out.get(i, 0) + _numel(shp)
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


def choose_holding(cfg: ModelConfig, plan: Plan, block: int, batch: int, seq: int, precision: str,
                   budget: float | None, optim: str = "adamw", *, recompute: str = "auto", offload: str = "auto",
                   window: int = 2, pcie_gbs: float = PCIE_GBS, tflops: float | None = None, preinfer: bool = True,
                   freeze: Sequence[str] = (), timed: bool = True, **kw) -> Holding:
    """Block ``block``'s visit held within ``budget`` bytes (None: no limit): ``recompute`` (``bcd.recompute``: auto,
    on, off, all) and ``offload`` (``train.offload``: auto streams the fewest frozen layers that make it fit, stream
    all of them, off none). Of the ways that fit, the fastest by :func:`step_time` (``timed``); if none fits, the
    smallest (``fits`` False). ``kw``: ``visit_memory``'s chunk_rows, weight_decay, shapes."""
    kinds = [False, True] if recompute == "auto" else [recompute in ("on", "all")]
    options = []
    for rc in kinds:
        common = dict(recompute=rc, preinfer=preinfer, freeze=freeze, recompute_active=recompute == "all", **kw)
        base = visit_memory(cfg, plan, block, batch, seq, precision, optim, window=window, **common)
        frozen = sorted(base.layer_sizes)
        lo = plan[block].layers[0]
        if offload == "stream":
            k = len(frozen)
        elif offload == "off" or budget is None:
            k = 0
        else:
            k = _fewest_streamed(base, budget, window)
        est = base
        while True:
            layers = streamed_choice(frozen, lo, k)
            est = visit_memory(cfg, plan, block, batch, seq, precision, optim, window=window, streamed=layers,
                               **common) if layers else base
            if offload != "auto" or budget is None or est.peak <= budget or k >= len(frozen):
                break
            k += 1
        options.append(Holding(rc, tuple(layers), est, None, budget is None or est.peak <= budget))
    fitting = [o for o in options if o.fits]
    if timed and len(fitting) > 1:
        for o in fitting:
            o.time = step_time(cfg, plan, block, batch, seq, preinfer=preinfer, freeze=freeze, recompute=o.recompute,
                               recompute_active=recompute == "all", streamed=o.streamed,
                               sizes={i: f for i, (_, f) in o.estimate.layer_sizes.items()}, window=window,
                               pcie_gbs=pcie_gbs, tflops=tflops, precision=precision)
        return min(fitting, key=lambda o: (o.time.streamed_s, len(o.streamed), o.recompute))
    pick = fitting[0] if fitting else min(options, key=lambda o: o.estimate.peak)
    if timed:
        pick.time = step_time(cfg, plan, block, batch, seq, preinfer=preinfer, freeze=freeze, recompute=pick.recompute,
                              recompute_active=recompute == "all", streamed=pick.streamed,
                              sizes={i: f for i, (_, f) in pick.estimate.layer_sizes.items()}, window=window,
                              pcie_gbs=pcie_gbs, tflops=tflops, precision=precision)
    return pick


def probe_bytes(cfg: ModelConfig, rows: int, seq: int, precision: str) -> int:
    """What ``bcd.order=greedy``'s probe (models/visit_compute.block_grad_norms) holds beyond a no-grad pass: one layer's
    activations with autograd and its weight gradients, and the head's gradient (the largest of them at a time)."""
    st = Step(cfg, rows, seq, precision)
    s = st.s
    layer = max(layer_params(cfg).values(), default=0)
    return max(rows * seq * _layer_act(st, "trainable") + layer * s, cfg.vocab_size * cfg.d_model * s)


def no_grad_holding(cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool, seq: int, precision: str,
                    budget: float | None, min_rows: int, limit: int, *, offload: str = "auto", window: int = 2,
                    chunk_rows: int | None = None, rows: int | None = None,
                    extra: int = 0) -> tuple[tuple[int, ...], int]:
    """(streamed layers, rows per forward) of a no-grad pass over a model part (the pre-inference prefix, an
    evaluation model): every layer resident where a batch of ``min_rows`` rows fits ``budget`` (less ``extra`` bytes
    the caller holds beside it), else the fewest streamed layers (spread) that make it fit; then the most rows up to
    ``limit`` (``rows``: as given)."""
    budget = None if budget is None else budget - extra
    lo, hi = layers
    all_layers = list(range(lo, hi))
    want = rows or min_rows

    def peak(streamed) -> int:
        return no_grad_memory(cfg, layers, embed, head, want, seq, precision, streamed, window, chunk_rows).peak

    if offload == "stream":
        streamed: list[int] = all_layers
    elif offload == "off" or budget is None or peak(()) <= budget:
        streamed = []
    else:
        streamed = all_layers
        for k in range(min(window + 1, len(all_layers)), len(all_layers) + 1):
            if peak(spread(all_layers, k)) <= budget:
                streamed = spread(all_layers, k)
                break
    n = rows or no_grad_rows(cfg, layers, embed, head, seq, precision, budget, limit, streamed, window, chunk_rows)
    return tuple(streamed), n


@dataclass
class Recommendation:
    """The smallest ``bcd.blocks`` whose every visit fits the budget, and how each visit is held at it."""
    blocks: int | None
    holdings: list[Holding]
    budget: Budget
    full_peak: int
    full_fits: bool
    host_bytes: int = 0
    """Pinned host memory the largest streaming visit (or its pre-inference prefix) needs."""
    hint: str = ""
    settings: dict = field(default_factory=dict)

    @property
    def worst_peak(self) -> int | None:
        return max((h.estimate.peak for h in self.holdings), default=None) if self.blocks else None

    def line(self) -> str:
        usable = f"{self.budget.usable / GB:.1f} GB usable of {self.budget.card / GB:g} GB"
        if self.blocks is None:
            return (f"no bcd.blocks fits {usable}: even one layer per block with recompute and every frozen layer "
                    "streamed needs more (use more GPUs: train.gpus=N shards the visit, or a smaller "
                    "train.batch_size)")
        full = ("full training fits too" if self.full_fits else
                f"full AdamW training does not fit ({self.full_peak / GB:.1f} GB)")
        keys = " ".join(f"{k}={v}" for k, v in self.settings.items())
        rc = sum(h.recompute for h in self.holdings)
        st = sum(bool(h.streamed) for h in self.holdings)
        how = f"{rc} of {len(self.holdings)} visits recompute, {st} stream"
        host = f", {self.host_bytes / GB:.1f} GB of pinned host memory" if st else ""
        return (f"recommended: bcd.blocks={self.blocks}{' ' + keys if keys else ''} ({how}{host}; worst visit "
                f"{self.worst_peak / GB:.1f} GB of {usable}; {full})")


def plan_holdings(cfg: ModelConfig, blocks: int, batch: int, seq: int, precision: str, budget: float | None,
                  optim: str = "adamw", split: str = "params", freeze: Sequence[str] = (), timed: bool = True,
                  **kw) -> list[Holding]:
    """Every visit of the ``bcd.blocks=blocks`` plan as :func:`choose_holding` holds it."""
    plan = model_plan(cfg, blocks, split=split, freeze=freeze)
    shapes = _shapes(cfg)
    return [choose_holding(cfg, plan, b, batch, seq, precision, budget, optim, freeze=freeze, shapes=shapes,
                           timed=timed, **kw) for b in range(len(plan))]


def prefix_host_bytes(cfg: ModelConfig, plan: Plan, block: int, seq: int, precision: str, budget: float | None,
                      min_rows: int, limit: int, **kw) -> int:
    """Pinned host bytes the pre-inference prefix of ``block``'s visit streams (0 when it fits resident)."""
    lo = plan[block].layers[0]
    if not lo:
        return 0
    streamed, rows = no_grad_holding(cfg, (0, lo), True, False, seq, precision, budget, min_rows, limit, **kw)
    return no_grad_memory(cfg, (0, lo), True, False, rows, seq, precision, streamed,
                          kw.get("window", 2)).host_bytes if streamed else 0


def recommend(cfg: ModelConfig, batch: int, seq: int, precision: str, budget: Budget, optim: str = "adamw",
              split: str = "params", preinfer: bool = True, freeze: Sequence[str] = (), recompute: str = "auto",
              offload: str = "auto", window: int = 2, shard_rows: int = 256, **kw) -> Recommendation:
    """The smallest block count whose every visit fits ``budget.usable``, each visit held as :func:`choose_holding`
    chooses with these ``recompute``/``offload`` settings (more blocks cost more visits). ``kw``: pcie_gbs,
    tflops, chunk_rows, weight_decay, expand_rank (``bcd.expand``'s adapters)."""
    full = visit_memory(cfg, None, None, batch, seq, precision, optim, chunk_rows=kw.get("chunk_rows"),
                        weight_decay=kw.get("weight_decay", 1e-5))
    settings = {k: v for k, v in (("bcd.recompute", recompute), ("train.offload", offload)) if v != "auto"}
    shapes = _shapes(cfg)
    mem_kw = {k: v for k, v in kw.items() if k in ("chunk_rows", "weight_decay", "expand_rank")}
    for m in range(1, cfg.n_layer + 1):
        plan = model_plan(cfg, m, split=split, freeze=freeze)
        order = sorted(range(len(plan)), key=lambda b: (b not in (0, len(plan) - 1), b))  # the big ones first
        if all(choose_holding(cfg, plan, b, batch, seq, precision, budget.usable, optim, recompute=recompute,
                              offload=offload, window=window, preinfer=preinfer, freeze=freeze, timed=False,
                              shapes=shapes, **mem_kw).fits for b in order):  # stops at the first that does not
            hs = plan_holdings(cfg, m, batch, seq, precision, budget.usable, optim, split, freeze, recompute=recompute,
                               offload=offload, window=window, preinfer=preinfer, **kw)
            host = max([h.estimate.host_bytes for h in hs] + [
                prefix_host_bytes(cfg, plan, b, seq, precision, budget.usable, batch, shard_rows, offload=offload,
                                  window=window) for b in range(len(plan)) if preinfer and any(h.streamed for h in hs)])
            return Recommendation(m, hs, budget, full.peak, full.peak <= budget.usable, host, settings=settings)
    return Recommendation(None, [], budget, full.peak, full.peak <= budget.usable, settings=settings)
