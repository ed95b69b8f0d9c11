"""The step loop shared by a BCD visit and the full-parameter baseline (so invariant I3 holds exactly).

Algorithm 1 (paper §3.1), line 7-8: build a fresh optimizer over the active block only and train
until local convergence: a per-visit step cap, a loss plateau, or (``bcd.budget=adaptive``) the point where the
block lowers the loss more slowly than the other blocks did on their last visits (``StopRule``; docs/DESIGN.md §2.3).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from bcdflow.constants import IGNORE_INDEX
from bcdflow.models.errors import ConfigError, Diverged
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.specs import CheckpointSchedule, OptimSpec, StopRule


def make_optimizer(params: list, spec: OptimSpec) -> torch.optim.Optimizer:
    """The optimizer ``spec.name`` names (``models/optimizers.OPTIMIZERS``) over ``params``: parameters, or
    ``(name, parameter)`` pairs, which a peer method needs (its blocks and layers are found by name)."""
    if spec.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer {spec.name!r} (choose from {', '.join(OPTIMIZERS)})")
    opt = OPTIMIZERS[spec.name]
    named = bool(params) and isinstance(params[0], tuple)
    if opt.peer:
        return opt.build(params if named else [(str(i), p) for i, p in enumerate(params)], spec)
    return opt.build([p for _, p in params] if named else params, spec)


# Why a loop stopped (``LoopResult.stopped_by``, a visit record's ``stopped_by``), in words for a person: the visits
# table in Prefect, the visit's last log line and its MLflow description say these (``stop_words``).
STOP_WORDS = {
    "max_steps": "reached its step cap (bcd.max_steps)",
    "plateau": "its loss stopped falling (a plateau: less than bcd.min_delta per window, even at its noise's "
               "optimistic end)",
    "budget": "its loss fell more slowly per step than the other blocks' did on their last visits "
              "(bcd.budget=adaptive): the steps go to the block that lowers the loss",
    "interrupted": "interrupted (SIGTERM or Ctrl-C) after writing a checkpoint; a resume continues it",
}
# ... and a baseline's (mode "full"): its one visit's cap and plateau rule are its train.* keys (flows/bcd.full_config)
BASELINE_STOP_WORDS = {
    "max_steps": "reached its step cap (train.steps)",
    "plateau": "its loss stopped falling (a plateau by train.patience: less than bcd.min_delta per window, even at its "
               "noise's optimistic end)",
}
FINAL_LOSS_STEPS = 10
"""A loop's ``final_loss`` is the mean of its last this-many step losses (a visit's ``train_loss``)."""


def stop_words(stopped_by: str, mode: str = "bcd") -> str:
    """``stopped_by`` said in words (an unknown reason, from a newer bcdflow, as it is); ``mode``: the run's, a
    baseline ("full") says its own keys."""
    return (mode == "full" and BASELINE_STOP_WORDS.get(stopped_by)) or STOP_WORDS.get(stopped_by, stopped_by)


# -- the builders of models/optimizers.OPTIMIZERS' entries (the registry names them; torch lives here) -------------
def adamw(params, spec: OptimSpec) -> torch.optim.Optimizer:
    # fused: one kernel per parameter group, no foreach temporaries (3.5x faster on CPU here)
    return torch.optim.AdamW(params, lr=spec.base_lr, betas=spec.betas, eps=spec.eps,
                             weight_decay=spec.weight_decay, fused=True)


def sgd(params, spec: OptimSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.base_lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
                           foreach=True)


def adamw_named(named, spec: OptimSpec) -> torch.optim.Optimizer:
    """AdamW over ``(name, parameter)`` pairs (a peer that trains what its wrapper adds: ``lora``)."""
    return adamw([p for _, p in named], spec)


def visit_rate(losses: list[float], window: int) -> float | None:
    """How fast a loop lowered its loss on average: its first window's mean minus its last window's, per step
    between them (None for a loop shorter than two windows)."""
    if len(losses) < 2 * window:
        return None
    return (sum(losses[:window]) - sum(losses[-window:])) / window / (len(losses) - window)


@dataclass
class LoopState:
    """Everything the loop needs to continue bitwise-identically after a restart, together with the
    block's parameters, the optimizer state and the data cursor (= ``steps`` batches consumed)."""
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)  # losses of the still-open window
    seconds: float = 0.0  # the loop's seconds up to this state, over every attempt (a resumed visit's figures)
    write_s: float = 0.0  # the last checkpoint's write, seconds: a resumed loop holds the next back as it would have

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "LoopState":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class LoopResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    stopped_by: str = "max_steps"
    seconds: float = 0.0
    tokens: int = 0

    window: int = 20

    @property
    def rate(self) -> float | None:
        return visit_rate(self.losses, self.window)

    @property
    def final_loss(self) -> float:
        tail = self.losses[-FINAL_LOSS_STEPS:]
        return sum(tail) / len(tail) if tail else float("nan")


