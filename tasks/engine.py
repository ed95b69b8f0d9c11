"""The visit engine: one record of a visit (``core/rules.VisitSpec``: which visit, on which version, what the run's
state says it starts from), its description for this process (:class:`VisitLayout`, computed once from the plan and
config) and one recipe that trains it (:func:`run_visit`), whatever holds the model: one process with its model resident or
its frozen layers streamed from host memory (:class:`Resident`, ``tasks/train.py``), or one process of several
(DDP or FSDP2: ``tasks/train_dist.Distributed``). A holding says how the model is loaded, how a batch's loss is
taken, how tensors are gathered and who writes; the recipe (optimizer, mid-visit resume, kept moments, the data
cursor, checkpoints, the step loop, the block file, the result) is written here once. The benchmarks time the same
model preparation and loss (``prepare_model``, ``visit_step_loss``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Protocol

import torch
from pydantic import BaseModel

from bcdflow.constants import IGNORE_INDEX
from bcdflow.core import failpoints, stop_signals
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, cap_allocator
from bcdflow.core.rules import VisitSpec, batch_ranges, visit_rows
from bcdflow.core.spend import spent_at
from bcdflow.models.errors import Diverged
from bcdflow.models.memory import NoGradPass, no_grad_memory, no_grad_rows, visit_memory
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.plan import LayerVisit, VisitTarget, block_tensors
from bcdflow.models.stream import BatchStage
from bcdflow.models.trainer import LoopHooks, LoopState, make_optimizer, run_steps
from bcdflow.models.visit_compute import autocast, prefix_hidden, visit_loss
from bcdflow.storage import activations, checkpoints, trainckpt
from bcdflow.storage.lease import check_leases, lost_lease
from bcdflow.storage.tokens import TokenDataset
from bcdflow.tasks.expand import adapter_group, merge, merge_suffix, suffix_adapters, suffix_rule
from bcdflow.tracking.tracker import TrackTarget


class TrainResult(BaseModel):
    """What training a block returns to its visit (steps are local to the visit)."""
    steps: int
    first_loss: float
    train_loss: float
    stopped_by: str
    seconds: float
    resumed_at: int
    tokens: int
    rows: int
    val_points: list[tuple[int, float]]
    peak_mem_bytes: int | None
    """Peak device bytes allocated during the loop (CUDA)."""
    peak_reserved_bytes: int | None = None
    """Peak device bytes the caching allocator reserved (what the card held; CUDA)."""
    alloc_retries: int | None = None
    """Allocations that failed until the allocator freed its cache (CUDA; a fitting plan has none)."""
    block_file: dict
    recompute: bool = False
    """Whether the frozen suffix was recomputed in backward (bcd.recompute, or auto and the planner said so)."""
    gpus: int = 1
    streamed: int = 0
    """Frozen layers the visit streamed from host memory (``train.offload``); 0 = all resident."""
    val_loss: float | None = None
    """The new version's validation loss, computed by the visit's own model (the frozen prefix does not change in
    a visit); None where that would not be the whole model's (bf16/fp16 stored activations, several processes)."""
    eval_seconds: float = 0.0
    rate: float | None = None
    """Training loss lowered per step on average over the visit (models/trainer.visit_rate; None: too short)."""
    comm_bytes: int = 0
    """Gradient bytes the visit's processes all-reduced a step (DDP's communication hook counted them; 0: one
    process or FSDP), what ``bcdflow plan`` prices (core/cluster.py)."""
    moments_file: dict | None = None
    """``bcd.moments=keep``: the optimizer state the visit ended with (a content-addressed file's entry)."""
    suffix_files: dict[int, dict] = {}
    """``bcd.expand``: the suffix blocks with the adapters merged in (content-addressed files' entries), by block."""
    suffix_norms: dict[int, float] = {}
    """``bcd.expand``: the norm of each suffix block's merged update, as stored."""
    stored: int | None = None
    """A visit of another kind than a block's own (a row visit): the stored block its ``block_file`` replaces
    (``VisitTarget.stored``)."""

    def files(self, block: int) -> dict[int, dict]:
        """Every block file the visit of ``block`` wrote, by stored block: its own (a row block's: the one holding its
        matrix) and the suffix blocks it changed."""
        return {block if self.stored is None else self.stored: self.block_file, **self.suffix_files}


