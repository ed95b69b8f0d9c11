"""The step loop (``models.trainer.run_steps``) on its own: the plateau and budget rules, warmup and the run's
learning-rate schedule, the checkpoint cadence
(steps, seconds, a signal), interruption and a bitwise-equal continuation, and divergence detection.

Scripted losses (``batch`` is the loss value, on a parameter it does not move) give exact control of the
plateau rule; a small linear model with AdamW checks that a continued loop equals an uninterrupted one.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import types

import numpy as np
import pytest
import torch

import bcdflow.models.trainer as trainer_mod
from bcdflow.models.errors import Diverged
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.specs import loss_trend
from bcdflow.models.specs import CheckpointSchedule
from bcdflow.models.trainer import (LoopHooks, LoopState, OptimSpec, StopRule, make_optimizer, run_steps,
                                    visit_rate)


def scripted(values, **loop):
    """Run the loop on losses ``values`` (one per step); returns the result and the checkpoints it wrote."""
    w = torch.nn.Parameter(torch.zeros(1))
    spec = loop.pop("spec", OptimSpec("sgd", lr=0.0, grad_clip=0.0))
    saved: list[tuple[int, str]] = []
    batches = (torch.tensor(v) for v in values)  # one "token" per step
    stop = loop.pop("stop")
    schedule = CheckpointSchedule(loop.pop("every_steps", 0), loop.pop("every_seconds", 0.0))
    res = run_steps(lambda v: (w * 0).sum() + v, [w], batches, make_optimizer([w], spec), spec, stop,
                    LoopHooks(checkpoint=lambda st, why: saved.append((st.steps, why)), **loop), schedule=schedule)
    return res, saved


def noisy(start: float, slope: float, steps: int, sigma: float, seed: int = 0) -> list[float]:
    """A training loss: a line from ``start`` falling ``slope`` per step, plus batch-to-batch noise."""
    g = torch.Generator().manual_seed(seed)
    return [start - slope * t + sigma * float(torch.randn((), generator=g)) for t in range(steps)]


def test_plateau_fires_on_a_flat_noisy_loss_and_not_on_a_slowly_falling_one():
    rule = dict(max_steps=1000, patience=3, min_delta=0.01, window=20)  # the defaults at a window of 20
    # the noise of a 16 x 128-token batch of the tiny model on Python sources (sigma 0.19, measured)
    for seed in range(5):
        flat, _ = scripted(noisy(4.0, 0.0, 1000, 0.19, seed), stop=StopRule(**rule))
        assert flat.stopped_by == "plateau", seed
        # 0.06 lower per window (0.003 per step): slower than the noise of any one window, but still falling
        falling, _ = scripted(noisy(7.0, 0.003, 1000, 0.19, seed), stop=StopRule(**rule))
        assert (falling.stopped_by, falling.steps) == ("max_steps", 1000), seed


def test_plateau_on_exact_window_means_and_patience_zero_switches_it_off():
    values = [10.0] * 5 + [9.0] * 5 + [8.0] * 5 + [8.0] * 5 + [8.0] * 5 + [8.0] * 5 + [1.0] * 10
    # horizon: 2 windows (patience 2), half the loop once longer; the first flat pair of windows ends it
    res, _ = scripted(values, stop=StopRule(max_steps=40, patience=2, min_delta=0.5, window=5))
    assert (res.stopped_by, res.steps) == ("plateau", 20)
    assert res.losses == pytest.approx(values[:20])
    res, _ = scripted(values, stop=StopRule(max_steps=40, patience=0, min_delta=0.5, window=5))
    assert (res.stopped_by, res.steps) == ("max_steps", 40)


def test_the_budget_rule_ends_a_loop_that_falls_slower_than_the_bar():
    values = noisy(6.0, 0.01, 200, 0.05) + noisy(4.0, 0.001, 400, 0.05, seed=1)  # fast, then slow
    res, _ = scripted(values, stop=StopRule(max_steps=600, window=20, min_rate=0.004))
    assert res.stopped_by == "budget" and 200 < res.steps <= 400
    assert res.rate == pytest.approx(visit_rate(res.losses, 20))
    assert res.rate > 0.004  # its average over the loop, the fast start included
    # no bar (the first block of a run), or a bar below the slow rate: the step cap
    for bar in (None, 0.0001):
        res, _ = scripted(values, stop=StopRule(max_steps=600, window=20, min_rate=bar))
        assert res.stopped_by == "max_steps", bar


def test_loss_trend_is_the_least_squares_line():
    slope, se = loss_trend([5.0 - 0.5 * t for t in range(10)], 10)
    assert slope == pytest.approx(-0.5) and se == pytest.approx(0.0, abs=1e-12)
    slope, se = loss_trend([0.0, 1.0, 0.0, 1.0, 9.0, 9.0], 4)  # the last 4: numpy's fit of [0, 1, 9, 9]
    (ref, _), cov = np.polyfit(np.arange(4), [0.0, 1.0, 9.0, 9.0], 1, cov="unscaled")
    resid = np.array([0.0, 1.0, 9.0, 9.0]) - np.polyval(np.polyfit(np.arange(4), [0.0, 1.0, 9.0, 9.0], 1), np.arange(4))
    assert slope == pytest.approx(ref) and se == pytest.approx(np.sqrt(cov[0, 0] * (resid ** 2).sum() / 2))


def test_cosine_schedule_decays_over_the_run_across_loops():
    spec = OptimSpec("adamw", lr=1.0, schedule="cosine", total_steps=100, min_lr_ratio=0.1, warmup_steps=2)
    assert spec.lr_at(5, 0) == pytest.approx(1.0)
    assert spec.lr_at(5, 50) == pytest.approx(0.55)
    assert spec.lr_at(5, 100) == pytest.approx(0.1) and spec.lr_at(5, 300) == pytest.approx(0.1)
    assert spec.lr_at(0, 50) == pytest.approx(0.275)  # the warmup of a visit multiplies the run's decay
    # a loop started at global step 50 sees the run's clock, not its own
    w = torch.nn.Parameter(torch.ones(2))
    opt = make_optimizer([w], spec)
    seen = []

    def loss_fn(_):
        seen.append(opt.param_groups[0]["lr"])
        return (w ** 2).sum()

    run_steps(loss_fn, [w], itertools.repeat(torch.zeros(1)), opt, dataclasses.replace(spec, first_step=50),
              StopRule(max_steps=3, window=3))
    assert seen == pytest.approx([spec.lr_at(i, 50 + i) for i in range(3)])
    assert OptimSpec("adamw", lr=2.0, lr_scale=0.5).base_lr == 1.0


def test_cosine_decays_over_the_planned_steps_the_baseline_and_bcd_share():
    """Issue 25: ``optim.decay_steps`` (default ``train.steps``) is the one clock of both modes, not BCD's cap of
    cycles x blocks x max_steps: a BCD run that stops at a target decays as the baseline does."""
    from bcdflow.core.config import load_config
    from bcdflow.flows.bcd import full_config

    cfg = load_config(sets=["optim.schedule=cosine", "train.steps=600", "bcd.cycles=20", "bcd.max_steps=80"])
    assert cfg.optim_spec(0).total_steps == full_config(cfg).optim_spec().total_steps == 600
    cfg = load_config(sets=["optim.schedule=cosine", "optim.decay_steps=1500", "bcd.cycles=20"])
    assert cfg.optim_spec(1).total_steps == full_config(cfg).optim_spec().total_steps == 1500


def test_a_param_groups_lr_ratio_follows_the_schedule():
    """A second parameter group (``bcd.expand``'s adapters) keeps its rate's ratio to the block's through warmup."""
    w, a = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    spec = OptimSpec("adamw", lr=0.1, warmup_steps=2)
    opt = make_optimizer([w], spec)
    opt.add_param_group({"params": [a], "lr": 0.5, "lr_ratio": 5.0})
    seen = []

    def loss_fn(_):
        seen.extend(g["lr"] for g in opt.param_groups)
        return (w ** 2).sum() + (a ** 2).sum()

    run_steps(loss_fn, [w], itertools.repeat(torch.zeros(1)), opt, spec, StopRule(max_steps=3, window=3), extra=[a])
    assert seen == pytest.approx([0.05, 0.25, 0.1, 0.5, 0.1, 0.5])


def test_warmup_ramps_the_learning_rate_linearly():
    w = torch.nn.Parameter(torch.ones(2))
    spec = OptimSpec("adamw", lr=0.1, warmup_steps=4)
    opt = make_optimizer([w], spec)
    seen = []

    def loss_fn(_):
        seen.append(opt.param_groups[0]["lr"])
        return (w ** 2).sum()

    run_steps(loss_fn, [w], itertools.repeat(torch.zeros(1)), opt, spec, StopRule(max_steps=7, window=7))
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1])


