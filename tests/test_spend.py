"""Spend (docs/DESIGN.md §7): price catalog, per-stage arithmetic, the cost curve, the budget rule, and the
global stop rules' precedence; end to end, a budget that stops a run cleanly and a resume that lifts it."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from bcdflow.models.errors import ConfigError
from bcdflow.storage import runs
from bcdflow.storage.store import Store
from bcdflow.core import spend
from bcdflow.core.config import SpendSection, load_config
from tests.helpers import visit_record as _v


def test_catalog_defaults_overrides_and_additions():
    assert spend.catalog(SpendSection()) == {"rtx4090": 0.29, "a800": 0.69, "a100": 1.20}
    sp = load_config(sets=["spend.prices=[a100=1.0, h100=2.49]"]).spend
    assert spend.catalog(sp) == {"rtx4090": 0.29, "a800": 0.69, "a100": 1.0, "h100": 2.49}
    # a YAML mapping, --set section.prices.KIND=USD and a comma list all land as KIND=USD strings
    assert load_config(sets=["spend.prices.h100=2.49"]).spend.prices == ["h100=2.49"]
    assert load_config(sets=["spend.prices=h100=2.49,l4=0.8"]).spend.prices == ["h100=2.49", "l4=0.8"]


@pytest.mark.parametrize("bad,key", [
    ("spend.train_device=h100", "spend.train_device"),           # not in the catalog
    ("spend.prices=[h100]", "spend.prices"),                     # no price
    ("spend.prices=[h100=cheap]", "spend.prices"),
    ("spend.prices=[h100=-1]", "spend.prices"),
    ("spend.eval_gpus=0", "spend.eval_gpus"),
    ("spend.budget_usd=0", "spend.budget_usd"),
    ("stop.patience_cycles=-1", "stop.patience_cycles"),
])
def test_bad_spend_config_names_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(sets=[bad])


def test_stage_spend_is_seconds_times_gpus_times_price():
    sp = load_config(sets=["spend.prices=[h100=2.0]", "spend.preinfer_device=a100", "spend.preinfer_gpus=2",
                           "spend.train_device=rtx4090", "spend.eval_device=h100", "spend.eval_gpus=4"]).spend
    out = spend.visit_spend(sp, {"preinfer": 3600, "train": 1800, "eval": 360}, 3600 + 1800 + 360)
    assert out["spend_preinfer_usd"] == pytest.approx(1 * 2 * 1.20)
    assert out["spend_train_usd"] == pytest.approx(0.5 * 1 * 0.29)
    assert out["spend_eval_usd"] == pytest.approx(0.1 * 4 * 2.0)
    assert out["spend_usd"] == pytest.approx(2.4 + 0.145 + 0.8)
    assert out["gpu_hours_preinfer"] == pytest.approx(2.0)
    assert out["gpu_hours"] == pytest.approx(2.0 + 0.5 + 0.4)
    # the visit's wall time outside its stages is billed to the train machine
    late = spend.visit_spend(sp, {"preinfer": 3600, "train": 1800, "eval": 360}, 3600 + 1800 + 360 + 1800)
    assert late["spend_train_usd"] == pytest.approx(1.0 * 1 * 0.29)


def test_unset_gpu_counts_bill_what_the_run_uses():
    """spend.*_gpus unset: a visit's box has train.gpus GPUs for all its stages; pre-inference on a local Dask
    cluster bills its workers. Set, the spend section wins."""
    cfg = load_config(sets=["train.gpus=2", "train.batch_size=4"])
    assert spend.gpus_used(cfg) == {"preinfer": 2, "train": 2, "eval": 2}
    out = spend.visit_spend(cfg.spend, {"preinfer": 3600, "train": 3600, "eval": 0}, 7200, spend.gpus_used(cfg))
    assert out["gpu_hours"] == pytest.approx(4.0) and out["spend_usd"] == pytest.approx(4 * 0.29)
    dask = load_config(sets=["fleet.preinfer=dask", "fleet.dask_workers=3", "spend.train_gpus=8"])
    plan = spend.stage_plan(dask.spend, spend.gpus_used(dask))
    assert plan == {"preinfer": ("rtx4090", 3), "train": ("rtx4090", 8), "eval": ("rtx4090", 1)}
    assert spend.stage_plan(SpendSection()) == {s: ("rtx4090", 1) for s in spend.STAGES}


def test_budget_predicts_from_the_same_block_else_the_last_visit():
    sp = load_config(sets=["spend.prices=[a100=3600]", "spend.train_device=a100", "spend.budget_usd=10"]).spend
    # $1 per train-second: visits of block 0 cost 3, block 1 costs 1
    visits = [_v(sp, 0, 0, train=3), _v(sp, 0, 1, train=1)]
    assert spend.predicted_cost(visits, 0) == pytest.approx(3)
    assert spend.predicted_cost(visits, 1) == pytest.approx(1)
    assert spend.predicted_cost(visits, 2) == pytest.approx(1)  # never visited: the last visit
    assert spend.predicted_cost([], 0) == 0
    # spent 4 of 10: block 0 (3) fits, and so does block 2 (1)
    assert spend.over_budget(sp, visits, 0) is None
    visits.append(_v(sp, 0, 2, train=4.5))  # spent 8.5, 1.5 left
    assert spend.over_budget(sp, visits, 1) is None          # predicted 1 <= 1.5
    assert "block 0" in spend.over_budget(sp, visits, 0)     # predicted 3 > 1.5
    assert spend.over_budget(SpendSection(), visits, 0) is None  # no budget, no limit


def test_curve_is_cumulative_and_costs_intermediate_points_pro_rata():
    sp = load_config(sets=["spend.prices=[a100=3600]", "spend.train_device=a100"]).spend
    visits = [_v(sp, 0, 0, train=10, steps=10, step_end=10, tokens=100, seconds=12, val=4.0),
              _v(sp, 1, 0, train=20, steps=20, step_end=30, tokens=200, seconds=22, val=3.0,
                 val_points=[[15, 3.5], [30, 2.9]])]
    pts = spend.curve(visits)
    assert [p["step"] for p in pts] == [10, 15, 30]
    assert [p["val_loss"] for p in pts] == [4.0, 3.5, 3.0]  # the visit's own val loss at its end
    assert pts[1]["tokens"] == pytest.approx(100 + 200 * 5 / 20)
    # a visit's wall time outside its stages is billed to the train machine: 12 s and 22 s, not 10 and 20
    assert pts[1]["spend_usd"] == pytest.approx(12 + 22 * 5 / 20)
    assert pts[2]["spend_usd"] == pytest.approx(34)
    assert pts[2]["seconds"] == pytest.approx(34)
    assert pts[2]["gpu_hours"] == pytest.approx(34 / 3600)


def test_an_interrupted_loop_counts_the_seconds_of_every_attempt():
    """Issue 28: a resumed visit's train_seconds counted only the time after the resume while its tokens counted the
    whole visit (2373 tok/s recorded where the bar showed ~1k). The loop's seconds travel in its checkpointed state:
    each step takes 1 s here, so 4 steps, an interruption, and 6 more are 10 s whatever each attempt's clock says."""
    import torch

    from bcdflow.models.trainer import LoopHooks, LoopState, OptimSpec, StopRule, make_optimizer, run_steps

    def attempt(state, stop_after, t0):
        t = [t0]
        w = torch.nn.Parameter(torch.zeros(1))
        spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
        saved = []

        def loss(b):
            t[0] += 1.0
            return (w * 0).sum() + 1.0
        calls = itertools.count(1)
        hooks = LoopHooks(clock=lambda: t[0], checkpoint=lambda st, why: saved.append(LoopState.from_dict(st.to_dict())),
                          should_stop=(lambda: next(calls) >= stop_after) if stop_after else None)
        res = run_steps(loss, [w], itertools.repeat(torch.zeros(1)), make_optimizer([w], spec), spec,
                        StopRule(max_steps=10, window=5), hooks, state)
        return res, saved

    first, (ck,) = attempt(None, 4, t0=100.0)
    assert (first.stopped_by, ck.steps, ck.seconds) == ("interrupted", 4, 4.0)
    rest, _ = attempt(LoopState.from_dict(ck.to_dict()), None, t0=5000.0)  # another process, another clock
    assert (rest.steps, rest.seconds) == (10, 10.0)


