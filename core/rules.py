"""The method's rules (paper Algorithm 1; docs/DESIGN.md §2): pure functions of the run config and the committed visit
records, each named for what it decides. No Prefect, no store, no device: the flows only wire them, and their tests
call them directly.

    rows = visit_rows(cfg, n_train, cycle, block)            # §2.1 which rows a visit trains on (paper §3.2.3)
    n = visit_row_count(cfg, n_train)                        # how many, for the run planner (core/forecast.py)
    for lo, hi in batch_ranges(len(rows), bs, seed, c, b):   # §2.1 the order it reads them in, epoch by epoch
    todo = blocks_to_visit(cfg, n_blocks, cycle, done)       # §2.9 which blocks are left in a cycle, in order
    bar = rate_to_beat(visits, block)                        # §2.3 the adaptive budget's bar for a visit
    spec = visit_spec(cfg, state, cycle, block, clock)       # §2.3 what the run's state hands a visit (VisitSpec)
    stop = stop_reason(cfg, visits, n_blocks, next_block=b)  # §2.8 whether the run stops before that visit

The step loop's own stop rule (a visit's local convergence: step cap, plateau, the bar above) is
``models/trainer.StopRule``, which the loop reads every window.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from bcdflow.core import spend
from bcdflow.core.config import RunConfig
from bcdflow.core.orders import ORDERS
from bcdflow.storage.runs import RunState, VisitRecord


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *keys]))


# -- row sampling (paper §3.2.3) ----------------------------------------------------------------------------------

def sample_rows(n_train: int, rate: float, seed: int, cycle: int, block: int) -> np.ndarray:
    """Indices of the visit's training rows, in training order: (n,) int64. Each visit trains on a fresh random
    subset at rate ``bcd.sample_rate``, seeded by (run seed, cycle, block), so a resumed or repeated run samples the
    same rows."""
    n = max(1, int(round(rate * n_train)))
    return _rng(seed, cycle, block).permutation(n_train)[:n]


def visit_rows(cfg: RunConfig, n_train: int, cycle: int, block: int) -> np.ndarray:
    """The rows a visit can actually reach: its sample, cut to ``max_steps * batch_size`` rows.

    The first epoch reads the sample in order, so rows past the step cap are never trained on;
    pre-inferring them would be pure waste (the paper pre-infers the whole subset)."""
    rows = sample_rows(n_train, cfg.bcd.sample_rate, cfg.seed, cycle, block)
    return rows[: cfg.bcd.max_steps * cfg.train.batch_size]


def visit_row_count(cfg: RunConfig, n_train: int) -> int:
    """``len(visit_rows(cfg, n_train, c, b))`` for any visit, without drawing the sample (the run planner,
    core/forecast.py)."""
    return min(max(1, int(round(cfg.bcd.sample_rate * n_train))), cfg.bcd.max_steps * cfg.train.batch_size)


def batch_ranges(n_rows: int, batch_size: int, seed: int, cycle: int, block: int) -> Iterator[tuple[int, int]]:
    """Endless contiguous row ranges [lo, hi) over the visit's rows; each epoch visits the batches in
    a new order. Contiguous ranges keep activation reads whole-chunk (no random row gathers)."""
    starts = list(range(0, n_rows, batch_size))
    epoch = 0
    while True:
        order = starts if epoch == 0 else [starts[i] for i in _rng(seed, cycle, block, epoch).permutation(len(starts))]
        for lo in order:
            yield lo, min(n_rows, lo + batch_size)
        epoch += 1


# -- block orders (docs/DESIGN.md §2.9) ---------------------------------------------------------------------------

def cycle_order(cfg: RunConfig, n_blocks: int, cycle: int) -> list[int]:
    """The blocks of ``cycle`` in the order ``bcd.order`` visits them (``greedy``: chosen visit by visit instead)."""
    return ORDERS[cfg.bcd.order](cfg.seed, n_blocks, cycle)


def blocks_to_visit(cfg: RunConfig, n_blocks: int, cycle: int, done: set[tuple[int, int]]) -> list[int]:
    """The blocks of ``cycle`` not yet committed (``done``: (cycle, block) pairs), in visiting order: the next one is
    the first, unless ``greedy`` picks among them."""
    return [b for b in cycle_order(cfg, n_blocks, cycle) if (cycle, b) not in done]


# -- a visit's budget (docs/DESIGN.md §2.3) ----------------------------------------------------------------------

def rate_to_beat(visits: list[VisitRecord], block: int) -> float | None:
    """The adaptive budget's bar for a visit of ``block`` (``bcd.budget``): the mean rate at which the other blocks
    lowered the training loss over their last visits; None while no other block has one (the visit then runs to
    its step cap or plateau). Read from the committed state, so a resumed visit gets the same bar."""
    last: dict[int, float] = {}
    for v in visits:
        if v.block != block and v.rate is not None:
            last[v.block] = v.rate
    return sum(last.values()) / len(last) if last else None


# -- what a visit starts from (docs/DESIGN.md §2.3) ----------------------------------------------------------------

@dataclass(frozen=True)
class VisitSpec:
    """One visit as its flow hands it to training (``tasks/train.train_block``, ``tasks/train_dist.launch``, whose
    ``spec.json`` carries it, ``tasks/engine.run_visit``): which visit, on which version, and what the run's committed
    state says it starts from (:func:`visit_spec`). A new input a visit takes from the run is a field here."""
    cycle: int
    block: int
    version: int
    """The version it trains on (the run's last committed one)."""
    global_step: int = 0
    """The run's steps before this visit: the learning-rate schedule's clock."""
    min_rate: float | None = None
    """``bcd.budget=adaptive``: the rate to beat (:func:`rate_to_beat`); None: no such rule."""
    moments: dict | None = None
    """``bcd.moments=keep``: the optimizer state the block's last visit ended with (a block file's manifest entry)."""
    clock: dict | None = None
    """What the visit's earlier attempts spent, and this attempt's start (``core/spend.Earlier.clock``): each
    mid-visit checkpoint carries its reading, so a resumed visit is billed for them."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VisitSpec":
        return cls(**d)


def visit_spec(cfg: RunConfig, state: RunState, cycle: int, block: int, clock: dict | None = None) -> VisitSpec:
    """Visit (``cycle``, ``block``) of a run whose committed state is ``state``: on its version, after its steps,
    against the adaptive budget's bar, from the block's kept moments (as the config asks); ``clock``: the visit's
    earlier attempts' (``core/spend.Earlier.clock``). Read from the committed state, so a resumed or dispatched visit
    gets the same inputs."""
    moments = next((v.moments for v in reversed(state.visits) if v.block == block), None)
    return VisitSpec(cycle, block, state.version, global_step=state.steps,
                     min_rate=rate_to_beat(state.visits, block) if cfg.bcd.budget == "adaptive" else None,
                     moments=moments if cfg.bcd.moments == "keep" else None, clock=clock)


# -- the run's stop rules (docs/DESIGN.md §2.8) -------------------------------------------------------------------

# Why a run stopped (``stop_reason``'s and ``end_reason``'s first element, ``state.json``'s ``stop_reason``): every
# table of reasons is keyed by these. In words for a person (the run's last log line, its Prefect artifacts and its
# MLflow description: ``stop_words``), and what trains a run stopped for it further (``bcdflow resume`` of a done run)
TARGET, NO_IMPROVEMENT, BUDGET, CYCLES = "target_val_loss", "no_improvement", "budget", "cycles"
STOP_WORDS = {
    TARGET: "its validation loss reached stop.target_val_loss",
    NO_IMPROVEMENT: "stop.patience_cycles whole cycles in a row brought no new best validation loss",
    BUDGET: "the next visit's predicted spend would exceed what is left of spend.budget_usd",
    CYCLES: "every planned cycle (bcd.cycles) is done",
}
# a baseline (mode "full") is one visit of up to train.steps steps: it has no cycles of its own to speak of
BASELINE_STOP_WORDS = {CYCLES: "its one visit is done (train.steps steps, or fewer where train.patience found a "
                                       "plateau)"}
FURTHER = {TARGET: "--set stop.target_val_loss=<lower>", NO_IMPROVEMENT: "--set stop.patience_cycles=<more, or 0>",
           BUDGET: "--set spend.budget_usd=<more>", CYCLES: "--set bcd.cycles=<more>"}


def stop_words(reason: str, mode: str = "bcd") -> str:
    """A run's stop ``reason`` said in words (an unknown one as it is); ``mode``: the run's, a baseline ("full") says
    its own keys."""
    return (mode == "full" and BASELINE_STOP_WORDS.get(reason)) or STOP_WORDS.get(reason, reason)


def stale_cycles(visits: list[VisitRecord], n_blocks: int, min_delta: float = 0.0) -> int:
    """How many of the latest completed cycles in a row brought no new best validation loss."""
    by_cycle: dict[int, list[float]] = {}
    for v in visits:
        by_cycle.setdefault(v.cycle, []).append(v.val_loss)
    best, stale = float("inf"), 0
    for c in sorted(by_cycle):
        if len(by_cycle[c]) < n_blocks:  # the cycle in progress does not count yet
            break
        stale = 0 if min(by_cycle[c]) < best - min_delta else stale + 1
        best = min(best, *by_cycle[c])
    return stale


def stop_reason(cfg: RunConfig, visits: list[VisitRecord], n_blocks: int,
                next_block: int | None = None) -> tuple[str, str] | None:
    """The global stop rule that holds now, as (reason, detail), or None to go on.

    Checked between visits, so whichever rule is met first ends the run; when several hold at once the
    precedence is: ``target_val_loss`` (the goal is reached), ``no_improvement`` (``stop.patience_cycles``
    completed cycles without a new best), ``budget`` (the visit of ``next_block`` would overspend)."""
    st = cfg.stop
    best = min((v.val_loss for v in visits), default=float("inf"))
    if st.target_val_loss is not None and best <= st.target_val_loss:
        return TARGET, f"validation loss {best:.4f} <= target {st.target_val_loss:g}"
    if st.patience_cycles and (n := stale_cycles(visits, n_blocks, st.min_delta)) >= st.patience_cycles:
        return NO_IMPROVEMENT, f"{n} whole cycle(s) without a validation loss below {best:.4f}"
    if next_block is not None and (why := spend.over_budget(cfg.spend, visits, next_block)):
        return BUDGET, why
    return None


def end_reason(cfg: RunConfig, visits: list[VisitRecord], n_blocks: int, mode: str = "bcd") -> tuple[str, str]:
    """Why a run whose loop ended stopped: a rule of :func:`stop_reason`, else every cycle was done (a baseline,
    ``mode`` "full": its steps of ``train.steps``, which its config carries as ``bcd.max_steps``)."""
    done = f"{sum(v.steps for v in visits)} of train.steps={cfg.bcd.max_steps} steps trained" if mode == "full" else \
        f"{cfg.bcd.cycles} cycle(s) done"
    return stop_reason(cfg, visits, n_blocks) or (CYCLES, done)