def device_peak(device: torch.device) -> tuple[int, int, int] | None:
    """(peak allocated, peak reserved, allocation retries) of the CUDA caching allocator since its last reset; None
    on the CPU. Reserved is what the card had to hold; a retry is an allocation that failed until the allocator
    freed its cache (a synchronising, slow path): a visit that fits its plan has none."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
            int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)))


def perplexity(loss: float) -> float:
    """A validation loss's perplexity (the exponent capped at 50: a diverged loss reads as a huge number, not inf)."""
    return math.exp(min(loss, 50))


class EvalResult(BaseModel):
    val_loss: float
    val_ppl: float
    seconds: float

    @classmethod
    def of(cls, loss: float, seconds: float) -> "EvalResult":
        return cls(val_loss=loss, val_ppl=perplexity(loss), seconds=seconds)


def window_logger(track: TrackTarget | None, eval_every: int, model: torch.nn.Module,
                  evaluate: Callable[[], float], val_points: list[tuple[int, float]]) -> Callable:
    """The trainer's per-window callback: each step's loss to MLflow and, when the window crossed a multiple of
    ``eval_every``, the validation loss (``model`` in eval mode meanwhile), appended to ``val_points`` too."""
    def on_window(step: int, losses: list[float]) -> None:
        if track:
            track.series("train_loss", [(step - len(losses) + i + 1, v) for i, v in enumerate(losses)])
        if eval_every and step // eval_every > (step - len(losses)) // eval_every:
            model.eval()
            val = evaluate()
            model.train()
            val_points.append((step, val))
            if track:
                track.series("val_loss", [(step, val)])
                track.series("val_ppl", [(step, perplexity(val))])
    return on_window


def counted(fetch: Callable) -> Callable:
    """``fetch(a, b)`` -> (inputs, targets) made (inputs, targets, trained tokens): the count of targets that are
    not ``IGNORE_INDEX``, taken on the host in the prefetch thread, so the step loop's ``tokens`` and
    ``tokens_per_s`` count trained positions only without syncing a GPU (``models/trainer._tokens``)."""
    def fetch_counted(a: int, b: int):
        x, y = fetch(a, b)
        return x, y, int((y != IGNORE_INDEX).sum())
    return fetch_counted


def prefetched(ranges: Iterator[tuple[int, int]], fetch: Callable, device) -> Iterator:
    """Read batch k+1 from the store while batch k trains (tensors of a batch go to the device, other items as
    they are). On CUDA a batch passes through a page-locked slot of a :class:`~bcdflow.models.stream.BatchStage`
    (exactly its bytes, counted by the planner), so its copy to the device is asynchronous on the compute stream."""
    stage = BatchStage(device)

    def fetch_staged(a: int, b: int):
        return stage.stage(fetch(a, b))  # (slot, batch): in the reading thread

    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(fetch_staged, *next(ranges))
            while True:
                k, batch = fut.result()
                fut = pool.submit(fetch_staged, *next(ranges))  # two slots: this one waits for batch k-1's copy only
                yield stage.to_device(k, batch)
    finally:  # the loop ended (done, interrupted, an error): no slot is freed under its copy
        stage.close()


def use_recompute(cfg: RunConfig, ctx: RunContext, block: int, gpus: int = 1, parallel: str = "single") -> bool:
    """``bcd.recompute``: on, off, or (auto) as the visit's holding chooses on one process (models/holding.py); on
    several, on when a replica (with its adapters, ``bcd.expand``) would not fit the budget without it."""
    if cfg.bcd.recompute != "auto":
        return cfg.bcd.recompute in ("on", "all")
    if gpus == 1:
        return ctx.holding(block).recompute
    budget = ctx.budget()
    shape = dataclasses.replace(cfg.step_shape(), recompute="off", gpus=gpus, parallel=parallel)
    return budget is not None and visit_memory(ctx.model_cfg, ctx.plan, block, shape).peak > budget


def compile_layers(model) -> None:
    """torch.compile each layer in place (identical layers share one compiled graph)."""
    for layer in model.h.values():
        layer.compile()