def test_earlier_attempts_of_a_visit_are_billed_and_lost_work_is_said_apart():
    """What a resumed visit had spent: the checkpoint's reading (``spent_at``), what the previous attempt knew when
    it started, and that attempt's seconds after the last known point up to the last write of its visit lease (a
    kill -9 stops the renewals; SIGTERM checkpoints at the signal, so nothing is lost)."""
    first = spend.Earlier().clock(preinfer=3.0, since=1000.0)  # attempt 1 started at t=1000, pre-inferred 3 s
    ck = spend.spent_at(first, now=1050.0)  # its checkpoint at t=1050
    assert ck == {"wall": 50.0, "preinfer": 3.0, "lost": 0.0, "at": 1050.0}
    started = {"wall": 0.0, "preinfer": 0.0, "lost": 0.0, "at": 1000.0}
    # kill -9 at t~1070: its lease was last renewed at t=1068: 18 s after the checkpoint are lost
    e = spend.earlier_attempts(ck, started, previous_end=1068.0)
    assert (e.wall, e.preinfer, e.lost) == (68.0, 3.0, 18.0)
    # SIGTERM: the checkpoint is written at the signal and the lease released right after
    assert spend.earlier_attempts(ck, started, previous_end=1050.2).lost == pytest.approx(0.2)
    # attempt 2 (started at t=2000 knowing e) killed at t~2030 before any checkpoint of its own
    e2 = spend.earlier_attempts(ck, {**dataclasses.asdict(e), "at": 2000.0}, previous_end=2030.0)
    assert (e2.wall, e2.lost) == (98.0, 48.0)
    # the first attempt of a visit: nothing before it
    assert spend.earlier_attempts(None, None, None) == spend.Earlier()
    # priced: pre-inference at its kind, the rest (lost seconds included) at training's
    sp = load_config(sets=["spend.preinfer_device=a100"]).spend
    assert spend.earlier_usd(sp, e) == pytest.approx((3.0 * 1.20 + 65.0 * 0.29) / 3600)


