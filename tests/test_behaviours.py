"""Behaviours users rely on, end to end through the flows and the CLI on the tiny config: the plateau stop of a
real visit, SGD, bf16 and zstd activations, the block orders (greedy against a hand computation), the global stop
rules, a corrupt mid-visit checkpoint skipped, a resume with a changed config, ``bcdflow demo``, and a LLaMA-family
run."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from bcdflow.core.context import RunContext, open_store
from bcdflow.flows.cli import main
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.store import Store
from tests.helpers import TINY, run_log

BCDFLOW = os.path.join(os.path.dirname(sys.executable), "bcdflow")


def _run(tiny_cfg, run_id: str, *sets: str):
    from bcdflow.flows.bcd import bcd_train

    cfg = tiny_cfg(*sets)
    out = bcd_train(config=cfg, run_id=run_id)
    return cfg, out, runs.read_state(Store(cfg.store), run_id)


def _moved(cfg, run_id: str, state) -> set[int]:
    """The blocks whose tensors differ from version 0 in the final version."""
    store = Store(cfg.store)
    v0, vn = checkpoints.load_blocks(store, run_id, 0), checkpoints.load_blocks(store, run_id, state.version)
    plan = runs.read_config(store, run_id)["plan"]["blocks"]
    return {b["index"] for b in plan if any(not torch.equal(v0[n], vn[n]) for n in b["params"])}


# -- a visit's local convergence, optimizers, activation formats ---------------------------------------------------

@pytest.mark.slow
def test_a_real_visit_stops_on_its_loss_plateau(tiny_cfg, prefect_server):
    # window 3, patience 1, min_delta 100: the second window cannot improve by 100, so every visit stops at step 6
    cfg, out, state = _run(tiny_cfg, "plateau", "bcd.max_steps=30", "bcd.patience=1", "bcd.min_delta=100")
    assert [(v.steps, v.stopped_by) for v in state.visits] == [(6, "plateau")] * 3
    assert out["steps"] == 18


@pytest.mark.slow
def test_the_baseline_trains_its_steps_unless_asked_to_stop(tiny_cfg, prefect_server):
    from bcdflow.flows.bcd import full_train

    # the visit plateau rule as strict as it gets (min_delta 100) does not stop the baseline ...
    cfg = tiny_cfg("train.steps=12", "bcd.patience=1", "bcd.min_delta=100")
    with run_log() as lines:
        full_train(config=cfg, run_id="full-steps")
    (v,) = runs.read_state(Store(cfg.store), "full-steps").visits
    assert (v.steps, v.stopped_by) == (12, "max_steps")
    # ... train.patience asks the baseline for it
    cfg = tiny_cfg("train.steps=12", "train.patience=1", "bcd.min_delta=100")
    with run_log() as more:
        full_train(config=cfg, run_id="full-plateau")
    (v,) = runs.read_state(Store(cfg.store), "full-plateau").visits
    assert (v.steps, v.stopped_by) == (6, "plateau")
    # issue 45: its log speaks of its own keys (train.steps, train.patience), not of bcd.max_steps and bcd.cycles
    text = "\n".join(lines + more)
    assert "step cap (train.steps)" in text and "a plateau by train.patience" in text
    assert "12 of train.steps=12 steps trained" in text and "6 of train.steps=12 steps trained" in text
    assert "bcd.max_steps" not in text and "bcd.cycles" not in text


@pytest.mark.slow
def test_an_adaptive_budget_run_records_each_blocks_rate_and_bar(tiny_cfg, prefect_server):
    from bcdflow.core.rules import rate_to_beat

    cfg, out, state = _run(tiny_cfg, "adaptive", "bcd.budget=adaptive", "bcd.cycles=2", "bcd.max_steps=12",
                           "optim.schedule=cosine", "bcd.lr_scales=[0.5, 1, 1]")
    assert state.status == "done" and len(state.visits) == 6
    assert all(v.rate is not None for v in state.visits)  # every visit ran at least two windows of 3 steps
    first = state.visits[0]
    assert first.stopped_by == "max_steps" and first.steps == 12  # no other block has a rate yet: no bar
    # a visit ended by the budget fell more slowly than its bar (the other blocks' last rates)
    for i, v in enumerate(state.visits):
        bar = rate_to_beat(state.visits[:i], v.block)
        assert v.stopped_by in ("max_steps", "budget")
        if v.stopped_by == "budget":
            assert bar is not None and v.steps < 12


@pytest.mark.slow
def test_sgd_through_real_visits(tiny_cfg, prefect_server):
    cfg, out, state = _run(tiny_cfg, "sgd", "optim.name=sgd", "optim.lr=0.1")
    assert state.status == "done" and all(math.isfinite(v.val_loss) for v in state.visits)
    assert _moved(cfg, "sgd", state) == {0, 1, 2}
    assert runs.read_config(Store(cfg.store), "sgd")["optim"]["name"] == "sgd"


def test_bf16_zstd_activations_through_a_real_visit(tiny_cfg):
    """Pre-inferred activations stored as bf16 bit patterns with zstd train the block close to fp32 ones."""
    from bcdflow.storage.layout import acts_key
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
    from bcdflow.tasks.run import init_run
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block

    trained = {}
    for name, sets in (("fp32", []), ("bf16", ["bcd.act_dtype=bfloat16", "bcd.act_compression=zstd"])):
        cfg = tiny_cfg(*sets).model_copy(update={"store": str(Store(tiny_cfg().store).url) + f"-{name}"})
        ds = prepare_data.fn(cfg, open_store(cfg))
        init_run.fn(cfg, "r", ds)
        for s in plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1):
            preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, s)
        group = zarr.open_group(open_store(cfg).zarr_store(acts_key("r", 0, 1), read_only=True), mode="r")
        hidden = group["hidden"]
        if name == "bf16":
            assert hidden.dtype == np.uint16 and hidden.attrs["logical_dtype"] == "bfloat16"
            assert any("zstd" in type(c).__name__.lower() for c in hidden.compressors)
        out = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 1, 0))
        assert math.isfinite(out.train_loss)
        trained[name] = checkpoints.load_from_manifest(open_store(cfg), "r", {"blocks": {"1": out.block_file}})
    v0 = checkpoints.load_blocks(open_store(cfg), "r", 0, [1])
    moved = max((trained["fp32"][k] - v0[k]).abs().max().item() for k in trained["fp32"])
    diff = max((trained["fp32"][k] - trained["bf16"][k]).abs().max().item() for k in trained["fp32"])
    assert 0 < diff < 0.5 * moved  # bf16 rounds the inputs (so not identical); the visit's update stays the same


# -- block orders ---------------------------------------------------------------------------------------------------

def test_greedy_picks_the_block_with_the_largest_gradient_norm(tiny_cfg):
    """Against a hand computation: the whole model's gradient on the probe batch, its L2 norm per block."""
    from bcdflow.core.context import RunContext
    from bcdflow.core.rules import sample_rows
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.run import init_run
    from bcdflow.tasks.train import choose_block

    cfg = tiny_cfg()
    ds = prepare_data.fn(cfg, open_store(cfg))
    init_run.fn(cfg, "g", ds)
    ctx = RunContext.of(cfg, "g", ds)
    model = ctx.load_part(ctx.manifest(0), (0, ctx.model_cfg.n_layer), True, True)
    probe = np.sort(sample_rows(ctx.dataset.n_train, 1.0, cfg.seed, 0, 10_000)[: cfg.train.batch_size])
    x, y = ctx.dataset.train_pairs(probe)
    torch.nn.functional.cross_entropy(model.head(model.run_layers(model.embed(x), 0, ctx.model_cfg.n_layer)).flatten(0, 1),
                                      y.flatten()).backward()
    grads = dict(model.named_parameters())
    norms = [math.sqrt(sum(float((grads[n].grad.double() ** 2).sum()) for n in blk.params)) for blk in ctx.plan.blocks]
    for candidates in ([0, 1, 2], [1, 2], [0, 2]):
        expect = max(candidates, key=lambda b: norms[b])
        assert choose_block.fn(RunContext.of(cfg, "g", ds), 0, 0, candidates) == expect, (candidates, norms)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["reverse", "random"])
