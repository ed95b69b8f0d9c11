"""The method's rules (core/rules.py, core/orders.py): which rows a visit samples and in what order, which blocks a
cycle visits, the adaptive budget's bar, when the run stops. Pure functions on the config and visit records: nothing
here imports Prefect or opens a store."""
from __future__ import annotations

import json
import subprocess
import sys
import typing

import numpy as np
import pytest

from bcdflow.core.config import BcdSection, load_config
from bcdflow.core.orders import ORDERS
from bcdflow.core.rules import (batch_ranges, blocks_to_visit, cycle_order, end_reason, rate_to_beat, sample_rows,
                                stale_cycles, stop_reason, visit_rows)
from tests.helpers import TINY, visit_record as _v


def test_the_rules_import_no_prefect():
    code = "import sys, bcdflow.core.rules, bcdflow.tasks.engine; print(sorted(m for m in sys.modules if m.startswith('prefect')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# -- per-visit sampling (paper §3.2.3) ------------------------------------------------------------

@pytest.mark.parametrize("n,rate", [(100, 0.9), (101, 0.5), (7, 1.0), (10, 0.01)])
def test_sample_rows_deterministic_sized_and_distinct(n, rate):
    a = sample_rows(n, rate, seed=0, cycle=1, block=2)
    assert np.array_equal(a, sample_rows(n, rate, seed=0, cycle=1, block=2))  # deterministic
    assert len(a) == max(1, round(rate * n))
    assert len(np.unique(a)) == len(a) and a.min() >= 0 and a.max() < n  # a subset, no repeats
    assert a.dtype.kind == "i"


def test_sample_rows_differ_across_visits_and_seeds():
    n, rate = 200, 0.9
    keys = [(0, c, b) for c in range(2) for b in range(3)] + [(1, 0, 0)]
    samples = {k: sample_rows(n, rate, *k) for k in keys}
    for i, ka in enumerate(keys):
        for kb in keys[i + 1:]:
            assert not np.array_equal(samples[ka], samples[kb]), (ka, kb)
    # at rate 1 every row is drawn, still in a visit-specific order
    full = sample_rows(n, 1.0, 0, 0, 0)
    assert sorted(full.tolist()) == list(range(n))
    assert not np.array_equal(full, sample_rows(n, 1.0, 0, 0, 1))


def test_visit_rows_is_the_sample_cut_to_the_step_cap():
    cfg = load_config(sets=TINY)
    rows = visit_rows(cfg, 1000, cycle=0, block=1)
    assert np.array_equal(rows, sample_rows(1000, cfg.bcd.sample_rate, cfg.seed, 0, 1)[: 6 * 8])