@dataclass
class LoopHooks:
    """What a loop calls out to, all optional. ``on_window(step, losses)``: each window's per-step losses (for
    tracking). ``should_stop()``: a SIGTERM or Ctrl-C arrived (the loop checkpoints with ``why="signal"`` and ends
    ``interrupted``). ``checkpoint(state, why)``: write a mid-visit checkpoint (``why``: ``steps``, ``seconds``,
    ``signal``). ``clock()``: replaces ``time.perf_counter`` (the processes of one distributed visit share rank 0's,
    so they checkpoint by seconds at the same step). ``progress(step, tokens, loss)``: a live display, called once
    before the first step (``loss`` None), after every step with the last synced window's mean loss (before the
    first window the last step's loss as a 0-dim tensor, which syncs a GPU when read: the display throttles itself)
    and once when the loop ends with ``final_loss``."""
    on_window: Callable[[int, list[float]], None] | None = None
    should_stop: Callable[[], bool] | None = None
    checkpoint: Callable[[LoopState, str], None] | None = None
    clock: Callable[[], float] | None = None
    progress: Callable[[int, int, float | None], None] | None = None


def run_steps(loss_fn: Callable[[object], torch.Tensor], params: list[torch.nn.Parameter], batches: Iterable,
              optimizer: torch.optim.Optimizer, spec: OptimSpec, stop: StopRule, hooks: LoopHooks | None = None,
              state: LoopState | None = None, schedule: CheckpointSchedule | None = None,
              extra: list[torch.nn.Parameter] | None = None) -> LoopResult:
    """Train ``params`` with ``optimizer`` on ``batches`` until the stop rule fires.

    ``loss_fn(batch)`` runs the forward pass and returns a scalar loss. Losses (and gradient norms) are
    synced to the host once per window and before each checkpoint, not every step, so a GPU never waits
    on ``.item()``; a non-finite loss or gradient norm then raises :class:`Diverged` naming the first bad
    step, before any checkpoint of it can be written. ``state`` continues a loop from a checkpoint (``batches``
    must then start at batch ``state.steps``). ``hooks`` (:class:`LoopHooks`): tracking, preemption, checkpoints,
    the clock and the live display. ``schedule`` (``models/specs.CheckpointSchedule``): when ``hooks.checkpoint``
    is called by steps or seconds, held back to its share of the loop's time (None: only on a signal). Sharded
    (DTensor) gradient norms are gathered whole. ``spec.first_step``: the run's steps before this loop's first
    (the learning-rate schedule's clock). ``extra``: more parameters ``optimizer`` trains (``bcd.expand``'s
    adapters), their gradients clipped apart from ``params``'.
    """
    h = hooks or LoopHooks()
    clock = h.clock or time.perf_counter
    st = state or LoopState()
    before = st.seconds  # what the attempts this loop continues took; res.seconds counts them too
    res = LoopResult(steps=st.steps, losses=list(st.losses), tokens=st.tokens, window=stop.window)
    pending = [torch.tensor(v, dtype=torch.float32) for v in st.pending]
    norms = [torch.zeros(()) for _ in st.pending]  # gradient norms of the pending steps (checked at sync)

    def synced() -> list[float]:
        """The pending window's losses on the host; raises Diverged at its first non-finite step."""
        losses = torch.stack(pending).float().cpu()
        grads = torch.stack(norms).float().cpu()
        bad = ~(torch.isfinite(losses) & torch.isfinite(grads))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise Diverged(res.steps - len(pending) + i + 1, float(losses[i]), float(grads[i]))
        return losses.tolist()

    it: Iterator = iter(batches)
    t0 = clock()
    timer = (schedule or CheckpointSchedule()).timer(t0, st.write_s)
    window_loss: float | None = None
    if h.progress:
        h.progress(res.steps, res.tokens, None)
    while res.steps < stop.max_steps:
        batch = next(it)
        if spec.scheduled:
            for g in optimizer.param_groups:  # a group's lr_ratio: its rate over the block's (the adapters')
                g["lr"] = spec.lr_at(res.steps, spec.first_step + res.steps) * g.get("lr_ratio", 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(batch)
        loss.backward()
        norm = _clipped(params, spec.grad_clip)
        if extra:  # clipped on their own: the block's step is the one it takes without them
            norm = torch.stack([norm, _clipped(extra, spec.grad_clip).to(norm.device)]).norm()
        pending.append(loss.detach())
        del loss  # the graph goes before the optimizer step: recompute keeps its re-run layers' tensors in it
        optimizer.step()
        res.steps += 1
        res.tokens += _tokens(batch)
        norms.append(norm.detach())
        if len(pending) == stop.window or res.steps == stop.max_steps:
            window = synced()
            pending.clear()
            norms.clear()
            res.losses.extend(window)
            window_loss = sum(window) / len(window)
            if h.on_window:
                h.on_window(res.steps, window)
            if len(window) == stop.window and res.steps < stop.max_steps and (verdict := stop.verdict(res.losses)):
                res.stopped_by = verdict
                break
        if h.progress:  # before the first window is synced: the last step's loss, still a tensor (read when drawn)
            h.progress(res.steps, res.tokens, window_loss if window_loss is not None else pending[-1])
        interrupted = bool(h.should_stop and h.should_stop())
        now = clock()
        why = timer.due(res.steps, now, res.steps >= stop.max_steps, interrupted)
        if h.checkpoint and why:
            st.steps, st.tokens, st.losses, st.seconds = res.steps, res.tokens, list(res.losses), before + now - t0
            st.pending = synced() if pending else []  # never checkpoint a diverged step
            st.write_s = timer.write_s
            h.checkpoint(st, why)
            timer.written(now)
        timer.stepped(now)
        if interrupted:
            res.stopped_by = "interrupted"
            break
    if pending and res.stopped_by != "interrupted":
        res.losses.extend(synced())
    if h.progress:  # the loop's last figures whatever ended it (a stop verdict breaks before the call above): its
        h.progress(res.steps, res.tokens, res.final_loss if res.losses else None)  # train_loss, as the visit records it
    res.seconds = before + clock() - t0
    return res


def _clipped(params: list[torch.nn.Parameter], clip: float) -> torch.Tensor:
    """The gradients' total norm, clipped to ``clip`` first (0: not clipped)."""
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    if hasattr(norm, "full_tensor"):  # FSDP2 (a DTensor): the sharded gradients' norm, reduced over processes
        norm = norm.full_tensor()
    return norm


def _tokens(batch) -> int:
    """Trained tokens of a batch: a third item that says the whole batch's (counted on the host where the batch was
    read; a process of a distributed visit trains on a slice of it), else its targets that are not ``IGNORE_INDEX``
    (masked prompt positions of the supervised formats are not trained). Integer targets on a GPU are counted by
    size: counting them there would sync the device every step, so the engine passes the count instead."""
    if isinstance(batch, (tuple, list)) and len(batch) == 3 and isinstance(batch[2], int):
        return batch[2]
    targets = batch[1] if isinstance(batch, (tuple, list)) else batch
    if targets.device.type == "cpu" and not targets.is_floating_point():
        return int((targets != IGNORE_INDEX).sum())
    return int(targets.numel())