@pytest.mark.slow
def test_budget_stops_cleanly_and_resume_with_more_budget_finishes(tiny_cfg, prefect_server):
    from bcdflow.flows.bcd import bcd_train

    # a budget far below one visit's spend: the first visit runs (nothing predicts it), the second would
    # exceed what is left, so the run stops cleanly at version 1
    cfg = tiny_cfg("spend.budget_usd=1e-9", "spend.train_device=a100", "spend.train_gpus=2")
    out = bcd_train(config=cfg, run_id="b")
    assert out["stop_reason"] == "budget" and out["version"] == 1
    store = Store(cfg.store)
    state = runs.read_state(store, "b")
    assert state.status == "done" and state.stop_reason == "budget" and len(state.visits) == 1
    assert "block 1" in state.stop_detail
    (v,) = state.visits
    # the train machine is billed for the visit's wall time outside the pre-inference and eval stages
    train_wall = v.seconds - v.preinfer_seconds - v.eval_seconds
    assert train_wall >= v.train_seconds
    assert v.spend_train_usd == pytest.approx(train_wall * 2 * 1.20 / 3600)
    assert v.spend_preinfer_usd == 0 and v.preinfer_seconds == 0  # block 0 needs no pre-inference
    assert v.spend_eval_usd == pytest.approx(v.eval_seconds * 0.29 / 3600)
    assert v.cum_spend_usd == pytest.approx(v.spend_usd) and v.spend_usd > 0
    assert v.gpu_hours == pytest.approx((2 * train_wall + v.eval_seconds) / 3600)

    # the same run with room in the budget continues where it stopped
    more = tiny_cfg("spend.budget_usd=100", "spend.train_device=a100", "spend.train_gpus=2")
    out = bcd_train(config=more, run_id="b")
    assert out["stop_reason"] == "cycles" and out["version"] == 3
    visits = runs.read_state(store, "b").visits
    assert [x.block for x in visits] == [0, 1, 2]
    assert visits[1].spend_preinfer_usd > 0  # block 1 pre-infers block 0's activations
    cum = [x.cum_spend_usd for x in visits]
    assert cum == pytest.approx(list(itertools.accumulate([x.spend_usd for x in visits])))
    assert math.isclose(out["spend_usd"], cum[-1])


def test_every_priced_kind_has_the_time_models_rates():
    """A kind of the price catalog is one the planner can time (models/specs.CARD_RATES), the default kind included;
    the rates know more kinds than the paper priced (an H100 is priced by the run)."""
    from bcdflow.models.specs import CARD_RATES, DEFAULT_CARD

    assert set(spend.DEFAULT_PRICES) <= set(CARD_RATES) and spend.DEFAULT_KIND == DEFAULT_CARD
    assert {"h100", "h200"} <= set(CARD_RATES) - set(spend.DEFAULT_PRICES)