def test_orders_visit_blocks_in_their_sequence(tiny_cfg, prefect_server, order):
    cfg, _, state = _run(tiny_cfg, order, f"bcd.order={order}", "bcd.cycles=2", "bcd.max_steps=3",
                         "stop.patience_cycles=0")
    seen = [[v.block for v in state.visits if v.cycle == c] for c in range(2)]
    if order == "reverse":
        assert seen == [[2, 1, 0], [2, 1, 0]]
    else:  # a fresh permutation per cycle, from (seed, cycle)
        assert seen == [list(np.random.default_rng(np.random.SeedSequence([cfg.seed, c, 7919])).permutation(3))
                        for c in range(2)]
        assert all(sorted(s) == [0, 1, 2] for s in seen)


# -- global stop rules ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_target_val_loss_ends_the_run(tiny_cfg, prefect_server):
    _, out, state = _run(tiny_cfg, "target", "bcd.cycles=3", "stop.target_val_loss=100")
    assert out["stop_reason"] == "target_val_loss" and len(state.visits) == 1
    assert state.stop_reason == "target_val_loss" and "<= target 100" in state.stop_detail


@pytest.mark.slow
def test_no_improvement_ends_the_run(tiny_cfg, prefect_server):
    # min_delta 100: cycle 1 cannot beat cycle 0 by that much, so the run stops before cycle 2
    _, out, state = _run(tiny_cfg, "stale", "bcd.cycles=3", "bcd.max_steps=3", "stop.patience_cycles=1",
                         "stop.min_delta=100")
    assert out["stop_reason"] == "no_improvement" and [v.cycle for v in state.visits] == [0, 0, 0, 1, 1, 1]


# -- damaged checkpoints, changed configs, the demo, LLaMA -----------------------------------------------------

