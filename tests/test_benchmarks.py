"""Smoke tests of the benchmark suite (``python -m benchmarks run``): each benchmark on its smallest case
(BCDFLOW_BENCH_SIZE=tiny), so the suite cannot rot when the training path changes under it.

Benchmarks are programs, not timed tests (docs/CONVENTIONS.md 10): nothing here checks a measured figure, only
that every benchmark runs through the product's code, returns its claims and writes its report, JSON and
plots. The flow benchmarks share their runs within the session (``benchmarks.runs.book``). What is checked is
the instrument: the CPU memory tracker against bytes counted by hand (deterministic, no timing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cli import main
from benchmarks.common import LiveBytes, one_step, tensor_bytes
from bcdflow.models.trainer import OptimSpec, make_optimizer

ROOT = Path(__file__).resolve().parents[1]


def bench(names: list[str], out: Path, monkeypatch) -> dict:
    monkeypatch.setenv("BCDFLOW_BENCH_SIZE", "tiny")
    rc = main(["run", "--quick", "--only", *names, "--out", str(out)])
    data = json.loads((out / "results.json").read_text())
    for name in names:
        res = data["results"][name]
        assert not res.get("error"), res.get("traceback")
        assert res["claims"], name
        for plot in res["plots"]:
            assert (out / plot).stat().st_size > 1000, plot
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "## Summary" in report and all(f"| {n} |" in report for n in names)
    return data


def test_live_bytes_matches_an_analytic_adamw_step():
    """The CPU tracker the memory benchmark reads (``common.LiveBytes``) on a case counted by hand: an nn.Linear
    AdamW step (as ``make_optimizer`` builds it) after a first step, so the moments exist.

    Alive at the optimizer step: weights W, two moments 2W, grads W and, for foreach AdamW only, one W-sized
    temporary (sqrt of the second moment; fused AdamW has none); activations (B x out) are gone by then.
    Peak = 4W (fused) or 5W (foreach) + input."""
    lin = torch.nn.Linear(512, 512)
    x, W = torch.randn(4, 512), tensor_bytes(list(lin.parameters()))
    params, spec = list(lin.parameters()), OptimSpec("adamw", grad_clip=1.0)
    opt = make_optimizer(params, spec)
    n = 4 if opt.defaults.get("fused") else 5
    loss_fn = lambda b: lin(b).square().mean()  # noqa: E731
    one_step(loss_fn, params, x, opt, spec)
    opt.zero_grad(set_to_none=True)
    base = tensor_bytes(params, opt.state, x)
    with LiveBytes() as tr:
        one_step(loss_fn, params, x, opt, spec)
    measured, expected = base + tr.peak, n * W + x.nbytes
    assert abs(measured - expected) <= 0.01 * expected, (measured, expected, n)


@pytest.mark.parametrize("name", ["iteration", "utilization"])
def test_step_benchmark_runs(name, tmp_path, monkeypatch):
    data = bench([name], tmp_path, monkeypatch)
    assert data["meta"]["profile"] == "tiny"
    assert data["meta"]["machine"]["torch"]


def test_memory_measures_the_block_state_it_claims(tmp_path, monkeypatch):
    """What the memory benchmark is for: the measured gradients and AdamW state of a visit are exactly its
    trainable block's (12 bytes per trainable parameter in fp32: one gradient, two moments), never the whole
    model's; the full step holds 16 bytes per parameter (weights too)."""
    res = bench(["memory"], tmp_path, monkeypatch)["results"]["memory"]
    full = res["full"]
    for row in res["rows"]:
        n, b = row["trainable_params"], row["bytes"]
        assert abs(b["grads"] + b["optim"] - 12 * n) <= 0.01 * 12 * n, (row["name"], b, n)
        assert abs(b["weights"] - row["analytic"]["weights"]) <= 0.01 * row["analytic"]["weights"], row["name"]
    assert abs(sum(full["bytes"][k] for k in ("weights", "grads", "optim")) - 16 * full["trainable_params"]) \
        <= 0.01 * 16 * full["trainable_params"]
    # the blocks partition the model: their trainable parameters add up to the full step's
    blocks = [r for r in res["rows"] if r["name"] != "full"]
    assert len(blocks) == 3 and sum(r["trainable_params"] for r in blocks) == full["trainable_params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["validity", "sampling", "order", "cost"])
def test_flow_benchmark_runs(name, tmp_path, monkeypatch, prefect_server):
    res = bench([name], tmp_path, monkeypatch)["results"][name]
    if name == "validity":
        for p in res["pairs"].values():
            assert p["full_run"]["mode"] == "full" and p["bcd_run"]["mode"] == "bcd"
            assert p["bcd_run"]["curve"] and all("flops" in pt for pt in p["bcd_run"]["curve"])


@pytest.mark.slow
def test_command_line(tmp_path):
    """``python -m benchmarks run --quick --only memory`` as a user types it (tiny by environment)."""
    env = {**os.environ, "BCDFLOW_BENCH_SIZE": "tiny"}
    r = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--quick", "--only", "memory", "--out",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worst-block peak / full AdamW step" in r.stdout
    assert {"report.md", "results.json", "memory_breakdown.png"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.slow
def test_memory_isolated_per_configuration(tmp_path, monkeypatch):
    """The GPU way (one process per configuration, random weights on the device), run on the CPU: every row is
    measured, the planner's prediction sits beside it, and bcd.recompute=on is measured as the product runs it."""
    monkeypatch.setenv("BCDFLOW_BENCH_ISOLATE", "1")
    res = bench(["memory"], tmp_path, monkeypatch)["results"]["memory"]
    for row in [res["full"], *res["rows"][1:]]:
        assert row["peak_bytes"] > 0 and abs(row["planned_peak_bytes"] / row["peak_bytes"] - 1) <= 0.10
    wi = res["what_if_checkpoint"]
    assert wi["timing"]["isolated"] and all(r["recompute_step_ms"] > 0 for r in wi["rows"])
