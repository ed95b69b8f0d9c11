"""The memory planner (models/memory.py) against measured peaks: one training step of each visit and of full
training, measured on the CPU by the tensor tracker the memory benchmark uses (benchmarks/common.LiveBytes), must
agree with the prediction from the config alone within 10%. And ``bcdflow plan-memory``.

    python -m pytest -q tests/test_memory.py
"""
from __future__ import annotations

import gc

import pytest
import torch

from benchmarks.common import Workload
from bcdflow.models import get_config
from bcdflow.models.holding import recommend
from bcdflow.models.memory import GB, device_budget, plan_visits, visit_memory
from bcdflow.models.specs import StepShape

# small enough for seconds on 2 cores, large enough that activations, logits and state all count
SHAPE = {"n_layer": 6, "d_model": 128, "n_head": 4, "vocab_size": 2048}
CASES = [("gpt2-124m", {}), ("L-1.5B", {"n_kv_head": 2, "d_ff": 352})]


def measured_vs_planned(model, over, precision, recompute, preinfer=True, optim="adamw", B=4, T=64, rows=64,
                        stream=False, expand=0, sign=False):
    c = {"model": model, "overrides": {**SHAPE, **over}, "batch_size": B, "seq_len": T, "precision": precision}
    w = Workload(c, torch.device("cpu"), optim=optim)
    w.args.chunk_rows = rows
    plan = w.plan(3)
    out = []
    for blk in [None, *plan.visits]:
        if blk is None and stream:
            continue  # full training streams nothing
        v = w.full() if blk is None else w.visit(f"b{blk.index}", blk, preinfer=preinfer, recompute=recompute,
                                                   stream=stream, expand=expand, sign=sign)
        v.step(timed=False)  # a first step: the optimizer state exists, as in every later step
        measured = v.peak()["peak_bytes"]
        shape = StepShape(B, T, precision, optim, chunk_rows=rows, recompute="on" if recompute else "off",
                          preinfer=preinfer, offload="stream" if stream else "off", expand_rank=expand,
                          suffix="sign" if sign else "off")
        est = visit_memory(w.cfg, None if blk is None else plan, None if blk is None else blk.index, shape)
        out.append((est.name, measured, est.peak))
        del v
        gc.collect()
    return out


@pytest.mark.parametrize("model,over", CASES, ids=["gpt", "llama"])
@pytest.mark.parametrize("precision,recompute", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_planner_agrees_with_measured_cpu_peaks_within_10_percent(model, over, precision, recompute):
    torch.set_num_threads(1)
    for name, measured, planned in measured_vs_planned(model, over, precision, recompute):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


@pytest.mark.parametrize("model,over", CASES, ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", [False, True])
def test_planner_agrees_on_streamed_visits_within_10_percent(model, over, recompute):
    """``train.offload=stream``: the device holds the window of frozen layers, not all of them."""
    torch.set_num_threads(1)
    for name, measured, planned in measured_vs_planned(model, over, "bf16", recompute, stream=True):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


def test_planner_agrees_without_preinference_and_with_sgd():
    for name, measured, planned in measured_vs_planned("gpt2-124m", {}, "fp32", False, preinfer=False,
                                                       optim="sgd"):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


def test_planner_orders_what_the_issue_is_about():
    """bf16 frozen weights, recompute and more blocks each lower the worst visit; full training is the largest."""
    cfg = get_config("G-1.6B")
    B, T = 4, 1024
    full = visit_memory(cfg, None, None, StepShape(B, T, "bf16"))
    worst = {(p, rc, m): max(e.peak for e in plan_visits(cfg, m, StepShape(B, T, p, recompute=rc)))
             for p in ("fp32", "bf16") for rc in ("off", "on") for m in (3, 6)}
    assert worst[("bf16", "off", 3)] < worst[("fp32", "off", 3)]
    assert worst[("bf16", "on", 3)] < worst[("bf16", "off", 3)]
    assert worst[("bf16", "on", 6)] < worst[("bf16", "on", 3)]
    assert all(v < full.peak for v in worst.values())
    est = visit_memory(cfg, None, None, StepShape(B, T, "bf16"))
    assert est.peak >= sum(v for k, v in est.parts().items() if k != "activations")  # parts at the peak add up
    budget = device_budget(24 * GB)
    rec = recommend(cfg, StepShape(2, 1024, "bf16"), budget)
    assert rec.blocks is not None and not rec.full_fits  # the issue: full AdamW of G-1.6B does not fit 24 GB
    assert rec.worst_peak <= budget.usable < 24 * GB - budget.reserve  # the context and the reserve stay free


def test_plan_memory_command(tmp_path, capsys):
    from bcdflow.flows.cli import main

    rc = main(["plan-memory", "--set", "model.name=G-1.6B", "--set", "data.seq_len=1024", "--set",
               "data.vocab_size=50304", "--set", "train.batch_size=2", "--set", "train.precision=bf16",
               "--gpu-gb", "24"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "full" in out and "block 0" in out and "recommended: bcd.blocks=" in out
    assert not (tmp_path / "s").exists()  # a plan reads no store and writes nothing
    rc = main(["plan-memory", "--set", "model.name=G-1.6B", "--gpu-gb", "-3"])
    assert rc == 2 and "--gpu-gb" in capsys.readouterr().err


def test_plan_memory_text_fits_120_columns(capsys):
    """Issue 45: the README's ``plan-memory`` example printed a 196-column table (434 with its prose). The text is
    now at most 120 columns, the table's group line carrying the units; ``--json`` keeps every figure."""
    import json
    import shlex
    from pathlib import Path

    from bcdflow.flows.cli import main

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").splitlines()
    i = next(i for i, ln in enumerate(readme) if ln.startswith("bcdflow plan-memory "))
    cmd = readme[i].rstrip("\\ ") + " " + readme[i + 1].split("#")[0]  # the example and its continuation line
    args = shlex.split(cmd)[1:]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(recommended):" in out and "recommended: bcd.blocks=" in out
    assert max(len(ln) for ln in out.splitlines()) <= 120, out
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"overhead", "activations", "logits", "holding"} <= set(res["visits"][0])


@pytest.mark.parametrize("model,over", CASES, ids=["gpt", "llama"])
@pytest.mark.parametrize("optim", ["adamw8bit", "adamw8bit-bf16"])
def test_planner_agrees_on_the_lighter_states_within_10_percent(model, over, optim):
    """Issue 33: 8-bit AdamW moments (bitsandbytes' blockwise state, uint8 and a scale per 256 elements) and bf16
    master weights and gradients, as the planner counts them (models/optimizers.Optimizer.state_bytes,
    param_bytes) against the tracker; wider matrices so most of them are over bitsandbytes' 4096-element floor."""
    torch.set_num_threads(1)
    for name, measured, planned in measured_vs_planned(model, over, "bf16", False, optim=optim):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)