@pytest.mark.parametrize("n_rows,bs", [(48, 8), (50, 8), (5, 8), (64, 64)])
def test_batch_ranges_cover_every_row_each_epoch(n_rows, bs):
    n_batches = -(-n_rows // bs)
    it = batch_ranges(n_rows, bs, seed=0, cycle=0, block=1)
    epochs = [[next(it) for _ in range(n_batches)] for _ in range(4)]
    for ep in epochs:
        covered = np.zeros(n_rows, dtype=int)
        for lo, hi in ep:
            assert 0 <= lo < hi <= n_rows and hi - lo <= bs
            covered[lo:hi] += 1
        assert (covered == 1).all()  # every row exactly once per epoch
    assert [lo for lo, _ in epochs[0]] == list(range(0, n_rows, bs))  # epoch 0 in order
    if n_batches > 2:
        assert any(ep != epochs[0] for ep in epochs[1:])  # later epochs reshuffle batches
    # deterministic per (seed, cycle, block)
    again = batch_ranges(n_rows, bs, seed=0, cycle=0, block=1)
    assert [next(again) for _ in range(4 * n_batches)] == [r for ep in epochs for r in ep]


# -- block orders (docs/DESIGN.md §2.9) ---------------------------------------------------------------------------

def test_the_config_accepts_exactly_the_registered_orders():
    assert typing.get_args(BcdSection.model_fields["order"].annotation) == tuple(ORDERS)


def test_cycle_orders_and_the_blocks_left():
    cfg = load_config(sets=["bcd.order=reverse"])
    assert cycle_order(cfg, 4, 0) == [3, 2, 1, 0]
    assert cycle_order(load_config(), 4, 0) == [0, 1, 2, 3]
    rnd = load_config(sets=["bcd.order=random"])
    orders = [cycle_order(rnd, 5, c) for c in range(4)]
    assert all(sorted(o) == list(range(5)) for o in orders) and len({tuple(o) for o in orders}) > 1
    assert orders == [cycle_order(rnd, 5, c) for c in range(4)]  # seeded by (seed, cycle)
    assert blocks_to_visit(cfg, 4, 1, {(0, 3), (1, 3), (1, 1)}) == [2, 0]


# -- a visit's budget and the run's stop rules ---------------------------------------------------------------------

def test_rate_to_beat_is_the_other_blocks_last_rates():
    sp = load_config().spend
    visits = [_v(sp, 0, 0, rate=0.4), _v(sp, 0, 1, rate=0.2), _v(sp, 1, 0, rate=0.1), _v(sp, 1, 1)]
    assert rate_to_beat(visits[:1], 0) is None  # no other block has a rate yet
    assert rate_to_beat(visits, 2) == pytest.approx((0.1 + 0.2) / 2)  # block 0's last rate, block 1's last with one
    assert rate_to_beat(visits, 0) == pytest.approx(0.2)


def test_stop_rule_precedence():
    cfg = load_config(sets=["stop.target_val_loss=3.0", "spend.prices=[a100=3600]", "spend.train_device=a100",
                            "spend.budget_usd=5"])
    # cycle 0: best 4.0; cycle 1 (complete): no better than 4.0; spent 6 > budget
    sp = cfg.spend
    stale = [_v(sp, 0, 0, train=1, val=4.0), _v(sp, 0, 1, train=1, val=4.2),
             _v(sp, 1, 0, train=2, val=4.1), _v(sp, 1, 1, train=2, val=4.05)]
    assert stale_cycles(stale, 2) == 1
    assert stale_cycles(stale[:3], 2) == 0  # cycle 1 not finished yet
    assert stop_reason(cfg, stale, 2, next_block=0)[0] == "no_improvement"  # before budget
    # the target, once reached, wins over everything else
    hit = stale[:-1] + [_v(sp, 1, 1, train=2, val=2.9)]
    assert stop_reason(cfg, hit, 2, next_block=0)[0] == "target_val_loss"
    # budget alone: improving, target not reached
    improving = stale[:-1] + [_v(sp, 1, 1, train=2, val=3.5)]
    reason, detail = stop_reason(cfg, improving, 2, next_block=0)
    assert reason == "budget" and "$5 budget" in detail
    assert stop_reason(cfg, improving, 2) is None  # no next visit asked about: no budget check
    # rules off
    off = load_config(sets=["stop.patience_cycles=0"])
    assert stop_reason(off, stale, 2, next_block=0) is None
    # min_delta: an improvement smaller than min_delta does not count
    md = load_config(sets=["stop.min_delta=0.5"])
    assert stop_reason(md, improving, 2)[0] == "no_improvement"
    # patience 2: one stale cycle is not enough
    assert stop_reason(load_config(sets=["stop.patience_cycles=2"]), stale, 2) is None


def test_a_run_that_ran_out_of_cycles_says_so():
    cfg = load_config(sets=["bcd.cycles=2"])
    assert end_reason(cfg, [], 3) == ("cycles", "2 cycle(s) done")
    assert end_reason(load_config(sets=["stop.target_val_loss=6.0"]), [_v(cfg.spend, 0, 0, val=5.0)], 3)[0] == \
        "target_val_loss"


def test_every_stop_reason_is_said_in_words_where_it_is_defined():
    """Issue 37: "budget", "plateau" and the others appeared in logs without a word of what they mean. The words sit
    beside the rules that give the reasons (core/rules.STOP_WORDS for a run, models/trainer.STOP_WORDS for a visit),
    one entry per reason each rule can give."""
    from bcdflow.core import rules
    from bcdflow.models import trainer

    cfg = load_config(sets=["stop.target_val_loss=3.0", "stop.patience_cycles=1", "spend.prices=[a100=3600]",
                            "spend.train_device=a100", "spend.budget_usd=5"])
    sp = cfg.spend
    given = {stop_reason(cfg, [_v(sp, 0, 0, val=2.0)], 1)[0],  # each rule the run has, made to hold
             stop_reason(cfg, [_v(sp, 0, 0, val=4.0), _v(sp, 1, 0, val=4.0)], 1)[0],
             stop_reason(cfg, [_v(sp, 0, 0, train=6, val=4.0)], 2, next_block=1)[0],
             end_reason(load_config(sets=[]), [], 3)[0]}
    assert given == set(rules.STOP_WORDS)
    rule = trainer.StopRule(max_steps=100, patience=2, window=2, min_rate=0.5)
    visit = {rule.verdict([5.0] * 4), trainer.StopRule(100, 0, window=2, min_rate=0.5).verdict([5.0, 4.9, 4.8, 4.7]),
             "max_steps", "interrupted"}  # run_steps' own two
    assert visit == set(trainer.STOP_WORDS)
    for words in (rules.STOP_WORDS, trainer.STOP_WORDS):
        assert all(len(w.split()) >= 4 for w in words.values())  # a sentence, not the code again
    assert trainer.stop_words("plateau").startswith("its loss stopped falling")
    assert rules.stop_words("cycles") == "every planned cycle (bcd.cycles) is done"
    assert rules.stop_words("a-newer-reason") == "a-newer-reason"


def test_what_trains_a_stopped_run_further_is_keyed_by_the_rules_own_reasons():
    """``bcdflow resume`` of a done run names the key that trains it further, from a table of core/rules.py keyed by
    the reasons its rules give (flows/cli.py spelled the reasons again in a table of its own)."""
    from bcdflow.core.rules import FURTHER

    cfg = load_config(sets=["stop.target_val_loss=3.0", "spend.prices=[a100=3600]", "spend.train_device=a100",
                            "spend.budget_usd=5"])
    sp = cfg.spend
    stale = [_v(sp, 0, 0, train=1, val=4.0), _v(sp, 0, 1, train=1, val=4.2),
             _v(sp, 1, 0, train=2, val=4.1), _v(sp, 1, 1, train=2, val=4.05)]
    reasons = {stop_reason(cfg, stale, 2, next_block=0)[0],
               stop_reason(cfg, stale[:-1] + [_v(sp, 1, 1, train=2, val=2.9)], 2)[0],
               stop_reason(cfg, stale[:-1] + [_v(sp, 1, 1, train=2, val=3.5)], 2, next_block=0)[0],
               end_reason(load_config(sets=["bcd.cycles=2"]), [], 3)[0]}
    assert reasons == set(FURTHER) and all(v.startswith("--set ") for v in FURTHER.values())


def test_what_a_visit_starts_from_is_one_record_of_the_committed_state():
    """``core/rules.visit_spec``: the version, the global step, the adaptive budget's bar and the block's kept moments
    of a visit, from the run's committed state (the visit flow worked them out inline and threaded each through
    train_block, launch's spec.json and run_visit as a keyword of its own); the record crosses to torchrun's processes
    as JSON and back unchanged."""
    from bcdflow.core.rules import VisitSpec, visit_spec
    from bcdflow.storage.runs import RunState

    sp = load_config().spend
    kept = {"file": "blocks/" + "ab" * 16 + ".safetensors", "sha256": "ab" * 32, "bytes": 8}
    visits = [_v(sp, 0, 0, rate=0.4, version=1, step_end=10, moments=kept),
              _v(sp, 0, 1, rate=0.2, version=2, step_end=20)]
    state = RunState(run_id="r", version=2, visits=visits)
    clock = {"wall": 1.0, "preinfer": 0.5, "lost": 0.0, "since": 2.0}
    spec = visit_spec(load_config(sets=["bcd.moments=keep"]), state, 1, 0, clock)
    assert spec == VisitSpec(1, 0, 2, global_step=20, min_rate=0.2, moments=kept, clock=clock)
    assert VisitSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec  # launch's spec.json
    fixed = visit_spec(load_config(sets=["bcd.budget=fixed", "bcd.moments=reset"]), state, 1, 0)
    assert fixed.min_rate is None and fixed.moments is None and fixed.clock is None