def diverged_message(cfg: RunConfig, run_id: str, cycle: int, block: int, e: Diverged) -> str:
    hint = " (or bf16 overflowed: try train.precision=fp32)" if cfg.train.precision == "bf16" else ""
    return (f"visit c{cycle}-b{block} of run {run_id!r}: {e}; the learning rate optim.lr={cfg.optim_spec().base_lr:g} "
            f"is likely too high{hint}. Nothing was committed; continue the run with a lower one: "
            f"bcdflow train --run-id {run_id} --set optim.lr=... (and the run's other settings)")


def val_batches(ds: TokenDataset, cfg: RunConfig, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``train.eval_rows`` validation rows as (B, T) inputs and targets, in batches of ``rows``."""
    inputs, targets = ds.val_pairs(cfg.train.eval_rows)
    return list(zip(inputs.split(rows), targets.split(rows)))


def visit_eval_rows(ctx: RunContext, vs: "VisitLayout") -> int:
    """Rows per validation forward inside a visit: ``train.eval_batch_size``, else the most whose no-grad pass fits
    in what a training step holds beyond the visit's weights, optimizer state and input (free between steps), or
    (no budget: the CPU) 16k tokens; up to ``train.eval_rows``."""
    t = ctx.cfg.train
    if t.eval_batch_size:
        return t.eval_batch_size
    room = None
    if ctx.budget() is not None:  # a step's input and temporaries, free between steps; the pass adds its weights
        est = ctx.holding(vs.block).estimate
    part = NoGradPass(vs.layers, vs.embed, True, t.eval_rows)
    shape = dataclasses.replace(ctx.cfg.step_shape(), streamed=vs.streamed)  # as the visit holds its model
    if ctx.budget() is not None:  # a step's input and temporaries, free between steps; the pass adds its weights
        est = ctx.holding(vs.block).estimate
        room = est.input + est.activations + est.logits + est.temporaries + no_grad_memory(
            ctx.model_cfg, part, dataclasses.replace(shape, batch=1)).weights
    return no_grad_rows(ctx.model_cfg, part, shape, room)


def visit_val_batches(cfg: RunConfig, ctx: RunContext, vs: "VisitLayout") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a visit validates on within itself (``bcd.eval_every``): the validation batches or, for a visit
    trained from stored activations (whose model starts at its block), the frozen prefix's hidden states of them,
    computed once (the prefix is frozen for the whole visit) and rounded as the stored activations are; kept in
    CPU memory (eval_rows × T × d_model × the activation dtype's bytes)."""
    batches = val_batches(ctx.dataset, cfg, visit_eval_rows(ctx, vs))
    if not vs.from_acts:
        return batches
    prefix = ctx.frozen_prefix(vs.version, vs.block)  # pre-inference's, where this process ran it
    dtype = getattr(torch, cfg.bcd.act_dtype)
    with torch.inference_mode(), autocast(ctx.device, cfg.train.precision):
        return [(prefix_hidden(prefix, x.to(ctx.device), vs.lo).to("cpu", dtype), y) for x, y in batches]


@torch.no_grad()
def evaluate_model(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: RunConfig, device) -> float:
    """Token-weighted mean validation loss over ``batches`` (``loss_of(x, y)``: a batch's mean loss); with a loss
    mask (supervised formats) over the trained (completion) tokens only."""
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for x, y in batches:
        n = int((y != IGNORE_INDEX).sum())  # counted on the host, where the batch is
        if n == 0:  # a batch without a trained token has no loss (cross-entropy of nothing is NaN)
            continue
        with autocast(device, cfg.train.precision):
            loss = loss_of(x.to(device).float() if x.is_floating_point() else x.to(device), y.to(device))
        total += loss.detach().double() * n  # summed on the device: one host sync for the whole pass
        count += n
    return float(total) / count if count else float("nan")


def optimizer_tensors(state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The per-parameter entries of an optimizer ``state_dict()`` (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``;
    a distributed visit's gathered whole) as named tensors ``{entry}/{parameter name}``; ``names``: the names of
    the optimizer's parameters, in its order."""
    return {f"{k}/{n}": torch.as_tensor(v) for i, n in enumerate(names) for k, v in state["state"].get(i, {}).items()}


def optimizer_state(tensors: dict[str, torch.Tensor], names: list[str], param_groups: list[dict]) -> dict:
    """What ``optimizer_tensors`` saved as a ``state_dict()`` for an optimizer over ``names`` whose parameter
    groups (learning rate included) are ``param_groups``; a parameter without saved entries starts fresh."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        k, n = key.split("/", 1)
        by_name.setdefault(n, {})[k] = t
    return {"state": {i: by_name[n] for i, n in enumerate(names) if n in by_name}, "param_groups": param_groups}


# -- one description of a visit, one recipe -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VisitLayout:
    """Visit ``spec`` of run ``run_id`` (``core/rules.VisitSpec``: its cycle, block, version and the run's inputs)
    described once for the processes that train it, from the plan and config: the layers its model holds, whether it
    reads the prefix's stored activations, what it trains and how (recompute, streamed frozen layers), and whether its
    own evaluation is the new version's whole-model validation loss."""
    run_id: str
    spec: VisitSpec
    lo: int
    """The active block's layers are [lo, hi) (``hi`` None: to the last; a benchmark's whole-model step)."""
    hi: int | None
    n_layer: int
    from_acts: bool
    """Trains from the prefix's stored activations (``RunContext.from_acts``): the model starts at layer ``lo``."""
    active: frozenset[str]
    """The parameter names it trains (the block's, less ``bcd.freeze``)."""
    recompute: bool
    recompute_active: bool
    streamed: tuple[int, ...]
    """Frozen layers kept in host memory and streamed through the device (``train.offload``); () = all resident."""
    exact: bool
    """Its evaluation on the validation rows is the new version's (one process, and the activations it starts from
    are the prefix's exact ones: no stored activations, or stored in float32)."""
    expand: int = 0
    """``bcd.expand``: the rank of the adapters on the layers after the block ([hi, n)); 0 = none (off, the last
    block, or a kind of visit that expands nothing)."""
    target: VisitTarget | None = None
    """What the visit trains and commits (``models/plan.VisitTarget``; its kind's hooks attach and commit it); None:
    a benchmark's step of whole parameters."""

    @property
    def kind(self) -> LayerVisit:
        return LayerVisit() if self.target is None else self.target.mechanism

    @property
    def cycle(self) -> int:
        return self.spec.cycle

    @property
    def block(self) -> int:
        return self.spec.block

    @property
    def version(self) -> int:
        return self.spec.version

    @property
    def layers(self) -> tuple[int, int]:
        """The layers its model holds: from ``lo`` when it reads stored activations, else all."""
        return (self.lo if self.from_acts else 0, self.n_layer)

    @property
    def embed(self) -> bool:
        return not self.from_acts


def describe(ctx: RunContext, spec: VisitSpec, gpus: int = 1) -> VisitLayout:
    """Visit ``spec`` described for ``gpus`` processes (several: DDP or FSDP2, nothing streamed)."""
    cfg, block = ctx.cfg, spec.block
    target = ctx.plan.visits[block]
    lo, hi = target.layers
    from_acts = ctx.from_acts(block)
    expand = (cfg.bcd.expand_rank if cfg.bcd.expand == "lora" and hi < ctx.model_cfg.n_layer
              and target.mechanism.expands else 0)
    recompute = use_recompute(cfg, ctx, block, gpus=gpus, parallel="single" if gpus == 1 else "ddp")
    return VisitLayout(
        run_id=ctx.run_id, spec=spec, lo=lo, hi=hi, n_layer=ctx.model_cfg.n_layer,
        from_acts=from_acts, active=frozenset(ctx.trainable(block)), recompute=recompute,
        recompute_active=cfg.bcd.recompute == "all",
        streamed=ctx.holding(block).streamed if gpus == 1 else (),
        exact=gpus == 1 and (not from_acts or cfg.bcd.act_dtype == "float32"), expand=expand, target=target)


def prepare_model(model: torch.nn.Module, active, chunk_rows: int | None,
                  compile: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """A visit's model made ready to train: gradients on ``active`` only (invariant I6), the head's loss chunking,
    each layer compiled (``train.compile``, before any DDP/FSDP wrap: torchtitan's order), train mode; returns the
    trained parameters, named, in the model's order (the optimizer's)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name in active)
    model.loss_chunk_rows = chunk_rows
    if compile:
        compile_layers(model)
    model.train()
    return [(n, p) for n, p in model.named_parameters() if n in active]


def visit_step_loss(model, vs: VisitLayout, device: torch.device, precision: str) -> Callable:
    """``loss(batch)``: the visit's mean token loss of a batch (inputs or the prefix's states, targets, ...) under
    the precision's autocast, with streamed weights saved by reference (``models.visit_compute.visit_loss``)."""
    stream = getattr(model, "stream", None)
    saving = stream.saving if stream else contextlib.nullcontext

    def loss(batch):
        with autocast(device, precision), saving():
            return visit_loss(model, *batch[:2], vs.lo, vs.from_acts, hi=vs.hi, recompute=vs.recompute,
                              recompute_active=vs.recompute_active)
    return loss


class VisitHolding(Protocol):
    """How a visit's model is held (:class:`Resident`, ``tasks/train_dist.Distributed``): what :func:`run_visit`, the
    one recipe, asks of it. A new way to hold a visit (another parallelism, another offload) implements this."""

    writer: bool
    """Whether this process writes the checkpoints, the block file and the result (rank 0 of several)."""
    world: int
    model: torch.nn.Module
    """The visit's part of the model (its held layers and the head)."""
    module: torch.nn.Module
    """What evaluation switches to eval mode and back (the model, or the wrapped step)."""
    named: list[tuple[str, torch.nn.Parameter]]
    """The active block's trainable parameters by name (this process's shards under FSDP)."""
    loss: Callable
    """A batch -> its loss (on this process's slice of it)."""
    eval_loss: Callable
    ckpt_device: torch.device | str
    clock: Callable[[], float] | None
    """The loop's clock (one agreed by every process), or None for the loop's own."""
    adapters: object | None
    """``bcd.expand``'s suffix adapters where the holding made them itself (before wrapping), else None."""

    def fetch(self, read: Callable, rows) -> Callable: ...
    def should_stop(self) -> bool: ...
    def set_params(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def load_optim(self, opt, state: dict) -> None: ...
    def params(self) -> dict[str, torch.Tensor]: ...
    def optim_state(self, opt) -> dict: ...
    def block_tensors(self) -> dict[str, torch.Tensor]: ...
    def barrier(self) -> None: ...
    def peak(self) -> tuple[int, int, int] | None: ...
    def comm_bytes(self, steps: int) -> int: ...
    """Gradient bytes all-reduced a step over ``steps`` steps (0: nothing communicated)."""
    def close(self) -> None: ...


class Resident:
    """The visit's model in this one process: on its device, its frozen layers streamed from host memory where the
    visit says (``VisitLayout.streamed``; models/stream.py). A :class:`VisitHolding`."""

    writer = True
    world = 1
    adapters = None  # made by run_visit (suffix_adapters), beside the model

    def __init__(self, ctx: RunContext, vs: VisitLayout):
        self.ctx, self.vs, self.device = ctx, vs, ctx.device
        cfg = ctx.cfg
        active = vs.kind.model_trainable(vs.active)  # a row visit: the whole matrix frozen, its rows a slice
        self.model = ctx.load_part(ctx.manifest(vs.version), vs.layers, embed=vs.embed, head=True,
                                   trainable=active, stream=vs.streamed,
                                   grad_from=vs.lo)  # bf16: frozen matrices in bf16 (I6)
        self.named = prepare_model(self.model, active, cfg.train.loss_chunk_rows, cfg.train.compile)
        master = torch.bfloat16 if OPTIMIZERS[cfg.optim.name].master == 2 else torch.float32
        self.named = vs.kind.attach(vs.target, self.model, self.named, master, lambda name: stored_tensor(ctx, vs, name))
        # a peer that wraps the model (optim.name=lora: adapters, the base frozen) trains what the wrapper adds
        wrap = OPTIMIZERS[cfg.optim.name].wrap
        self.named, self.unwrap = wrap(self.model, cfg.optim_spec()) if wrap else (self.named, None)
        self.module = self.model  # what evaluation switches to eval mode and back
        self.loss = visit_step_loss(self.model, vs, self.device, cfg.train.precision)
        self.eval_loss = functools.partial(visit_loss, self.model, lo=vs.lo, from_acts=vs.from_acts)
        self.ckpt_device = self.device
        self.clock = None  # the loop's own

    def fetch(self, read: Callable, rows) -> Callable:
        return counted(read)  # (inputs, targets, trained tokens)

    def should_stop(self) -> bool:  # after each step: SIGTERM or Ctrl-C, or a lease that could expire (§9)
        return stop_signals.requested() or lost_lease() is not None

    def set_params(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(tensors[n])

    def load_optim(self, opt, state: dict) -> None:
        opt.load_state_dict(state)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.named)

    def optim_state(self, opt) -> dict:
        return opt.state_dict()

    def block_tensors(self) -> dict[str, torch.Tensor]:
        own = self.vs.kind.commit(self.vs.target, self.named, lambda: stored_block(self.ctx, self.vs))
        if own is not None:  # what the visit's kind commits (a row visit: the stored block, its rows written in)
            return own
        if self.unwrap is not None:  # the wrapper merged in: the model's own names and weights
            self.unwrap, finish = None, self.unwrap
            finish()
        return as_stored(self.ctx, self.vs, block_tensors(self.model, self.ctx.plan, self.vs.block))

    def barrier(self) -> None:
        pass

    def peak(self) -> tuple[int, int, int] | None:
        return device_peak(self.device)

    def comm_bytes(self, steps: int) -> int:
        return 0  # one process: nothing is all-reduced

    def close(self) -> None:
        if self.model.stream:
            self.model.stream.close()


def as_stored(ctx: RunContext, vs: VisitLayout, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block's tensors as its visit commits them: what trained in fp32 (bf16 master weights, optim.name=
    adamw8bit-bf16, cast up: exact), and what the block holds frozen (``bcd.freeze``, a matrix trained in row blocks)
    as the base version stores it, never the device's bf16 copy of it under ``train.precision=bf16`` (I1)."""
    rounded = [n for n, t in tensors.items() if n not in vs.active and t.dtype != torch.float32]
    if rounded:
        manifest = ctx.manifest(vs.version)
        stored = {n: t.clone() for n, t in checkpoints.iter_from_manifest(ctx.store, ctx.run_id, manifest,
                                                                            [vs.block], names=rounded)}
        tensors = {**tensors, **stored}
    return {n: t.float() if n in vs.active and t.dtype == torch.bfloat16 else t for n, t in tensors.items()}


def stored_tensor(ctx: RunContext, vs: VisitLayout, name: str) -> torch.Tensor:
    """Tensor ``name`` of the stored block visit ``vs`` commits, as the base version stores it (its stored dtype: fp32
    for a trained version, a checkpoint's own for version 0), on the host, read-only (a view of the file: a kind that
    keeps or writes it clones it); the block file read one tensor at a time, never the whole block at once."""
    for _, t in checkpoints.iter_from_manifest(ctx.store, ctx.run_id, ctx.manifest(vs.version),
                                               [vs.target.stored], names=[name]):
        return t
    raise checkpoints.CheckpointError(f"version {vs.version} of run {ctx.run_id!r} stores no {name}")


def stored_block(ctx: RunContext, vs: VisitLayout) -> dict[str, torch.Tensor]:
    """The stored block visit ``vs`` commits, as the base version stores it."""
    return checkpoints.load_from_manifest(ctx.store, ctx.run_id, ctx.manifest(vs.version), [vs.target.stored])


def run_visit(ctx: RunContext, spec: VisitSpec, hold: Callable[[RunContext, VisitLayout], VisitHolding], *,
              gpus: int = 1, track: TrackTarget | None = None, progress=None) -> TrainResult:
    """Train visit ``spec`` (``core/rules.VisitSpec``: its version and what the run's state hands it: the global
    step, the adaptive budget's rate to beat, the block's kept moments, the earlier attempts' clock, whose reading
    each checkpoint carries) with its model held by ``hold`` (:class:`Resident` or ``train_dist.Distributed``, one of
    ``gpus`` processes) to local convergence; returns its result, the block file (and, ``bcd.moments=keep``, its
    optimizer state) written by the writer, content-addressed, not committed; none of them after an interruption (its
    checkpoint is written). ``progress``: the live line, closed when the loop ends. Raises Diverged (the caller words
    it) and LeaseLost."""
    cfg = ctx.cfg
    vs = describe(ctx, spec, gpus)
    # the validation rows as this visit's model sees them (the prefix's states where it starts at its block): the
    # new version's validation loss is this model's on them, so the visit needs no reload of the whole model
    val = visit_val_batches(cfg, ctx, vs) if cfg.bcd.eval_every or vs.exact else []
    ctx.release_prefix()  # before the visit's model loads: the two are never held at once
    cap_allocator(cfg, ctx.device)  # each visit, each process on its own device: train.memory_gb, the cache emptied
    held = hold(ctx, vs)
    try:
        return _train_held(ctx, vs, held, val, track=track, progress=progress)
    finally:
        held.close()  # its device slots and page-locked buffers go whatever ends the visit


def _resume(ctx: RunContext, vs: VisitLayout, held: VisitHolding, opt, movers: list, vkey: str,
            base_lr: float) -> LoopState | None:
    """Where the visit goes on from: its newest intact mid-visit checkpoint (unsharded: resumable on any process
    count; a damaged one is skipped for the one before it or the visit's start) loaded into the held parameters,
    what trains beside it (``movers``: the adapters, the suffix's sign rule) and ``opt``, and its loop state
    returned; else, with ``bcd.moments=keep``, the block's kept moments loaded into ``opt`` (None). The loaded
    tensors are this function's alone: what was copied into the parameters (and, under bitsandbytes, the
    optimizer's deep copy) is freed when it returns, so a resumed visit never holds a second copy of its block and
    state on the device for its whole loop (a tightly planned card would run out)."""
    names = [n for n, _ in held.named]
    ck = trainckpt.load(ctx.store, vkey, held.ckpt_device, base_version=vs.version, rng_device=ctx.device)
    if ck is not None:  # resume mid-visit
        pointer, saved, opt_state = ck
        del ck
        held.set_params({n: saved[n] for n in names})
        for m in movers:
            m.load(saved)
        del saved
        held.load_optim(opt, opt_state)
        del opt_state
        for g in opt.param_groups:  # a continued run may have lowered optim.lr (after a divergence)
            g["lr"] = base_lr * g.get("lr_ratio", 1.0)
        return LoopState.from_dict(pointer["meta"]["loop"])
    if vs.spec.moments is not None:  # bcd.moments=keep: where the block's last visit left its optimizer
        saved = checkpoints.load_file(ctx.store, vs.run_id, vs.spec.moments,
                                      f"the optimizer moments of block {vs.block}", held.ckpt_device)
        held.load_optim(opt, optimizer_state(saved, names, opt.state_dict()["param_groups"]))
    return None


def _train_held(ctx: RunContext, vs: VisitLayout, held: VisitHolding, val: list, *, track: TrackTarget | None,
                progress) -> TrainResult:
    """The body of :func:`run_visit` once its model is held."""
    cfg, ds, device, block, spec_in = ctx.cfg, ctx.dataset, ctx.device, vs.block, vs.spec
    names, params = [n for n, _ in held.named], [p for _, p in held.named]
    # bcd.expand: adapters on the suffix's linear maps, beside the model (a distributed holding registers its own
    # before DDP wraps the step, so DDP reduces their gradients)
    adapters = held.adapters if held.adapters is not None else suffix_adapters(ctx, vs, held.model)

    rows = visit_rows(cfg, ds.n_train, vs.cycle, block)
    if vs.from_acts:
        read = activations.ActivationReader(ctx.act_store, ctx.acts_key(vs.cycle, block)).read  # (B, T, C), (B, T)
    else:
        def read(a: int, b: int):
            return ds.train_pairs(rows[a:b])  # (B, T) inputs, (B, T) targets (masked: IGNORE_INDEX)

    val_points: list[tuple[int, float]] = []
    on_window = window_logger(track, cfg.bcd.eval_every, held.module,  # every process evaluates: collectives
                              lambda: evaluate_model(held.eval_loss, val, cfg, device), val_points)

    if device.type == "cuda":  # the loop's own peaks and retries (the loaded model counts in both)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    spec = cfg.optim_spec(ctx.plan.visits[block].stored)  # a row block: its matrix's block's bcd.lr_scales entry
    opt = make_optimizer(held.named, spec)  # by name: a peer finds its blocks and layers by name
    if adapters is not None:
        opt.add_param_group(adapter_group(cfg, spec, adapters))
    vkey = ctx.visit_key(vs.cycle, block)
    suffix = suffix_rule(ctx, vs, held.model, opt, spec)  # bcd.expand=sign: the suffix's weights, state-free
    movers = [m for m in (adapters, suffix) if m is not None]  # what trains beside the block, checkpointed with it
    state = _resume(ctx, vs, held, opt, movers, vkey, spec.base_lr)

    def checkpoint(st: LoopState, why: str) -> None:
        # a holder whose lease could have expired writes nothing more: the next holder of the visit keeps its
        # checkpoint here too. On a lapsed lease (should_stop) this is where the loop ends, with LeaseLost.
        check_leases()
        tensors, opt_state = held.params(), held.optim_state(opt)  # collectives under FSDP
        for m in movers:
            tensors = {**tensors, **m.tensors()}
        if held.writer:
            trainckpt.save(ctx.store, vkey, st.steps, tensors, opt_state,
                           {"loop": st.to_dict(), "base_version": vs.version, "why": why,
                            **({"gpus": held.world} if held.world > 1 else {}),
                            **({"spent": spent_at(spec_in.clock)} if spec_in.clock else {})}, rng_device=ctx.device)
            failpoints.hit("train-checkpoint")
        held.barrier()

    # the data cursor: a resumed loop skips the batches it already trained on
    resumed_at = state.steps if state else 0  # run_steps advances the state it is given
    ranges = itertools.islice(batch_ranges(len(rows), cfg.train.batch_size, cfg.seed, vs.cycle, block), resumed_at,
                              None)
    check_leases()  # a lease that lapsed while the visit set up (a slow load): not one step is trained
    try:
        with stop_signals.training():
            hooks = LoopHooks(on_window=on_window, should_stop=held.should_stop, checkpoint=checkpoint,
                              clock=held.clock, progress=progress)
            res = run_steps(held.loss, params, prefetched(ranges, held.fetch(read, rows), device),
                            opt, dataclasses.replace(spec, first_step=spec_in.global_step),
                            cfg.stop_rule(spec_in.min_rate), hooks, state, cfg.checkpoint_schedule(),
                            extra=None if adapters is None else [p for _, p in adapters.named()])
    finally:
        if progress is not None:
            progress.close()
    check_leases()  # a lease that lapsed during the last step: no evaluation, no block file
    peak = held.peak()
    done = res.stopped_by != "interrupted"
    val_loss, eval_s = None, 0.0
    if vs.exact and done:
        if val_points and val_points[-1][0] == res.steps:  # validated at the last step already
            val_loss = val_points[-1][1]
        else:
            t0 = time.perf_counter()
            held.module.eval()
            val_loss = evaluate_model(held.eval_loss, val, cfg, device)
            eval_s = time.perf_counter() - t0
    block_file, moments_file, suffix_files, suffix_norms = {}, None, {}, {}
    if done:
        tensors = held.block_tensors()
        opt_full = held.optim_state(opt) if cfg.bcd.moments == "keep" else None  # collectives under FSDP
        if held.writer:
            block_file = checkpoints.save_block(ctx.store, vs.run_id, tensors)
            if opt_full is not None:  # the block's own moments only (names); the adapters' end with the visit
                moments_file = checkpoints.save_block(ctx.store, vs.run_id, optimizer_tensors(opt_full, names))
            if adapters is not None:
                suffix_files, suffix_norms = merge(ctx, vs, adapters)
            if suffix is not None:
                suffix_files, suffix_norms = merge_suffix(ctx, vs, suffix)
    for m in movers:
        m.detach()
    return TrainResult(
        steps=res.steps, first_loss=res.losses[0] if res.losses else float("nan"), train_loss=res.final_loss,
        stopped_by=res.stopped_by, seconds=res.seconds, resumed_at=resumed_at, tokens=res.tokens, rows=len(rows),
        val_points=val_points, peak_mem_bytes=peak and peak[0], peak_reserved_bytes=peak and peak[1],
        alloc_retries=peak and peak[2], block_file=block_file, recompute=vs.recompute, gpus=held.world,
        streamed=len(vs.streamed), rate=res.rate, moments_file=moments_file, val_loss=val_loss, eval_seconds=eval_s,
        comm_bytes=held.comm_bytes(res.steps - resumed_at),
        suffix_files=suffix_files, suffix_norms=suffix_norms, stored=vs.target.stored if vs.target.stored != block else None)