def test_checkpoint_cadence_by_steps_never_at_the_last_step():
    _, saved = scripted([1.0] * 10, stop=StopRule(max_steps=10, window=5), every_steps=3)
    assert saved == [(3, "steps"), (6, "steps"), (9, "steps")]


def test_checkpoint_cadence_by_seconds(monkeypatch):
    clock = itertools.count()  # every perf_counter() call is one second later
    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    _, saved = scripted([1.0] * 10, stop=StopRule(max_steps=10, window=5), every_seconds=2.5)
    assert saved == [(3, "seconds"), (6, "seconds"), (9, "seconds")]


def _timed_run(share: float, stop_at: int | None = None, every: int = 1, state=None) -> list[tuple[int, str]]:
    """30 steps of 1 s each, a checkpoint due every ``every`` steps, each taking 9 s to write (the loop's clock)."""
    t = [0.0]
    saved: list[tuple[int, str]] = []

    def step(v):
        t[0] += 1.0
        return (w * 0).sum() + v

    def checkpoint(st, why):
        saved.append((st.steps, why))
        t[0] += 9.0

    w = torch.nn.Parameter(torch.zeros(1))
    spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
    hooks = LoopHooks(checkpoint=checkpoint, clock=lambda: t[0],
                      should_stop=(lambda: len(saved) and t[0] >= stop_at) if stop_at else None)
    run_steps(step, [w], (torch.tensor(1.0) for _ in range(30)), make_optimizer([w], spec), spec,
              StopRule(max_steps=30, window=5), hooks, state, CheckpointSchedule(every, max_share=share))
    return saved


