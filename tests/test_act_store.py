"""An activation store apart from the run's (``bcd.act_store``; issue 42): pre-inference writes a visit's activations
there and training reads them back; versions, checkpoints and records stay on the run's store. The weights are those
of a run without it; a visit resumed on a machine whose activation store lacks them pre-infers them again and ends
where an uninterrupted visit ends; the planner prices them at their own store's rate and bill; bad input is one
line naming the key."""
from __future__ import annotations

import os

import pytest

from bcdflow.core.config import load_config
from bcdflow.core.context import RunContext
from bcdflow.core.rules import VisitSpec
from bcdflow.core.forecast import Dataset, Rates, choose_preinfer, forecast_run
from bcdflow.flows.cli import main
from bcdflow.storage import layout
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import train_block
from tests.helpers import TINY, assert_same, finished_weights, new_run
from tests.test_forecast import _figs

SGD = ("optim.name=sgd", "optim.lr=0.1")


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_a_run_with_its_activations_on_their_own_store_trains_the_same_weights(tiny_cfg, prefect_server, tmp_path):
    from bcdflow.flows.bcd import bcd_train

    acts = tmp_path / "acts"
    cfg = tiny_cfg("bcd.preinfer=true")
    bcd_train(config=cfg.model_dump(), run_id="plain")
    apart = tiny_cfg("bcd.preinfer=true", f"bcd.act_store={acts}")
    seen: list[list[str]] = []
    real = preinfer_shard.fn

    def watch(ctx, cycle, block, version, shard):  # what each store holds right after a shard is written
        out = real(ctx, cycle, block, version, shard)
        seen.append(_files(acts))
        assert not Store(cfg.store).exists(layout.acts_key("apart", cycle, block))
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(preinfer_shard, "fn", watch)
        bcd_train(config=apart.model_dump(), run_id="apart")
    assert seen and all(any(f.startswith("runs/apart/visits/") and "activations.zarr" in f for f in s) for s in seen)
    store = Store(cfg.store)
    assert_same(finished_weights(store, "plain"), finished_weights(store, "apart"))
    assert _files(acts) == []  # each visit's activations removed with its commit


def test_a_visit_resumed_where_its_activations_are_gone_pre_infers_them_again(tiny_cfg, tmp_path, monkeypatch):
    """The first attempt trains from activation store A and is preempted after a checkpoint; the next attempt runs
    on a machine whose activation store B is empty: its shards are computed again there, training resumes from the
    checkpoint, and the block ends as an uninterrupted visit's does."""
    from bcdflow.core import stop_signals

    long = ("bcd.max_steps=40", "checkpoint.every_steps=10", "checkpoint.max_share=1", "bcd.window=10")
    a = tiny_cfg(*SGD, *long, f"bcd.act_store={tmp_path / 'A'}")
    ds = new_run(a)

    def preinfer(cfg) -> list[int]:
        todo = plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1)
        for s in todo:
            preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, s)
        return todo

    shards = preinfer(a)
    assert shards
    calls = {"n": 0}

    def requested() -> bool:  # the spot box's notice during step 25
        calls["n"] += 1
        return calls["n"] >= 25

    monkeypatch.setattr(stop_signals, "requested", requested)
    with pytest.raises(SystemExit):
        train_block.fn(RunContext.of(a, "r", ds), VisitSpec(0, 1, 0))
    monkeypatch.undo()
    b = tiny_cfg(*SGD, *long, f"bcd.act_store={tmp_path / 'B'}")
    assert plan_shards.fn(RunContext.of(a, "r", ds), 0, 1) == []  # A still holds them all
    assert preinfer(b) == shards and _files(tmp_path / "B")  # B had none: every shard computed there
    resumed = train_block.fn(RunContext.of(b, "r", ds), VisitSpec(0, 1, 0))
    assert resumed.resumed_at == 25 and resumed.steps == 40
    store = Store(a.store)
    store.rm(layout.visit_key("r", 0, 1))
    plain = tiny_cfg(*SGD, *long)
    preinfer(plain)
    ref = train_block.fn(RunContext.of(plain, "r", ds), VisitSpec(0, 1, 0))
    assert resumed.block_file == ref.block_file  # content-addressed: the same bytes


