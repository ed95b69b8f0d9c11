"""The memory planner: the peak device memory of one training step of each block's visit, and of full training,
from the model config alone (parameter shapes from a meta-device model: no weights, no device).

    shape = StepShape(batch=4, seq=1024, precision="bf16")   # models/specs.py; a run's: RunConfig.step_shape()
    est = visit_memory(cfg, plan, 0, shape)                   # one visit's step
    est = visit_memory(cfg, None, None, shape)                # full-parameter training
    est.peak, est.parts()    # bytes: weights, grads, optim, activations, logits, input, temporaries
    rec = recommend(cfg, shape, device_budget(24 * GB))       # models/holding.py: smallest bcd.blocks that fits

Every public function takes the model config, the plan and block where it plans a visit, the step's shape
(``StepShape``: batch, sequence, precision, recompute, streamed layers, ...) and a budget where it fits one.

What a step holds (the product's path: tasks/train.py -> models/visit_compute.visit_loss -> models/trainer.run_steps):

- weights: held parameters only (a visit with pre-inference holds layers >= its block and the head; docs/DESIGN.md I6).
  Trainable ones in fp32; frozen matrices in bf16 with ``precision=bf16`` (models/build.frozen_in), else fp32.
- grads and optimizer state: the trainable parameters only, fp32; AdamW two moments, SGD one momentum buffer
  (plus one gradient-sized temporary: foreach SGD with weight decay adds ``wd * p`` out of place). The lighter
  states (models/optimizers.py, issue 33): ``adamw8bit``'s moments at a byte an element and an fp32 scale per 256;
  ``adamw8bit-bf16`` also keeps the trained matrices and their gradients in bf16 (no autocast copy of them), its
  update a chunk's fp32 copies (``LIGHT_CHUNK``): 6 bytes a trained parameter where fp32 AdamW takes 16.
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

import math
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Collection, Sequence

from bcdflow.models.base import loss_chunk_rows
from bcdflow.models.build import model_plan, param_shapes
from bcdflow.models.families import decoder_class
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.optimizers import LIGHT_CHUNK, OPTIMIZERS
from bcdflow.models.plan import LayerVisit, Plan, layer_of  # noqa: F401 (re-exported)
from bcdflow.models.specs import StepShape
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


_numel = math.prod


def layer_saved_bytes(cfg: ModelConfig, shape: StepShape, kind: str) -> int:
    """Bytes per token a layer saves for backward: ``trainable``, ``frozen`` (on the gradient path; the family's
    counts, ``Decoder.saved_bytes``) or ``recompute`` (its fp32 input only)."""
    if kind == "recompute":
        return 4 * cfg.d_model
    return decoder_class(cfg.family).saved_bytes(cfg, shape.dtype_bytes, kind)


def expand_bytes(cfg: ModelConfig, shape: StepShape, layer: int) -> tuple[int, int]:
    """``bcd.expand``'s cost on one adapted layer (models/expand.py) at rank ``shape.expand_rank``: its adapter
    parameters (r × (in + out) per linear map) and the bytes per token its backward keeps for them: each adapted
    map's input (a frozen map keeps none; the ``A`` gradient needs it: the family's ``Decoder.adapter_input_bytes``)
    and its rank-r product (for ``B``'s)."""
    rank, s = shape.expand_rank, shape.dtype_bytes
    mats = [v for k, v in model_shapes(cfg).items() if layer_of(k) == layer and len(v) == 2]
    params = sum(rank * (o + i) for o, i in mats)
    inputs = decoder_class(cfg.family).adapter_input_bytes(cfg, s)
    return params, inputs + s * rank * len(mats)


def _layer_backward_temp(cfg: ModelConfig, shape: StepShape) -> int:
    """Bytes per token alive beyond the saved activations while a layer runs backward: the gradients of the MLP's
    hidden activations (two of them, width F, in the compute dtype) and of the residual stream."""
    return 2 * shape.dtype_bytes * cfg.ffn_dim + 4 * cfg.d_model


model_shapes = param_shapes
"""Parameter name -> shape, read-only, built once per config (``models/build.param_shapes``)."""


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


def visit_memory(cfg: ModelConfig, plan: Plan | None, block: int | None, shape: StepShape) -> Estimate:
    """Peak bytes of one step of block ``block``'s visit (``plan`` and ``block`` None: full training, every
    parameter trainable, the whole model held, fp32 master weights throughout, nothing recomputed unless
    ``recompute=all``: activation checkpointing, every layer's forward again in backward).

    Of the ``shape``: ``preinfer``: a visit to block b > 0 reads the prefix's stored hidden states (fp32,
    ``(B, T, C)``) and holds layers >= b; off, it holds the whole model and runs the prefix under no_grad.
    ``recompute``: ``on`` (``auto`` counts as off: the holding decides, models/holding.py) keeps only the input of
    each frozen layer after the block, ``all`` of the active block's layers too, which run their forward again one
    at a time in backward. ``parallel``: ``ddp`` splits the batch over ``gpus`` processes (each holds every weight,
    gradient and moment of the visit); ``fsdp`` also shards weights, gradients and moments, and gathers one layer's
    weights at a time (two with prefetch). ``streamed``: these frozen layers stay in host memory and the device
    holds ``window`` slot buffers for them (models/stream.py; None: every frozen layer held with
    ``offload=stream``, else none); the rest stay on the device. ``freeze``: parameters no visit trains
    (``bcd.freeze``). ``expand_rank`` (``bcd.expand``): low-rank adapters of that rank on every linear map of the
    layers after the block, with their gradients, optimizer state and what their backward keeps
    (:func:`expand_bytes`)."""
    v = _visit_figures(cfg, plan, block, shape)
    w = _held_weights(cfg, shape, v)
    acts, move_grad, adapted = _saved_activations(cfg, plan, block, shape, v, w)
    t = _loss_terms(cfg, shape, v, w, move_grad)
    best, parts = _peak(cfg, shape, v, w, acts, adapted, move_grad, t)
    return Estimate(name="full" if v.full else f"block {block}", layers=(v.held_lo, v.n),
                    trainable_params=v.train_numel, held_params=sum(_numel(v.shapes[k]) for k in w.held_names),
                    weights=w.weights, optim=w.opt, input=w.inp, peak=best, grads_total=w.grads,
                    recompute=v.recompute and not v.full and v.hi < v.n, streamed_layers=len(w.streamed),
                    host_bytes=w.host_bytes, copy_bytes=w.copy_bytes, streamed=tuple(w.streamed),
                    frozen_layers=len(w.frozen_held), layer_sizes=w.sizes, expand_params=w.expand_params,
                    **{k: parts[k] for k in ("activations", "logits", "grads", "temporaries", "phase")})


def _visit_figures(cfg: ModelConfig, plan: Plan | None, block: int | None, shape: StepShape) -> types.SimpleNamespace:
    """What visit ``block`` trains and holds, as :func:`visit_memory`'s parts read it: its layers, the parameters it
    trains (each at the shape its kind trains: a row visit's slice, models/rows.py) and the dtypes."""
    shapes, n, full = model_shapes(cfg), cfg.n_layer, block is None
    target = None if full else plan.visits[block]
    kind = LayerVisit() if full else target.mechanism
    lo, hi = (0, n) if full else target.layers
    trainable = set(shapes) if full else target.trainable(shape.freeze, cfg.tied)
    trained = {k: (shapes[k] if full else kind.trained_shape(target, k, shapes[k])) for k in trainable}
    from_acts = not full and target.reads_activations(shape.preinfer)
    return types.SimpleNamespace(
        shapes=shapes, n=n, full=full, target=target, kind=kind, lo=lo, hi=hi, trainable=trainable, trained=trained,
        train_numel=sum(_numel(s) for s in trained.values()), from_acts=from_acts, held_lo=lo if from_acts else 0,
        opt=OPTIMIZERS[shape.optim], low=shape.precision == "bf16" and not full,
        recompute=shape.recompute in ("on", "all") and not full, recompute_active=shape.recompute == "all",
        shard=shape.gpus if shape.parallel == "fsdp" else 1, N=shape.tokens)


def _held_weights(cfg: ModelConfig, shape: StepShape, v) -> types.SimpleNamespace:
    """The visit's persistent bytes: the weights it holds (streamed layers in ``window`` slots, FSDP's shards), the
    trained gradients and optimizer state, ``bcd.expand``'s adapters and the step's input."""
    shapes, opt_of = v.shapes, v.opt

    def held(name: str) -> bool:
        i = layer_of(name)
        if i is not None:
            return i >= v.held_lo
        if name.startswith("wpe."):
            return not v.from_acts
        if name.startswith("wte."):
            return not v.from_acts or cfg.tied
        return True  # the head

    def wbytes(name: str) -> int:
        frozen = _numel(shapes[name]) * (2 if v.low and len(shapes[name]) >= 2 else 4)
        if name not in v.trainable:
            return frozen
        if v.trained[name] != tuple(shapes[name]):  # a trained part: the matrix held frozen, the part's master
            return frozen + opt_of.param_bytes(v.trained[name])
        return opt_of.param_bytes(shapes[name])  # fp32 master weights, or bf16 (adamw8bit-bf16)

    held_names = [k for k in shapes if held(k)]
    weights = sum(wbytes(k) for k in held_names)
    layer_train_names = {layer_of(k) for k in v.trainable if layer_of(k) is not None}
    frozen_held = [i for i in range(v.held_lo, v.n) if i not in layer_train_names] if not v.full else []
    streamed = shape.streamed
    if streamed is None:
        streamed = frozen_held if shape.offload == "stream" else []
    elif not set(streamed) <= set(frozen_held):
        raise ValueError(f"streamed layers {sorted(set(streamed) - set(frozen_held))} are not frozen layers held")
    streamed = sorted(streamed)
    by_layer: dict[int | None, list[str]] = {}
    for k in held_names:
        by_layer.setdefault(layer_of(k), []).append(k)
    sizes = {i: (sum(wbytes(k) for k in by_layer.get(i, ())),  # (bytes, flat bytes as the stream allocates)
                 layer_bytes(wbytes(k) for k in by_layer.get(i, ()))) for i in frozen_held}
    flat = {i: sizes[i][1] for i in streamed}
    if streamed:  # the streamed layers' weights leave the device; ``window`` slots of the largest take their place
        weights += min(shape.window, len(streamed)) * max(flat.values()) - sum(sizes[i][0] for i in streamed)
    if shape.parallel == "fsdp":  # sharded, plus the largest layer gathered twice (current and prefetched)
        largest = max((sum(wbytes(k) for k in by_layer.get(i, ())) for i in range(v.held_lo, v.n)), default=0)
        weights = weights // v.shard + 2 * largest
    grads = sum(opt_of.param_bytes(s) for s in v.trained.values()) // v.shard  # a gradient: as many as its weight
    opt = sum(opt_of.state_bytes(_numel(s)) for s in v.trained.values()) // v.shard
    # bcd.expand: per adapted layer (after the block) its adapter parameters and saved bytes per token
    expanding = shape.expand_rank and not v.full and v.kind.expands
    adapted = {i: expand_bytes(cfg, shape, i) for i in range(v.hi, v.n)} if expanding else {}
    expand_params = sum(p for p, _ in adapted.values())
    weights += 4 * expand_params + decoder_class(cfg.family).buffer_bytes(cfg)  # + derived tables (RoPE's)
    opt += opt_of.state_bytes(expand_params) if expand_params else 0
    grads += 4 * expand_params
    C = cfg.d_model
    inp = v.N * (4 * C + 8) if v.from_acts else v.N * 16  # fp32 hidden states + long targets, or ids + targets
    return types.SimpleNamespace(
        wbytes=wbytes, held_names=held_names, weights=weights, grads=grads, opt=opt, inp=inp, adapted=adapted,
        expand_params=expand_params, frozen_held=frozen_held, streamed=streamed, sizes=sizes,
        host_bytes=sum(flat.values()), copy_bytes=sum(stream_traffic(streamed, v.lo, shape.window, flat)))


def _saved_activations(cfg: ModelConfig, plan: Plan | None, block: int | None, shape: StepShape, v, w):
    """The forward's end: per layer on the gradient path, bottom to top, (layer, bytes it saved, weight-gradient
    bytes its backward adds); what ``bcd.expand=sign``'s moving weights take at once, by layer; the adapted
    layers."""
    shapes, opt_of, N, adapted = v.shapes, v.opt, v.N, w.adapted
    layer_train = dict.fromkeys(range(v.n), 0)
    layer_grad = dict.fromkeys(range(v.n), 0)
    for k in v.trainable:
        if (i := layer_of(k)) is not None:
            layer_train[i] += _numel(shapes[k])
            layer_grad[i] += opt_of.param_bytes(shapes[k])
    # bcd.expand=sign: the suffix's weights get gradients (each made in its layer's backward, dropped in its hook, at
    # the dtype the visit holds it), so a suffix layer keeps its linear maps' inputs as a trained one does
    moving = plan.suffix(block, shape.freeze, cfg.tied) if shape.suffix == "sign" and not v.full else set()
    move_grad: dict[int | None, int] = {}  # by layer (None: the head and final norm), the most one weight's gradient
    for k in moving:  # and its update take at once: a chunk's sign (fp32), or its fp32 copy, sign and noise (bf16)
        bf16 = w.wbytes(k) < 4 * _numel(shapes[k])
        need = w.wbytes(k) + min(LIGHT_CHUNK, _numel(shapes[k])) * (12 if bf16 else 4)
        move_grad[layer_of(k)] = max(move_grad.get(layer_of(k), 0), need)
    acts: list[tuple[int, int, int]] = []
    for i in range(v.lo, v.n):
        kind = "trainable" if layer_train[i] or i in move_grad and not v.recompute else (
            "recompute" if v.recompute and i >= v.hi else "frozen")
        if layer_train[i] and v.recompute_active:
            kind = "recompute"
        a = N * layer_saved_bytes(cfg, shape, kind)
        if shape.precision == "bf16" and kind == "trainable" and opt_of.master == 4:  # a bf16 master is not cast
            mats = sum(_numel(shapes[k]) for k in v.trainable if layer_of(k) == i and len(shapes[k]) >= 2)
            a += 2 * mats // v.shard  # bf16 autocast copies of trainable matrices, kept for backward
        if i in adapted:  # its gradients come in its backward; a recomputed layer makes its saved part again there
            p, tok = adapted[i]
            a += 0 if kind == "recompute" else N * tok + 2 * p * (shape.precision == "bf16")  # + bf16 casts of A, B
        acts.append((i, a, (layer_grad[i] + 4 * (adapted[i][0] if i in adapted else 0)) // v.shard))
    v.layer_train, v.moving = layer_train, moving
    return acts, move_grad, adapted


def _loss_terms(cfg: ModelConfig, shape: StepShape, v, w, move_grad: dict) -> dict:
    """The gradient terms of the loss, the embedding's backward and the optimizer, as a visit of its kind makes
    them (``LayerVisit.memory_terms``): the head's weight gradient from forward on (``grad_w``) and its bf16 copy
    (``w_copy``), a loss chunk's weight-gradient partial (``partial``, elements), the other gradients (made in
    backward), what the head's backward adds, the running gradients after it and the optimizer's (None: as they
    run), the embedding's backward."""
    C, V, opt_of, grads = cfg.d_model, cfg.vocab_size, v.opt, w.grads
    head_name = "wte.weight" if cfg.tied else "lm_head.weight"
    head_trainable, head_numel = head_name in v.trainable, V * C
    grad_w = opt_of.master * head_numel // v.shard if head_trainable else 0  # part of ``grads``: from the loss on
    w_copy = 2 * head_numel if head_trainable and shape.precision == "bf16" and opt_of.master == 4 else 0
    if head_name in v.moving:  # the loss makes the moving head's gradient from forward on, dropped in its backward
        w_copy += w.wbytes(head_name)
    terms = dict(grad_w=grad_w, w_copy=w_copy, partial=head_numel if head_trainable or head_name in v.moving else 0,
                 other_grads=grads - grad_w, head_back=0, after_head=None, final=None,
                 emb=head_numel * opt_of.master if cfg.tied and "wte.weight" in v.trainable else 0)  # dense wte grad
    if v.full:
        return terms
    fig = types.SimpleNamespace(grads=grads, trained=head_trainable, train_numel=v.train_numel, N=v.N, C=C)
    return v.kind.memory_terms(v.target, terms, fig)


def _peak(cfg: ModelConfig, shape: StepShape, v, w, acts, adapted, move_grad, t) -> tuple[int, dict]:
    """The step's peak bytes and its parts: the forward's end, the head's backward, each layer's backward, the
    embedding's and the optimizer's, each with what is alive then."""
    C, V, N, s = cfg.d_model, cfg.vocab_size, v.N, shape.dtype_bytes
    bf16 = shape.precision == "bf16"
    rows = min(N, loss_chunk_rows(V, shape.chunk_rows))
    ln_f = N * (4 * C + 8)  # ln_f keeps its input and statistics
    grad_h = N * 4 * C  # the head's input gradient, computed in forward
    chunk = rows * V * (6 if bf16 else 4) + rows * C * (2 if bf16 else 0) + t["partial"] * s
    persistent = w.weights + w.opt + w.inp
    parts, best = {}, -1

    def at(phase: str, activ: int, logits: int, grads_now: int, temp: int) -> None:
        nonlocal best
        total = persistent + activ + logits + grads_now + temp
        if total > best:
            best = total
            parts.update(phase=phase, activations=activ, logits=logits, grads=grads_now, temporaries=temp)

    saved = sum(a for _, a, _ in acts)
    at("forward", saved + ln_f, grad_h + chunk + t["w_copy"], t["grad_w"], 0)
    running_act, running_grads = saved + ln_f, t["grad_w"]
    at("backward head", running_act, grad_h, running_grads, 2 * N * 4 * C + t["head_back"] + move_grad.get(None, 0))
    if t["after_head"] is not None:
        running_grads = t["after_head"]
    running_act -= ln_f
    back_t = N * _layer_backward_temp(cfg, shape)
    for i, a, g in reversed(acts):
        trains = v.layer_train[i]
        redo = N * layer_saved_bytes(cfg, shape, "frozen") if v.recompute and not trains and i >= v.hi else 0
        if redo and i in adapted:
            redo += N * adapted[i][1] + 2 * adapted[i][0] * bf16
        if v.recompute_active and trains:  # the layer's own activations, back for its backward
            redo = N * layer_saved_bytes(cfg, shape, "trainable")
        at(f"backward layer {i}", running_act, 0, running_grads, back_t + redo + move_grad.get(i, 0))
        running_act -= a
        running_grads += g
    if not v.from_acts and v.full or (not v.full and v.lo == 0):
        at("backward embeddings", 0, 0, running_grads, t["emb"] + N * 4 * C)
    running_grads = t["final"] if t["final"] is not None else max(running_grads, t["other_grads"] + t["grad_w"])
    opt_temp = running_grads if v.opt.decay_temporary and shape.weight_decay > 0 else 0
    if v.opt.master == 2 and v.trainable:  # a bf16 weight's update: a chunk's fp32 weight, gradient and noise
        opt_temp = 3 * 4 * min(LIGHT_CHUNK, max(_numel(s_) for s_ in v.trained.values()))
    at("optimizer", 0, 0, running_grads, opt_temp)
    return best, parts


def plan_visits(cfg: ModelConfig, blocks: int, shape: StepShape, split: str = "params") -> list[Estimate]:
    """The estimate of every visit under the ``bcd.blocks=blocks`` plan (``bcd.split=split``)."""
    plan = model_plan(cfg, blocks, split=split, freeze=shape.freeze)
    return [visit_memory(cfg, plan, b, shape) for b in range(len(plan.visits))]


# -- the device budget ------------------------------------------------------------------------------------------
def load_bytes(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, stored_bytes: int = 4) -> int:
    """Host bytes loading block ``block``'s visit part takes beside its streamed buffers: the largest block file it
    reads (``RunContext.load_part`` reads one block file at a time and copies each tensor where it lives), at
    ``stored_bytes`` a parameter (4: a trained version's fp32 files; version 0 keeps a checkpoint's own dtype), and
    one tensor's conversion (a copy to CUDA that changes the dtype converts on the host into a temporary of the
    destination's size: the largest tensor at 4 bytes)."""
    v = plan.visits[block]
    lo = v.layers[0] if v.reads_activations(shape.preinfer) else 0
    stored = v.stored  # a row visit reads the stored blocks its part holds
    owners = {b for b in range(len(plan.blocks)) if b >= stored or not lo}
    if lo and cfg.tied:
        owners.add(plan.owner("wte.weight"))  # the tied head reads block 0's embedding
    return reading_bytes(cfg, plan, owners, stored_bytes)


def host_phases(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape, est: Estimate) -> dict[str, int]:
    """Host bytes block ``block``'s visit takes beside its pinned buffers (streamed layers, batch slots), by the
    phase it takes them in; its host peak is the pinned bytes plus the largest:

    - ``load``: loading its part (:func:`load_bytes`);
    - ``checkpoint``: a mid-visit checkpoint written, or read back on resume (storage/trainckpt): what trains (its
      weights, as many bytes as their gradients: ``est.grads_total``) and its optimizer state (``est.optim``), once
      as host tensors and once as the serialized bytes made from them or read into them;
    - ``commit``: its block file made (storage/checkpoints.save_block streams to a file: the block's tensors on the
      host once), or what the visit's kind takes to make it (``LayerVisit.commit_host_bytes``: a row visit reads
      the stored block holding its matrix, copies the matrix and writes its rows in)."""
    v = plan.visits[block]
    sizes = {n: _numel(s) for n, s in model_shapes(cfg).items()}
    commit = v.mechanism.commit_host_bytes(v, file_bytes(cfg, plan, [v.stored]), sizes)
    return {"load": load_bytes(cfg, plan, block, shape), "checkpoint": 2 * (est.grads_total + est.optim),
            "commit": commit}


def reading_bytes(cfg: ModelConfig, plan: Plan, blocks: Collection[int], stored_bytes: int = 4) -> int:
    """Host bytes reading ``blocks`` one file at a time takes at its peak: the largest file and the largest tensor's
    conversion (4 bytes a parameter); 0 for none."""
    names = {n for b in blocks for n in plan.blocks[b].params}
    largest = max((_numel(s) for n, s in model_shapes(cfg).items() if n in names), default=0)
    return file_bytes(cfg, plan, blocks, stored_bytes) + 4 * largest


def file_bytes(cfg: ModelConfig, plan: Plan, blocks: Collection[int], stored_bytes: int = 4) -> int:
    """The largest block file of ``blocks`` (0 for none), at ``stored_bytes`` a parameter, with its safetensors
    header (under 256 bytes a tensor: name, dtype, shape, offsets)."""
    sizes = {n: _numel(s) for n, s in model_shapes(cfg).items()}
    return max((sum(sizes[n] * stored_bytes + 256 for n in plan.blocks[b].params) for b in blocks), default=0)


def stage_bytes(cfg: ModelConfig, plan: Plan, block: int, shape: StepShape) -> int:
    """Page-locked host bytes of block ``block``'s training loop's batch slots on CUDA (models/stream.BatchStage:
    two): each holds a batch's inputs (the prefix's fp32 states, or int64 token ids) and int64 targets, each
    aligned."""
    n = shape.batch * shape.seq
    inputs = n * (4 * cfg.d_model if plan.visits[block].reads_activations(shape.preinfer) else 8)
    return BATCH_SLOTS * (aligned(inputs) + aligned(n * 8))


BATCH_SLOTS = 2
"""Page-locked batch slots of a training loop on CUDA (models/stream.BatchStage)."""


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


@dataclass(frozen=True)
class NoGradPass:
    """A no-grad pass over a model part (``RunContext.load_part`` with every weight frozen): layers [lo, hi), with
    the embeddings (pre-inference's prefix ``(0, lo)``) and the head (an evaluation), at most ``limit`` rows a
    forward (a shard, the validation rows), or ``rows`` when the batch is set (``bcd.preinfer_batch_size``,
    ``train.eval_batch_size``)."""
    layers: tuple[int, int]
    embed: bool
    head: bool
    limit: int = 1
    rows: int | None = None


def no_grad_memory(cfg: ModelConfig, part: NoGradPass, shape: StepShape) -> Estimate:
    """Peak bytes of ``part``'s no-grad forward over ``shape.batch`` rows, its ``shape.streamed`` layers in
    ``shape.window`` slots (None: every layer with ``offload=stream``, else none). Nothing is saved for a backward,
    so the peak is the weights, the input and one layer's (or the loss chunk's) temporaries."""
    shapes = model_shapes(cfg)
    layers, embed, head = part.layers, part.embed, part.head
    rows, seq, precision, window, chunk_rows = shape.batch, shape.seq, shape.precision, shape.window, shape.chunk_rows
    lo, hi = layers
    s = shape.dtype_bytes
    streamed = shape.streamed
    if streamed is None:
        streamed = range(lo, hi) if shape.offload == "stream" else ()

    def part(name: str) -> bool:
        i = layer_of(name)
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
        if (i := layer_of(k)) is not None:
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


def no_grad_rows(cfg: ModelConfig, part: NoGradPass, shape: StepShape, room: float | None) -> int:
    """Rows per no-grad forward: the most, up to ``part.limit``, whose peak (:func:`no_grad_memory` with the
    ``shape``'s streamed layers) fits ``room`` bytes; without a budget (the CPU) :data:`NO_BUDGET_TOKENS` tokens; at
    least one row."""
    limit = part.limit
    if room is None:
        return max(1, min(limit, NO_BUDGET_TOKENS // shape.seq))

    def peak(r: int) -> int:
        return no_grad_memory(cfg, part, replace(shape, batch=r)).peak

    lo_r, hi_r = 1, max(1, limit)
    if peak(hi_r) <= room:
        return hi_r
    while lo_r < hi_r:  # the peak grows with the rows: the largest that fits
        mid = (lo_r + hi_r + 1) // 2
        lo_r, hi_r = (mid, hi_r) if peak(mid) <= room else (lo_r, mid - 1)
    return lo_r