def test_checkpoints_take_at_most_their_share_of_the_time():
    """checkpoint.max_share: a write of 9 s (timed to the next step's end, less a step) holds the next checkpoint
    back for 9 s of training at a share of 0.5: 9 s of every 19 go to checkpoints, not 9 of every 10."""
    assert _timed_run(1.0) == [(s, "steps") for s in range(1, 30)]
    assert _timed_run(0.5) == [(1, "steps"), (11, "steps"), (21, "steps")]
    # one due while held is written when the hold ends (step 14), not dropped until the next multiple of 4 (16)
    assert _timed_run(0.5, every=4) == [(4, "steps"), (14, "steps"), (24, "steps")]
    # the hold survives a restart: a loop resumed from a state whose last write took 9 s waits 9 s before its first
    assert _timed_run(0.5, state=LoopState(write_s=9.0))[0] == (9, "steps")
    # a signal's checkpoint is never held back: SIGTERM at t >= 12 (step 3, within the hold) checkpoints there
    assert _timed_run(0.5, stop_at=12) == [(1, "steps"), (3, "signal")]


def _linear_run(state=None, stop_after=None, saved=None, start=0):
    """A small regression with AdamW, batches by index; stops (as on a signal) after ``stop_after`` steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(12)]
    spec = OptimSpec("adamw", lr=0.05, warmup_steps=3)
    opt = make_optimizer(list(model.parameters()), spec)
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    calls = itertools.count(start + 1)
    ckpts = []

    def checkpoint(st, why):
        ckpts.append({"why": why, "state": LoopState.from_dict(st.to_dict()),
                      "model": {k: v.clone() for k, v in model.state_dict().items()},
                      "opt": copy.deepcopy(opt.state_dict())})

    res = run_steps(lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]), list(model.parameters()),
                    iter(data[start:]), opt, spec, StopRule(max_steps=12, window=5),
                    LoopHooks(checkpoint=checkpoint,
                              should_stop=(lambda: next(calls) >= stop_after) if stop_after else None),
                    state, CheckpointSchedule(every_steps=100))
    return res, model, ckpts


def test_interruption_checkpoints_once_and_the_continuation_is_bitwise_equal():
    full, model_full, _ = _linear_run()
    part, _, ckpts = _linear_run(stop_after=7)
    assert (part.stopped_by, part.steps) == ("interrupted", 7)
    (ck,) = ckpts
    assert ck["why"] == "signal" and ck["state"].steps == 7 and len(ck["state"].pending) == 2  # mid-window
    rest, model_rest, _ = _linear_run(state=ck["state"], saved=ck, start=7)
    assert (rest.stopped_by, rest.steps) == ("max_steps", 12)
    assert rest.losses == full.losses and rest.tokens == full.tokens
    for a, b in zip(model_full.parameters(), model_rest.parameters()):
        assert torch.equal(a, b)


def test_a_non_finite_loss_raises_diverged_before_it_is_checkpointed():
    values = [1.0, 1.0, float("nan"), 1.0, 1.0, 1.0]
    with pytest.raises(Diverged) as e:
        scripted(values, stop=StopRule(max_steps=6, window=5), every_steps=1)
    assert e.value.step == 3 and "training diverged at step 3: loss nan" in str(e.value)
    # the checkpoints of steps 1 and 2 were written; step 3's never was
    saved: list = []
    w = torch.nn.Parameter(torch.zeros(1))
    spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
    with pytest.raises(Diverged):
        run_steps(lambda v: (w * 0).sum() + v, [w], (torch.tensor(v) for v in values), make_optimizer([w], spec),
                  spec, StopRule(max_steps=6, window=5), LoopHooks(checkpoint=lambda st, why: saved.append(st.steps)),
                  schedule=CheckpointSchedule(every_steps=1))
    assert saved == [1, 2]


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_an_infinite_gradient_with_a_finite_loss_raises_diverged(clip):
    w = torch.nn.Parameter(torch.zeros(3))  # d/dw sqrt(w) at 0 is inf; the loss itself is 0
    spec = OptimSpec("sgd", lr=0.1, grad_clip=clip)
    with pytest.raises(Diverged) as e:
        run_steps(lambda _: w.sqrt().sum(), [w], itertools.repeat(torch.zeros(1)), make_optimizer([w], spec), spec,
                  StopRule(max_steps=4, window=2))
    assert e.value.step == 1 and e.value.loss == 0.0 and not torch.isfinite(torch.tensor(e.value.grad_norm))


@pytest.mark.parametrize("name", sorted(n for n, o in OPTIMIZERS.items() if not o.peer))
def test_each_registered_optimizer_is_offered_built_and_counted_as_it_holds_state(name):
    """models/optimizers.py is the one home of an optimizer: the config offers its name, an unset optim.lr is its
    paper default, and the planner's state count is the parameter-sized state tensors the built optimizer holds.
    (The peers, whose state is a block's, sampled layers' or projected: tests/test_peers.py.)"""
    from typing import get_args

    from bcdflow.core.config import OptimSection, load_config

    assert get_args(OptimSection.model_fields["name"].annotation) == tuple(OPTIMIZERS)
    cfg = load_config(sets=[f"optim.name={name}"])
    assert OptimSpec(cfg.optim.name).base_lr == OPTIMIZERS[name].paper_lr
    lin = torch.nn.Linear(8, 8, bias=False)
    opt = make_optimizer(list(lin.parameters()), OptimSpec(name))
    lin(torch.randn(2, 8)).square().sum().backward()
    opt.step()
    state = opt.state[lin.weight]
    assert sum(1 for t in state.values() if torch.is_tensor(t) and t.shape == lin.weight.shape) == \
        OPTIMIZERS[name].state
