"""The memory planner: the peak device memory of one training step of each block's visit, and of full training,
from the model config alone (parameter shapes from a meta-device model: no weights, no device).

    est = visit_memory(cfg, plan, block=0, batch=4, seq=1024, precision="bf16")   # one visit's step
    est = visit_memory(cfg, None, None, 4, 1024, "bf16")                          # full-parameter training
    est.peak, est.parts()    # bytes: weights, grads, optim, activations, logits, input, temporaries
    rec = recommend(cfg, 4, 1024, "bf16", gpu_bytes=24 * GB)                      # smallest bcd.blocks that fits

What a step holds (the product's path: tasks/train.py -> models/visit_compute.visit_loss -> models/trainer.run_steps):

- weights: held parameters only (a visit with pre-inference holds layers >= its block and the head; docs/DESIGN.md I6).
  Trainable ones in fp32; frozen matrices in bf16 with ``precision=bf16`` (models/build.frozen_in), else fp32.
- grads and optimizer state: the trainable parameters only, fp32; AdamW two moments, SGD one momentum buffer
  (plus one gradient-sized temporary: foreach SGD with weight decay adds ``wd * p`` out of place).
- activations: what autograd saves, layer by layer (per token; C = d_model, F = MLP width, K = key/value width,
  s = bytes of the compute dtype, 4 in fp32 and 2 under bf16 autocast, r = 4: the residual stream is fp32):

    GPT-2 layer   trainable 2rC + s(7C + 2F)            frozen on the gradient path 2rC + s(4C + F)
    LLaMA layer   trainable 4rC + s(5C + 2K + 4F) (fp32), 4rC + s(8C + 2K + 4F) (bf16: one cast of the norm
                  output per projection)                frozen 2rC + s(2C + 2K + 3F)
    recomputed    rC (the layer's input; its activations come back one layer at a time in backward)

  Trainable layers keep every matmul input (weight gradients need them); frozen ones only what input gradients
  need: the norms' inputs, attention's q/k/v/output, the nonlinearity inputs. Under bf16 autocast a trainable
  matrix also keeps its bf16 cast (autocast caches it for backward).
- logits: the chunked loss (models/base.py) holds one chunk's logits, ``rows x V`` in fp32 plus its bf16 copy,
  and the head's input gradient (N x C) from forward to backward; a trainable head also its weight gradient
  (counted under grads) and, under bf16, a bf16 copy of the head weight.

Backward walks the layers down: each frees its activations and, when trainable, adds its weight gradients, with
about two MLP-width gradients alive at a time; the planner replays that walk and takes the largest total. The
figures agree with the CPU tensor tracker (benchmarks/common.LiveBytes) within a few percent
(tests/test_memory.py); CUDA adds the allocator's rounding and cuBLAS/flash-attention workspaces (tens of MB).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Collection, Sequence

from bcdflow.models.base import loss_chunk_rows
from bcdflow.models.build import model_plan, param_shapes
from bcdflow.models.families import decoder_class
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.plan import Plan
from bcdflow.models.stream import Schedule, SlotPlan, aligned, layer_bytes

GB = 1e9
PARTS = ("weights", "grads", "optim", "activations", "logits", "input", "temporaries")


@dataclass
class Estimate:
    """Predicted bytes of one training step: what is alive at its peak, by kind, and the peak itself."""
    name: str
    layers: tuple[int, int]
    trainable_params: int
    held_params: int
    weights: int = 0
    grads: int = 0
    optim: int = 0
    activations: int = 0
    logits: int = 0
    input: int = 0
    temporaries: int = 0
    peak: int = 0
    grads_total: int = 0
    """Every trainable gradient (``grads`` is what exists at the peak: in forward only the head's)."""
    recompute: bool = False
    streamed_layers: int = 0
    """Frozen layers kept in host memory and copied through ``window`` device slots (``train.offload``)."""
    streamed: tuple[int, ...] = ()
    frozen_layers: int = 0
    """Frozen layers the visit holds (resident = ``frozen_layers - streamed_layers``)."""
    layer_sizes: dict = field(default_factory=dict)
    """Frozen layer -> (its weights' bytes on the device, its flat buffer's bytes when streamed)."""
    host_bytes: int = 0
    """Pinned host memory the streamed layers' weights take."""
    copy_bytes: int = 0
    """Bytes copied host -> device per step, in the steady state of the stream's slot plan (models/stream.SlotPlan:
    a layer still in a slot from its last use is not copied again)."""
    phase: str = ""
    """Where the peak falls: ``forward`` (the forward's end: the loss chunk), ``backward layer i`` or ``optimizer``."""
    expand_params: int = 0
    """``bcd.expand``: the suffix adapters' parameters (fp32, with gradients and optimizer state)."""

    def parts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in PARTS}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Step:
    """One configuration of the step: model, batch, precision, optimizer, distribution."""
    cfg: ModelConfig
    batch: int
    seq: int
    precision: str = "fp32"
    optim: str = "adamw"
    weight_decay: float = 1e-5
    chunk_rows: int | None = None
    gpus: int = 1
    parallel: str = "single"  # single | ddp | fsdp
    shapes: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def tokens(self) -> int:
        """Tokens each process holds: data parallel and FSDP split the batch over the processes."""
        rows = self.batch if self.parallel == "single" else -(-self.batch // self.gpus)
        return rows * self.seq

    @property
    def s(self) -> int:
        return 2 if self.precision == "bf16" else 4


@functools.lru_cache(maxsize=None)  # the planner asks millions of times about a few thousand names
def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("h.") else None


def _numel(shape) -> int:
    return math.prod(shape)


def _layer_act(st: Step, kind: str) -> int:
    """Bytes per token a layer saves for backward: ``trainable``, ``frozen`` (on the gradient path; the family's
    counts, ``Decoder.saved_bytes``) or ``recompute`` (its fp32 input only)."""
    if kind == "recompute":
        return 4 * st.cfg.d_model
    return decoder_class(st.cfg.family).saved_bytes(st.cfg, st.s, kind)


def expand_bytes(st: Step, shapes: dict[str, tuple[int, ...]], layer: int, rank: int) -> tuple[int, int]:
    """``bcd.expand``'s cost on one adapted layer (models/expand.py): its adapter parameters (r × (in + out) per
    linear map) and the bytes per token its backward keeps for them: each adapted map's input (a frozen map keeps
    none; the ``A`` gradient needs it: the family's ``Decoder.adapter_input_bytes``) and its rank-r product (for
    ``B``'s)."""
    c = st.cfg
    mats = [v for k, v in shapes.items() if _layer_of(k) == layer and len(v) == 2]
    params = sum(rank * (o + i) for o, i in mats)
    inputs = decoder_class(c.family).adapter_input_bytes(c, st.s)
    return params, inputs + st.s * rank * len(mats)


def _layer_backward_temp(st: Step) -> int:
    """Bytes per token alive beyond the saved activations while a layer runs backward: the gradients of the MLP's
    hidden activations (two of them, width F, in the compute dtype) and of the residual stream."""
    c = st.cfg
    return 2 * st.s * c.ffn_dim + 4 * c.d_model


@functools.lru_cache(maxsize=8)
def _shape_cache(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(param_shapes(cfg).items())  # a meta-device model: the recommendation asks hundreds of times


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return dict(_shape_cache(cfg))


def stream_uses(streamed: Sequence[int], grad_from: int | None, window: int, train: bool = True
                ) -> list[tuple[int, bool, list[int]]]:
    """One steady-state step of the stream's slot plan (models/stream.py): each use of a streamed layer in order as
    (layer, in the backward, layers copied at that use), from the second of two simulated steps (the first fills
    the slots)."""
    sched, slots = Schedule(streamed, grad_from), SlotPlan(min(window, len(streamed)) or 1)
    seq = sched.seq(train)
    out = []
    for rnd in range(2):
        for p, i in enumerate(seq):
            copies = [u for u, _ in slots.use(seq, p, i)]
            if rnd:
                out.append((i, p >= len(sched.fwd), copies))
    return out


def stream_traffic(streamed: Sequence[int], grad_from: int | None, window: int, sizes: dict[int, int]
                   ) -> tuple[int, int]:
    """Bytes copied host -> device in one steady-state training step: (forward, backward)."""
    fwd = bwd = 0
    for _, backward, copies in stream_uses(streamed, grad_from, window):
        b = sum(sizes[u] for u in copies)
        fwd, bwd = (fwd, bwd + b) if backward else (fwd + b, bwd)
    return fwd, bwd


def visit_memory(cfg: ModelConfig, plan: Plan | None, block: int | None, batch: int, seq: int,
                 precision: str = "fp32", optim: str = "adamw", recompute: bool = False, preinfer: bool = True,
                 chunk_rows: int | None = None, weight_decay: float = 1e-5, gpus: int = 1,
                 parallel: str = "single", shapes: dict | None = None, stream: bool = False,
                 window: int = 2, freeze: Sequence[str] = (), recompute_active: bool = False,
                 streamed: Collection[int] | None = None, expand_rank: int = 0) -> Estimate:
    """Peak bytes of one step of block ``block``'s visit (``plan`` and ``block`` None: full training, every
    parameter trainable, the whole model held, fp32 master weights throughout).

    ``preinfer``: a visit to block b > 0 reads the prefix's stored hidden states (fp32, ``(B, T, C)``) and holds
    layers >= b; off, it holds the whole model and runs the prefix under no_grad. ``parallel``: ``ddp`` splits the
    batch over ``gpus`` processes (each holds every weight, gradient and moment of the visit); ``fsdp`` also
    shards weights, gradients and moments, and gathers one layer's weights at a time (two with prefetch).
    ``stream``: the frozen layers held stay in host memory and the device holds ``window`` slot buffers for them
    (models/stream.py); ``streamed``: only these frozen layers do (partial residency: the rest stay on the device).
    ``freeze``: parameters no visit trains (``bcd.freeze``). ``recompute_active`` (``bcd.recompute=all``): the
    active block's layers keep only their input too, and run their forward again one at a time in backward.
    ``expand_rank`` (``bcd.expand``): low-rank adapters of that rank on every linear map of the layers after the
    block, with their gradients, optimizer state and what their backward keeps (:func:`expand_bytes`)."""
    st = Step(cfg, batch, seq, precision, optim, weight_decay, chunk_rows, gpus, parallel)
    shapes = shapes or _shapes(cfg)
    n = cfg.n_layer
    full = block is None
    if full:
        lo, hi, trainable = 0, n, set(shapes)
    else:
        lo, hi = plan[block].layers
        trainable = plan[block].trainable(freeze, cfg.tied)
    from_acts = not full and plan[block].reads_activations(preinfer)
    held_lo = lo if from_acts else 0

    def held(name: str) -> bool:
        i = _layer_of(name)
        if i is not None:
            return i >= held_lo
        if name.startswith("wpe."):
            return not from_acts
        if name.startswith("wte."):
            return not from_acts or cfg.tied
        return True  # the head

    held_names = [k for k in shapes if held(k)]
    low = precision == "bf16" and not full

    def wbytes(name: str) -> int:
        size = 2 if low and name not in trainable and len(shapes[name]) >= 2 else 4
        return _numel(shapes[name]) * size

    train_numel = sum(_numel(shapes[k]) for k in trainable)
    shard = gpus if parallel == "fsdp" else 1
    weights = sum(wbytes(k) for k in held_names)
    layer_train_names = {_layer_of(k) for k in trainable if _layer_of(k) is not None}
    frozen_held = [i for i in range(held_lo, n) if i not in layer_train_names] if not full else []
    if streamed is None:
        streamed = frozen_held if stream else []
    elif not set(streamed) <= set(frozen_held):
        raise ValueError(f"streamed layers {sorted(set(streamed) - set(frozen_held))} are not frozen layers held")
    streamed = sorted(streamed)
    held_by_layer: dict[int | None, list[str]] = {}
    for k in held_names:
        held_by_layer.setdefault(_layer_of(k), []).append(k)
    sizes = {i: (sum(wbytes(k) for k in held_by_layer.get(i, ())),  # (bytes, flat bytes as the stream allocates)
                 layer_bytes(wbytes(k) for k in held_by_layer.get(i, ()))) for i in frozen_held}
    flat = {i: sizes[i][1] for i in streamed}
    host_bytes = sum(flat.values())
    copy_bytes = sum(stream_traffic(streamed, lo, window, flat))
    if streamed:  # the streamed layers' weights leave the device; ``window`` slots of the largest take their place
        weights += min(window, len(streamed)) * max(flat.values()) - sum(sizes[i][0] for i in streamed)
    if parallel == "fsdp":  # sharded, plus the largest layer gathered twice (current and prefetched)
        largest = max((sum(wbytes(k) for k in held_by_layer.get(i, ())) for i in range(held_lo, n)), default=0)
        weights = weights // shard + 2 * largest
    grads = 4 * train_numel // shard
    moments = OPTIMIZERS[optim].state
    opt = 4 * moments * train_numel // shard
    # bcd.expand: per adapted layer (after the block) its adapter parameters and saved bytes per token
    adapted = {i: expand_bytes(st, shapes, i, expand_rank) for i in range(hi, n)} if expand_rank and not full else {}
    expand_params = sum(p for p, _ in adapted.values())
    weights += 4 * expand_params
    opt += 4 * moments * expand_params
    grads += 4 * expand_params
    N = st.tokens
    C, V, s = cfg.d_model, cfg.vocab_size, st.s
    inp = N * (4 * C + 8) if from_acts else N * 16  # fp32 hidden states + long targets, or long ids + targets
    weights += decoder_class(cfg.family).buffer_bytes(cfg)  # derived tables (RoPE's)

    # -- the forward's end: saved activations per layer on the gradient path, bottom to top
    acts: list[tuple[int, int, int]] = []  # (layer, saved bytes, weight-grad bytes added when it runs backward)
    layer_train = dict.fromkeys(range(n), 0)
    for k in trainable:
        if (i := _layer_of(k)) is not None:
            layer_train[i] += _numel(shapes[k])
    cast = 0  # bf16 autocast copies of trainable matrices, kept for backward
    for i in range(lo, n):
        kind = "trainable" if layer_train[i] else ("recompute" if recompute and i >= hi else "frozen")
        if layer_train[i] and recompute_active:
            kind = "recompute"
        a = N * _layer_act(st, kind)
        if precision == "bf16" and kind == "trainable":
            mats = sum(_numel(shapes[k]) for k in trainable if _layer_of(k) == i and len(shapes[k]) >= 2)
            a += 2 * mats // shard
            cast += 2 * mats // shard
        if i in adapted:  # its gradients come in its backward; a recomputed layer makes its saved part again there
            p, tok = adapted[i]
            a += 0 if kind == "recompute" else N * tok + 2 * p * (precision == "bf16")  # + bf16 casts of A, B
        acts.append((i, a, 4 * (layer_train[i] + (adapted[i][0] if i in adapted else 0)) // shard))
    head_name = "wte.weight" if cfg.tied else "lm_head.weight"
    head_trainable = head_name in trainable
    head_numel = V * C
    rows = min(N, loss_chunk_rows(V, chunk_rows))
    ln_f = N * (4 * C + 8)  # ln_f keeps its input and statistics
    grad_h = N * 4 * C  # the head's input gradient, computed in forward
    grad_w = 4 * head_numel // shard if head_trainable else 0  # part of ``grads``: alive from the loss forward on
    w_copy = 2 * head_numel if head_trainable and precision == "bf16" else 0
    chunk = rows * V * (6 if precision == "bf16" else 4) + rows * C * (2 if precision == "bf16" else 0)
    if head_trainable:
        chunk += head_numel * s  # one chunk's weight-gradient partial before it is added
    other_grads = grads - grad_w  # the rest of the trainable gradients, made in backward
    persistent = weights + opt + inp
    saved = sum(a for _, a, _ in acts)

    parts = {}
    best = -1

    def at(phase: str, activ: int, logits: int, grads_now: int, temp: int) -> None:
        nonlocal best
        total = persistent + activ + logits + grads_now + temp
        if total > best:
            best = total
            parts.update(phase=phase, activations=activ, logits=logits, grads=grads_now, temporaries=temp)

    at("forward", saved + ln_f, grad_h + chunk + w_copy, grad_w, 0)
    running_act, running_grads = saved + ln_f, grad_w
    back_t = N * _layer_backward_temp(st)
    at("backward head", running_act, grad_h, running_grads, 2 * N * 4 * C)
    running_act -= ln_f
    for i, a, g in reversed(acts):
        redo = N * _layer_act(st, "frozen") if recompute and not layer_train[i] and i >= hi else 0
        if redo and i in adapted:
            redo += N * adapted[i][1] + 2 * adapted[i][0] * (precision == "bf16")
        if recompute_active and layer_train[i]:  # the layer's own activations, back for its backward
            redo = N * _layer_act(st, "trainable")
        at(f"backward layer {i}", running_act, 0, running_grads, back_t + redo)
        running_act -= a
        running_grads += g
    if not from_acts and full or (not full and lo == 0):
        emb = head_numel * 4 if cfg.tied and "wte.weight" in trainable else 0  # dense wte grad, then added
        at("backward embeddings", 0, 0, running_grads, emb + N * 4 * C)
    running_grads = max(running_grads, other_grads + grad_w)
    opt_temp = running_grads if OPTIMIZERS[optim].decay_temporary and weight_decay > 0 else 0
    at("optimizer", 0, 0, running_grads, opt_temp)
    return Estimate(name="full" if full else f"block {block}", layers=(held_lo, n), trainable_params=train_numel,
                    held_params=sum(_numel(shapes[k]) for k in held_names), weights=weights, optim=opt, input=inp,
                    peak=best, grads_total=grads, recompute=recompute and not full and hi < n,
                    streamed_layers=len(streamed), host_bytes=host_bytes, copy_bytes=copy_bytes,
                    streamed=tuple(streamed), frozen_layers=len(frozen_held), layer_sizes=sizes,
                    expand_params=expand_params,
                    **{k: parts[k] for k in ("activations", "logits", "grads", "temporaries", "phase")})


def plan_visits(cfg: ModelConfig, blocks: int, batch: int, seq: int, precision: str = "fp32", optim: str = "adamw",
                recompute: bool = False, split: str = "params", preinfer: bool = True, **kw) -> list[Estimate]:
    """The estimate of every block's visit under the ``bcd.blocks=blocks`` plan (``stream``, ``window``: see
    :func:`visit_memory`)."""
    plan = model_plan(cfg, blocks, split=split, freeze=kw.get("freeze", ()))
    shapes = _shapes(cfg)
    return [visit_memory(cfg, plan, b, batch, seq, precision, optim, recompute, preinfer, shapes=shapes, **kw)
            for b in range(len(plan))]


# -- the device budget ------------------------------------------------------------------------------------------
def load_bytes(cfg: ModelConfig, plan: Plan, block: int, preinfer: bool = True, stored_bytes: int = 4) -> int:
    """Host bytes loading block ``block``'s visit part takes beside its streamed buffers: the largest block file it
    reads (``RunContext.load_part`` reads one block file at a time and copies each tensor where it lives), at
    ``stored_bytes`` a parameter (4: a trained version's fp32 files; version 0 keeps a checkpoint's own dtype), and
    one tensor's conversion (a copy to CUDA that changes the dtype converts on the host into a temporary of the
    destination's size: the largest tensor at 4 bytes)."""
    lo = plan[block].layers[0] if plan[block].reads_activations(preinfer) else 0
    owners = {b for b in range(len(plan)) if b >= block or not lo}
    if lo and cfg.tied:
        owners.add(plan.owner("wte.weight"))  # the tied head reads block 0's embedding
    return reading_bytes(cfg, plan, owners, stored_bytes)


def reading_bytes(cfg: ModelConfig, plan: Plan, blocks: Collection[int], stored_bytes: int = 4) -> int:
    """Host bytes reading ``blocks`` one file at a time takes at its peak: the largest file and the largest tensor's
    conversion (4 bytes a parameter); 0 for none."""
    names = {n for b in blocks for n in plan[b].params}
    largest = max((_numel(s) for n, s in _shapes(cfg).items() if n in names), default=0)
    return file_bytes(cfg, plan, blocks, stored_bytes) + 4 * largest


def file_bytes(cfg: ModelConfig, plan: Plan, blocks: Collection[int], stored_bytes: int = 4) -> int:
    """The largest block file of ``blocks`` (0 for none), at ``stored_bytes`` a parameter, with its safetensors
    header (under 256 bytes a tensor: name, dtype, shape, offsets)."""
    sizes = {n: _numel(s) for n, s in _shapes(cfg).items()}
    return max((sum(sizes[n] * stored_bytes + 256 for n in plan[b].params) for b in blocks), default=0)


def stage_bytes(batch: int, seq: int, d_model: int, from_acts: bool, slots: int = 2) -> int:
    """Page-locked host bytes of a training loop's batch slots on CUDA (models/stream.BatchStage, two by default):
    each holds a batch's inputs (the prefix's fp32 states, or int64 token ids) and int64 targets, each aligned."""
    inputs = batch * seq * (4 * d_model if from_acts else 8)
    return slots * (aligned(inputs) + aligned(batch * seq * 8))


CONTEXT_BYTES = int(0.5 * GB)
"""What the CUDA context takes before the first tensor (0.3-0.6 GB with recent drivers and lazy module loading):
counted when the budget starts from a card's size; a measured budget starts from what is free once it exists."""
WORKSPACE_BYTES = int(0.5 * GB)
"""What the planner does not see that is not fragmentation: kernel modules loaded lazily after the context exists
(cuBLAS, cuBLASLt, attention: a few hundred MB), cuBLAS/cuBLASLt workspaces per stream and thread (the compute stream,
autograd's backward thread, each pre-inference worker: up to 32 MiB each on Hopper, 4-8 MiB on Ada), attention
scratch and the caching allocator's small-block pools."""
FRAGMENTATION = 0.08
"""Share of the free memory kept back for the caching allocator's block rounding and fragmentation (5-15% is typical
of training; the streamed weights' slots are allocated once and do not fragment)."""
NCCL_BYTES = int(0.5 * GB)
"""NCCL's buffers and communicator per process, with several processes on one visit."""


@dataclass(frozen=True)
class Budget:
    """What a visit may hold on one device: the memory free once the CUDA context exists, less a reserve for what
    the planner does not model (workspaces, fragmentation, NCCL)."""
    card: int
    """The device's memory (``train.memory_gb`` or the CUDA device's total)."""
    free: int
    """Free once the context exists: measured on the device, or ``card - CONTEXT_BYTES``."""
    reserve: int

    @property
    def usable(self) -> int:
        return self.free - self.reserve

    def line(self) -> str:
        return (f"{self.usable / GB:.1f} GB usable of {self.card / GB:g} GB ({(self.card - self.free) / GB:.1f} GB "
                f"CUDA context, {self.reserve / GB:.1f} GB reserve: workspaces and {FRAGMENTATION:.0%} for "
                "fragmentation)")


def device_budget(card: float, free: float | None = None, gpus: int = 1) -> Budget:
    """The budget of a card of ``card`` bytes (``free``: measured after the context exists)."""
    free = card - CONTEXT_BYTES if free is None else free
    reserve = WORKSPACE_BYTES + FRAGMENTATION * free + (NCCL_BYTES if gpus > 1 else 0)
    return Budget(int(card), int(free), int(reserve))


# -- no-grad passes: pre-inference and evaluation ----------------------------------------------------------------
NO_BUDGET_TOKENS = 16384
"""Tokens per no-grad forward where no device budget bounds it (the CPU)."""


def _infer_token_bytes(cfg: ModelConfig, s: int) -> int:
    """Bytes per token alive at the peak of one layer's no-grad forward (the family's ``Decoder.infer_bytes``)."""
    return decoder_class(cfg.family).infer_bytes(cfg, s)


def no_grad_memory(cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool, rows: int, seq: int,
                   precision: str = "fp32", streamed: Collection[int] = (), window: int = 2,
                   chunk_rows: int | None = None, shapes: dict | None = None) -> Estimate:
    """Peak bytes of a no-grad forward of a model part (``RunContext.load_part`` with every weight frozen: the
    pre-inference prefix ``(0, lo)`` with ``embed``, an evaluation model with ``head``) over ``rows`` rows; its
    ``streamed`` layers in ``window`` slots. Nothing is saved for a backward, so the peak is the weights, the
    input and one layer's (or the loss chunk's) temporaries."""
    shapes = shapes or _shapes(cfg)
    lo, hi = layers
    s = 2 if precision == "bf16" else 4

    def part(name: str) -> bool:
        i = _layer_of(name)
        if i is not None:
            return lo <= i < hi
        if name.startswith(("wte.", "wpe.")):
            return embed or (name.startswith("wte.") and head and cfg.tied)
        return head

    def wbytes(name: str) -> int:
        return _numel(shapes[name]) * (2 if precision == "bf16" and len(shapes[name]) >= 2 else 4)

    names = [k for k in shapes if part(k)]
    by_layer: dict[int, list[str]] = {}
    for k in names:
        if (i := _layer_of(k)) is not None:
            by_layer.setdefault(i, []).append(k)
    streamed = sorted(streamed)
    flat = {i: layer_bytes(wbytes(k) for k in by_layer.get(i, ())) for i in streamed}
    weights = sum(wbytes(k) for k in names)
    if streamed:
        weights += min(window, len(streamed)) * max(flat.values()) - sum(wbytes(k) for i in streamed
                                                                           for k in by_layer.get(i, ()))
    weights += decoder_class(cfg.family).buffer_bytes(cfg)  # derived tables (RoPE's)
    N, C, V = rows * seq, cfg.d_model, cfg.vocab_size
    inp = N * 16 if embed else N * (4 * C + 8)
    layer = N * _infer_token_bytes(cfg, s) if hi > lo else 0
    chunk = 0
    if head:  # the loss over the vocabulary, a chunk of rows at a time (no input gradient without a backward)
        r = min(N, loss_chunk_rows(V, chunk_rows))
        chunk = N * 4 * C + r * V * (6 if precision == "bf16" else 4)
    act = max(layer, chunk)
    return Estimate(name=f"no-grad {lo}-{hi}", layers=layers, trainable_params=0,
                    held_params=sum(_numel(shapes[k]) for k in names), weights=weights, input=inp, activations=act,
                    peak=weights + inp + act, streamed_layers=len(streamed), streamed=tuple(streamed),
                    host_bytes=sum(flat.values()), frozen_layers=hi - lo, phase="forward")


def no_grad_rows(cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool, seq: int, precision: str,
                 room: float | None, limit: int, streamed: Collection[int] = (), window: int = 2,
                 chunk_rows: int | None = None) -> int:
    """Rows per no-grad forward: the most, up to ``limit``, whose peak (:func:`no_grad_memory`) fits ``room`` bytes;
    without a budget (the CPU) :data:`NO_BUDGET_TOKENS` tokens; at least one row."""
    if room is None:
        return max(1, min(limit, NO_BUDGET_TOKENS // seq))

    def peak(r: int) -> int:
        return no_grad_memory(cfg, layers, embed, head, r, seq, precision, streamed, window, chunk_rows).peak

    lo_r, hi_r = 1, max(1, limit)
    if peak(hi_r) <= room:
        return hi_r
    while lo_r < hi_r:  # the peak grows with the rows: the largest that fits
        mid = (lo_r + hi_r + 1) // 2
        lo_r, hi_r = (mid, hi_r) if peak(mid) <= room else (lo_r, mid - 1)
    return lo_r