def _sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, "tracking_uri=none", *extra] for a in ("--set", s)]


@pytest.mark.slow
def test_a_corrupt_mid_visit_checkpoint_is_skipped_and_the_run_ends_bitwise(prefect_api_url, tmp_path):
    """Issue 26: the checkpoint is only a shortcut. A resume over a corrupt one goes on from the one kept before it,
    says so in one line, and ends bitwise equal to an uninterrupted run (it used to stop for good, exit 1)."""
    import json

    from tests.helpers import assert_same, finished_weights

    store = str(tmp_path / "store")
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "BCDFLOW_FAILPOINTS": "train-checkpoint:2"}
    args = ["train", *_sets("checkpoint.every_steps=2", "checkpoint.max_share=1"), "--run-id", "c"]
    assert subprocess.run([BCDFLOW, *args, "--store", store], env=env, capture_output=True,
                          timeout=300).returncode == -9
    ck = tmp_path / "store" / "runs" / "c" / "visits" / "c0-b0" / "train-ckpt"
    pointer = json.loads((ck / "ckpt.json").read_text())
    assert (pointer["step"], pointer["previous"]["step"]) == (4, 2)
    params = ck / pointer["params"]
    data = bytearray(params.read_bytes())
    data[-3] ^= 0xFF
    params.write_bytes(bytes(data))
    env.pop("BCDFLOW_FAILPOINTS")
    done = subprocess.run([BCDFLOW, "resume", "c", "--store", store], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "corrupt" in line]
    assert len(said) == 1 and params.name in said[0] and "goes on from its checkpoint of step 2" in said[0], said
    ref = str(tmp_path / "ref")
    assert main([*args, "--store", ref]) == 0  # uninterrupted, in this process
    assert_same(finished_weights(Store(store), "c"), finished_weights(Store(ref), "c"))


@pytest.mark.slow
def test_slow_checkpoint_writes_are_held_to_their_share_of_a_visit(prefect_server, tiny_cfg, monkeypatch):
    """checkpoint.max_share through the engine: with a checkpoint due every step and each write taking 0.5 s, the
    default share (0.1) holds the next one back for 4.5 s of training, longer than a tiny visit's 6 steps; at 1 every
    step but the last checkpoints."""
    import time

    from bcdflow.tasks import engine

    saved: list[tuple[str, int]] = []
    real = engine.trainckpt.save

    def slow(store, vkey, step, *a, **k):
        saved.append((vkey.rsplit("/", 1)[-1], step))
        time.sleep(0.5)
        return real(store, vkey, step, *a, **k)

    monkeypatch.setattr(engine.trainckpt, "save", slow)
    _run(tiny_cfg, "held", "bcd.blocks=2", "bcd.budget=fixed", "checkpoint.every_steps=1")
    assert saved == [("c0-b0", 1), ("c0-b1", 1)]
    saved.clear()
    _run(tiny_cfg, "every", "bcd.blocks=2", "bcd.budget=fixed", "checkpoint.every_steps=1", "checkpoint.max_share=1")
    assert saved == [(f"c0-b{b}", s) for b in range(2) for s in range(1, 6)]


@pytest.mark.slow
def test_resume_with_a_changed_config_is_refused_naming_the_keys(prefect_server, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["train", *_sets(), "--store", store, "--run-id", "x"]) == 0
    capsys.readouterr()
    assert main(["train", *_sets("bcd.blocks=2", "seed=7"), "--store", store, "--run-id", "x"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "run 'x' exists with a different config: bcd.blocks, seed differ" in line


@pytest.mark.slow
def test_demo_runs(prefect_server, tmp_path, capsys):
    """`bcdflow demo`, shortened: the built-in corpus, the embedded defaults, its closing instructions."""
    short = ["model.d_model=64", "model.n_head=4", "data.seq_len=32", "data.vocab_size=512",
             "data.builtin_bytes=200000", "bcd.cycles=1", "bcd.max_steps=4", "bcd.window=2",
             "train.batch_size=8", "train.eval_rows=32", "tracking_uri=none"]
    assert main(["demo", *[a for s in short for a in ("--set", s)], "--store", str(tmp_path / "s"),
                 "--run-id", "demo"]) == 0
    out = capsys.readouterr().out
    assert "run demo: version 3 (done, bcd)" in out and "bcdflow status demo" in out and "Prefect UI" in out


@pytest.mark.slow
def test_llama_family_end_to_end(tiny_cfg, prefect_server):
    cfg, out, state = _run(tiny_cfg, "llama", "model.name=tiny-llama", "model.d_model=64", "model.n_head=4",
                           "model.n_kv_head=2")
    assert state.status == "done" and state.version == 3 and out["stop_reason"] == "cycles"
    assert runs.read_config(Store(cfg.store), "llama")["model_resolved"]["family"] == "llama"
    assert _moved(cfg, "llama", state) == {0, 1, 2}
    assert state.visits[-1].val_loss < state.visits[0].first_loss