def test_the_plan_prices_activations_at_their_own_stores_rate_and_bill():
    """A local activation store: no egress, requests or storage on activations, at its own bandwidth, out of the
    run store's peak; ``auto`` then pre-infers a visit that reads its sample several times, where the run's S3 store
    (egress) made the card's way cheaper; the reason says which bandwidth would flip it."""
    ds = Dataset(0, 100_000, 5_000)
    rates = Rates(write_gbs=0.2, read_gbs=0.2, preinfer_gpus=1, preinfer_tflops=80, train_tflops=80)
    figs = _figs(step_s=0.5, step_computed_s=2.0)
    sets = [*TINY, "store=s3://b/runs", "data.seq_len=128", "bcd.preinfer=auto", "bcd.max_steps=10000",
            "bcd.sample_rate=0.01"]
    on_s3 = choose_preinfer(load_config(sets=sets), figs, figs.blocks[1], ds, rates)
    local = load_config(sets=[*sets, "bcd.act_store=/scratch/acts", "bcd.act_store_gbs=2"])
    here = choose_preinfer(local, figs, figs.blocks[1], ds, rates)
    assert not on_s3.preinfer and here.preinfer, (on_s3.why, here.why)
    assert "it would compute the prefix on the card below" in here.why and "GB/s" in here.why
    assert here.read_s == pytest.approx(here.read / 2e9) and here.egress_usd == pytest.approx(
        here.loaded_bytes / 1e9 * 0.09)  # the model part it loads still crosses the S3 link
    p = forecast_run(load_config(sets=[*sets, "bcd.act_store=/scratch/acts", "bcd.preinfer=true", "bcd.blocks=2"]), figs,
                 ds, rates)
    q = forecast_run(load_config(sets=[*sets, "bcd.preinfer=true", "bcd.blocks=2"]), figs, ds, rates)
    assert p.cycle.store_peak < q.cycle.store_peak and p.cycle.written == q.cycle.written
    assert any("bcd.act_store=/scratch/acts" in n for n in p.notes)


@pytest.mark.parametrize("sets, line", [
    (["bcd.act_store=nosuch://x"], "bcd.act_store: 'nosuch://x' has an unknown protocol"),
    (["bcd.act_store_gbs=0"], "bcd.act_store_gbs:"),
    (["bcd.act_store_gbs=x"], "bcd.act_store_gbs:"),
    (["bcd.act_store={afile}/acts"], "bcd.act_store: {afile}/acts cannot be created: {afile} is a file"),
])
def test_a_bad_activation_store_is_one_line_exit_2_and_nothing_written(sets, line, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    sets = [s.format(afile=afile) for s in sets]
    args = [x for s in [*TINY, "tracking_uri=none", *sets] for x in ("--set", s)]
    assert main(["train", *args, "--store", str(tmp_path / "store")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and line.format(afile=afile) in err[0], err
    assert _files(tmp_path) == ["afile"]


def test_at_the_guides_first_scale_auto_pre_infers_only_where_cheaper_and_not_slower():
    """Issue 42: with the S3 store's egress (0.09 USD/GB by default) at scale 1 of docs/guide/planning-a-run.md,
    ``auto`` pre-infers no visit that is not both cheaper (or as cheap and faster) and not slower; with the
    activations on the box's own disk and a visit that reads its small sample many times, it pre-infers."""
    from benchmarks.plan_tables import SCALES, plan_json

    args = [*SCALES[0][1], "--set", "bcd.preinfer=auto"]
    assert "store=s3://my-bucket/runs" in args
    p = plan_json(args)
    for v in p["visits"][1:]:
        other = v["alternative"]
        assert not v["preinfer"] or (v["usd"] <= other["usd"] and v["wall_s"] <= 1.01 * other["wall_s"]), v["why"]
    assert not any(v["preinfer"] for v in p["visits"])
    local = plan_json([*args, "--set", "bcd.act_store=/scratch/acts", "--set", "bcd.sample_rate=0.02"])
    assert any(v["preinfer"] for v in local["visits"]), [v["why"] for v in local["visits"]]
