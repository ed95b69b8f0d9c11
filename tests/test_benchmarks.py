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


# -- the validity suite (python -m benchmarks suite) -----------------------------------------------------------

def _curve(points: list[tuple[int, float]], tokens_per_step: float = 10.0, secs_per_step: float = 0.5) -> list[dict]:
    return [{"step": s, "val_loss": v, "tokens": s * tokens_per_step, "stage_seconds": s * secs_per_step}
            for s, v in points]


def test_suite_metrics_on_synthetic_curves():
    """The suite's figures on curves worked by hand: first reach, the lower bound when BCD never reaches L*,
    interpolation for the equal-step gap (and past the baseline's end), and the mean [min–max] over seeds."""
    from benchmarks.runs import first_reach
    from benchmarks.suite import compare, interp, multiplier, shown, spread

    full = _curve([(100, 4.0), (200, 3.0), (300, 2.5), (400, 2.49)])
    assert first_reach(full, 2.51) == 300 and first_reach(full, 2.0) is None
    assert interp(full, 250) == (2.75, None) and interp(full, 400) == (2.49, None)
    assert interp(full, 500) == (2.49, "after") and interp(full, 50) == (4.0, "before")

    # BCD (2 tokens per step more, 1 s per step) reaches L* = 2.49 + 0.02 at its 4th visit, step 600
    bcd = _curve([(150, 4.5), (300, 3.2), (450, 2.6), (600, 2.5)], tokens_per_step=12.0, secs_per_step=1.0)
    m = multiplier(full, bcd, 2.51, "step")
    assert m == {"value": 2.0, "reached": True, "full": 300, "bcd": 600}
    assert multiplier(full, bcd, 2.51, "tokens")["value"] == 600 * 12.0 / (300 * 10.0)
    assert multiplier(full, bcd, 2.51, "stage_seconds")["value"] == 600 * 1.0 / (300 * 0.5)
    # never reached: BCD's total over the baseline's steps to L*, flagged as a lower bound
    short = bcd[:3]
    assert multiplier(full, short, 2.51, "step") == {"value": 1.5, "reached": False, "full": 300, "bcd": 450}

    run = lambda curve: {"curve": curve, "final_val": curve[-1]["val_loss"], "steps": curve[-1]["step"],  # noqa: E731
                         "stopped_by": ["max_steps"] * len(curve), "stop_reason": "cycles"}
    c = compare(run(full), run(_curve([(125, 4.5), (250, 3.2)])), tol=0.02)
    assert c["target"] == 2.49 + 0.02 and not c["steps"]["reached"] and c["steps"]["value"] == 250 / 300
    assert abs(c["gap"] - (3.2 - 2.75)) < 1e-12 and c["gap_where"] is None  # the baseline at 250: 2.75
    c = compare(run(full), run(bcd), tol=0.02)  # BCD ran to 600, the baseline to 400: compared at its end
    assert c["gap_where"] == "after" and abs(c["gap"] - (2.5 - 2.49)) < 1e-12
    assert c["stopped_by"] == {"max_steps": 4}
    # a baseline past its minimum (fine-tuning for several epochs): L* from its best, first reached at 300
    over = _curve([(100, 4.0), (200, 3.0), (300, 2.5), (400, 2.7)])
    c = compare(run(over) | {"best_val": 2.5}, run(bcd), tol=0.02, target_from="best")
    assert c["target"] == 2.5 + 0.02 and c["steps"] == {"value": 2.0, "reached": True, "full": 300, "bcd": 600}

    sp = spread([2.0, 1.5, 3.0], [False, True, False])
    assert sp["mean"] == 6.5 / 3 and (sp["min"], sp["max"]) == (1.5, 3.0)
    assert sp["mean_bound"] and sp["min_bound"] and not sp["max_bound"] and sp["n_bound"] == 1
    assert shown(sp) == "> 2.17 [> 1.50–3.00] (2/3 reached)"
    assert shown(spread([1.25])) == "1.25" and shown(None) == "–" and spread([None]) is None


def test_corpora_are_deterministic_cached_and_refuse_nothing(tmp_path, monkeypatch):
    from benchmarks import corpora
    from bcdflow.errors import BadInput

    a = corpora.build("docs", tmp_path / "a", 30_000)
    b = corpora.build("docs", tmp_path / "b", 30_000)
    text = [Path(f).read_bytes() for f in a]
    assert text == [Path(f).read_bytes() for f in b] and sum(map(len, text)) == 30_000
    info = corpora.info(tmp_path / "a")
    assert info["corpus"] == "docs" and set(info["packages"]).isdisjoint(corpora.PACKAGES["pysrc"])
    stamp = (tmp_path / "a" / corpora.MARKER).stat().st_mtime_ns
    assert corpora.build("docs", tmp_path / "a", 30_000) == a  # reused, not rebuilt
    assert (tmp_path / "a" / corpora.MARKER).stat().st_mtime_ns == stamp
    src = corpora.build("pysrc", tmp_path / "p", 20_000)
    assert Path(src[0]).read_bytes() != text[0][:20_000]
    # docsrc: the docs packages' source files (code, not their docstrings), sharing no package with pysrc
    code = corpora.build("docsrc", tmp_path / "c", 20_000)
    ci = corpora.info(tmp_path / "c")
    assert set(ci["packages"]) <= set(corpora.PACKAGES["docs"]) and set(ci["packages"]).isdisjoint(
        corpora.PACKAGES["pysrc"])
    assert "def " in Path(code[0]).read_text() and Path(code[0]).read_bytes() != text[0][:20_000]
    with pytest.raises(ValueError, match="corpus 'nope'"):
        corpora.build("nope", tmp_path / "n", 1000)
    monkeypatch.setitem(corpora.PACKAGES, "pysrc", ("no_such_package_here",))
    with pytest.raises(BadInput, match="corpus 'pysrc': no text found"):
        corpora.build("pysrc", tmp_path / "q", 1000)


@pytest.mark.slow
def test_suite_tiny_end_to_end(tmp_path, monkeypatch, prefect_server, capsys):
    """``python -m benchmarks suite --tiny`` through the real flows: one baseline and one BCD run per setting,
    every figure of the table a number (or a lower bound) where it should be, the outputs written."""
    monkeypatch.delenv("BCDFLOW_BENCH_SIZE", raising=False)
    assert main(["suite", "--tiny", "--settings", "nope", "--out", str(tmp_path)]) == 2
    assert "--settings: unknown nope (choose from fixed, default)" in capsys.readouterr().out
    rc = main(["suite", "--tiny", "--out", str(tmp_path), "--set", "optim.warmup_steps=1"])
    data = json.loads((tmp_path / "suite.json").read_text())
    assert rc == 0 and not data["errors"]
    (group,) = data["groups"]
    assert (group["corpus"], group["model"]) == ("pysrc", "l2") and list(group["seeds"]) == ["0"]
    seed = group["seeds"]["0"]
    full = seed["full"]
    assert full["mode"] == "full" and "optim.warmup_steps=1" in full["sets"] and len(full["curve"]) >= 2
    assert any(s.startswith("data.files=") and "pysrc" in s for s in full["sets"]) and "seed=0" in full["sets"]
    assert full["dataset"]["n_train"] > 0
    for name, cell in seed["settings"].items():
        r = cell["run"]
        assert r["mode"] == "bcd" and "optim.warmup_steps=1" in r["sets"] and r["steps"] == cell["steps_bcd"]
        assert cell["target"] == full["final_val"] + data["suite"]["tol"]
        for key in ("steps", "tokens", "time"):
            m = cell[key]
            assert m["full"] > 0 and m["bcd"] > 0 and m["value"] == m["bcd"] / m["full"]
            assert isinstance(m["reached"], bool)
        assert isinstance(cell["gap"], float) and cell["gap_where"] in (None, "after")
        assert sum(cell["stopped_by"].values()) == len(r["stopped_by"])
        assert cell["cap_steps"] == 2 * 5 and cell["steps_bcd"] <= cell["cap_steps"]  # 2 blocks x 5 steps, 1 cycle
        row = group["rows"][name]
        assert row["seeds"] == 1 and row["steps"]["mean"] == cell["steps"]["value"]
        assert row["steps"]["mean_bound"] == (not cell["steps"]["reached"])
    base = group["baseline"]
    assert base["final"]["mean"] == full["final_val"] and 0 < base["epochs"]["mean"] < 1
    assert isinstance(base["late"]["mean"], float)
    md = (tmp_path / "suite.md").read_text()
    assert "| pysrc | l2 | fixed | 1 |" in md and "| pysrc | l2 | default | 1 |" in md
    assert (tmp_path / "suite-pysrc.png").stat().st_size > 1000
    assert "B-F × mean [min–max]" in capsys.readouterr().out


@pytest.mark.slow
def test_suite_paper_regime_takes_l_star_from_the_baselines_best(tmp_path, monkeypatch, prefect_server):
    """``--regime paper`` (the paper's protocol, §4.2.3): L* = the baseline's best validation loss + tol, and the
    epochs each side read to reach it are reported."""
    monkeypatch.delenv("BCDFLOW_BENCH_SIZE", raising=False)
    rc = main(["suite", "--tiny", "--regime", "paper", "--settings", "default", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "suite.json").read_text())
    assert rc == 0 and not data["errors"] and data["suite"]["target"] == "best"
    seed = data["groups"][0]["seeds"]["0"]
    cell = seed["settings"]["default"]
    assert cell["target"] == seed["full"]["best_val"] + data["suite"]["tol"]
    n = seed["full"]["dataset"]["n_train"] * seed["full"]["dataset"]["seq_len"]
    assert cell["epochs"]["full"] == cell["tokens"]["full"] / n
    assert "L* from the baseline's best" in (tmp_path / "suite.md").read_text()


def test_streaming_benchmark_runs_the_engine_on_every_holding(tmp_path):
    """benchmarks/streaming.py on the CPU: every visit of a tiny LLaMA plan, resident, fully streamed and as the
    planner holds it for a card, through the engine's preparation and loss; the streamed weights live in the
    stream's slots only, and the host bytes and copies per step are the planner's."""
    from benchmarks.streaming import main as streaming

    res = streaming(["--set", "model.name=tiny-llama", "--set", "bcd.blocks=3", "--set", "data.seq_len=16",
                     "--set", "train.batch_size=2", "--set", "bcd.recompute=on", "--steps", "1",
                     "--blocks-to-run", "all", "--out", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text())["visits"] == res["visits"]
    assert [v["block"] for v in res["visits"]] == [0, 1, 2]
    for v in res["visits"]:
        r, s = v["resident"], v["stream"]
        assert r["tokens_per_s"] > 0 and s["tokens_per_s"] > 0 and r["planned_peak_bytes"] > 0
        assert r["copied_bytes_per_step"] == 0 and r["device_buffers"] == 0
        assert s["host_bytes"] == s["planned_host_bytes"] and s["copied_bytes_per_step"] == s["planned_copy_bytes"]
        assert s["device_buffers"] <= 2 and s["resident_layers"] == 0
    assert res["visits"][0]["stream"]["copied_bytes_per_step"] > 0  # block 0 holds the whole frozen suffix
    # bcd.expand=lora is the default: the suffix's adapters are built, attached and stepped as a visit's are
    assert [v["stream"]["expand_rank"] for v in res["visits"]] == [16, 16, 0]


def test_finetune_tiny_end_to_end(tmp_path, monkeypatch, prefect_server):
    """``python -m benchmarks finetune --profile tiny``: a base pretrained and exported as a Hugging Face checkpoint,
    fine-tuned from it (``model.from_hf``) full and BCD on text and on prompt/completion records (prompt tokens
    masked); the suite's figures per task."""
    rc = main(["finetune", "--profile", "tiny", "--seeds", "0", "--ft-steps", "10", "--bytes", "150000",
               "--base-corpus", "docsrc", "--base-steps", "6", "--target", "best", "--set", "data.seq_len=64",
               "--out", str(tmp_path)])
    data = json.loads((tmp_path / "finetune.json").read_text())
    assert rc == 0 and [r["corpus"] for r in data["rows"]] == ["text", "sft"]
    assert (tmp_path / "base-hf" / "config.json").is_file()
    for task in ("text", "sft"):
        cell = data["seeds"][task]["0"]["fixed"]
        assert f"model.from_hf={tmp_path / 'base-hf'}" in cell["run"]["sets"]
        assert ("data.format=prompt_completion" in cell["run"]["sets"]) == (task == "sft")
        assert cell["steps"]["full"] > 0 and cell["final_full"] > 0
        assert cell["target"] == cell["best_full"] + 0.02 and cell["best_full"] <= cell["final_full"]
    records = [json.loads(line) for line in next((tmp_path / "corpora").glob("sft-*.jsonl")).read_text().splitlines()]
    assert records and all(r["prompt"].lstrip().startswith(("def ", "async def ")) and r["completion"].strip()
                           for r in records)
    table = (tmp_path / "finetune.md").read_text()
    assert "B-F × mean [min–max]" in table and "\nsft " in table and "\ntext " in table
    assert data["base"]["steps"] == 6 and "on `docsrc`, 6 steps" in table and "L* = their best" in table


def test_finetune_refuses_a_base_of_no_steps_before_writing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--profile", "tiny", "--base-steps", "0", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--base-steps: must be a whole number of steps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_benchmark_command_line_leaves_prefect_to_its_settings():
    """``python -m benchmarks`` sets Prefect's home and telemetry (``cli.setup_env``) after importing its modules,
    so none of them may import Prefect (which reads its settings on import)."""
    out = subprocess.run([sys.executable, "-c", "import benchmarks.cli, sys; print('prefect' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("bnb", ["present", "hidden"])
def test_make_gpu_check_runs_its_smoke_mode_without_a_gpu(tmp_path, bnb):
    """``make gpu-check`` on a machine without a GPU (CI, this CPU): the same check at tiny shapes on the CPU, exit 0,
    a report that says no GPU figures were taken, every section run without an error, each capped visit judged, at
    most 8 files in OUT (what a lent machine sends back). With bitsandbytes hidden (a ``bitsandbytes`` that raises
    ImportError first on PYTHONPATH, as on a GPU machine without it) the light sections say skipped and the check
    still passes. So the check a GPU session runs cannot rot."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if bnb == "hidden":
        stub = tmp_path / "hide" / "bitsandbytes"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text('raise ImportError("bitsandbytes hidden by the test")\n')
        env["PYTHONPATH"] = str(stub.parent)
    out = tmp_path / "out"
    p = subprocess.run(["bash", "benchmarks/gpu/check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    files = [f for f in out.rglob("*") if not f.is_dir()]
    assert len(files) <= 8, files
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["smoke"] and "no GPU figures were taken" in (out / "gpu_check.md").read_text()
    assert report["out_files"] == len(files) and not report["failures"], report["failures"]
    sections = report["sections"]
    assert list(sections) == ["rates", "llama8b", "gpu_tests", "light_rows", "llama8b_resident", "time_model"]
    assert not [k for k, v in sections.items() if "error" in v], sections
    assert report["estimate_s"] <= 280 and all(v["estimate_s"] > 0 for v in sections.values())
    assert sections["gpu_tests"]["skipped"] == sections["gpu_tests"]["tests"] > 0
    assert {"tests/test_gpu.py", "tests/test_device.py"} <= set(sections["gpu_tests"]["files"])
    rows = [v for v in sections["llama8b"].values() if isinstance(v, dict)]
    assert len(rows) == 2 and all(r["ok"] and r["streamed_layers"] > 0 and r["checks"]["pinned_as_planned"]
                                  for r in rows), rows
    assert all(v["streamed_over_resident"] > 0 for v in sections["llama8b_resident"].values() if isinstance(v, dict))
    light = sections["light_rows"]  # issue 33: the lighter state and a row block's visit
    if bnb == "hidden":
        assert sections["rates"]["bitsandbytes"]["absent"], sections["rates"]
        assert light["skipped"].startswith("bitsandbytes absent"), light
        assert "skipped: bitsandbytes absent" in (out / "gpu_check.md").read_text()
    else:
        assert sections["rates"]["bitsandbytes"]["present"], sections["rates"]
        assert light["light_block0_16gb"]["ok"] and light["rows_embedding_8gb"]["ok"], light
        assert light["rows_embedding_8gb"]["layers"] == [0, 0] and light["rows_embedding_8gb"]["streamed_layers"] > 0
    tm = sections["time_model"]  # every measured visit predicted; judged only with measured rates (a GPU)
    measured = {k for s in ("llama8b", "light_rows") if "skipped" not in sections[s]
                for k, v in sections[s].items() if isinstance(v, dict)}
    assert not tm["judged"] and set(tm["visits"]) == measured, tm


def test_gpu_check_judges_a_capped_visit_against_its_plan_and_its_card():
    """The verdict of a capped visit on CUDA (benchmarks/gpu_check.judge) from the streaming benchmark's figures: a
    holding the planner says does not fit the card fails even when it ran; allocator retries or out-of-memory events
    in the warm-up fail as in the timed steps; a timed step that freed device memory fails; reserved past the plan
    and its reserve fails although the cap (2 GB above) let it; the memory outside the allocator counts against
    the card. The time model fails beyond its tolerance."""
    from benchmarks import gpu_check as gc
    from bcdflow.models.memory import GB, device_budget

    reserve = device_budget(24 * GB).reserve
    zero = dict.fromkeys(("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                          "num_device_free", "allocation.all.allocated", "allocation.all.freed"), 0)

    def held(planned=18 * GB, fits=True, reserved=19 * GB, outside=0.6 * GB, warm=None, timed=None):
        a = {"fits_plan": fits, "recompute": True, "streamed_layers": 20, "streamed": list(range(8, 28)),
             "resident_layers": 3, "planned_peak_bytes": planned, "host_bytes": 8, "planned_host_bytes": 8,
             "pinned_allocator_bytes": 0, "copied_bytes_per_step": 1, "planned_copy_bytes": 1, "step_s": 1.0,
             "tokens_per_s": 2048.0, "planned_step_s": 0.8, "peak_allocated_bytes": 0.9 * reserved,
             "warmup_peak_allocated_bytes": 0.9 * reserved, "peak_reserved_bytes": reserved,
             "warmup_peak_reserved_bytes": reserved, "outside_allocator_bytes": outside,
             "alloc_retries": 0, "allocator": {"build": dict(zero), "warmup": {**zero, **(warm or {})},
                                               "timed": {**zero, **(timed or {})}}}
        return {"rc": 0, "tail": None, "result": {"alloc_cap_bytes": 25.4 * GB,
                                                  "visits": [{"block": 0, "layers": [0, 4], "auto": a}]}}

    assert gc.judge(held(), 24.0, False)["ok"]
    assert gc.judge(held(fits=False), 24.0, False)["failed"] == ["planned_to_fit"]
    assert gc.judge(held(warm={"num_alloc_retries": 1}), 24.0, False)["failed"] == ["no_retry_or_oom"]
    assert gc.judge(held(timed={"num_device_free": 3}), 24.0, False)["failed"] == ["no_frees_in_timed_steps"]
    over = gc.judge(held(reserved=18 * GB + reserve + 0.1 * GB, outside=0.1 * GB), 24.0, False)
    assert over["failed"] == ["reserved_within_plan_and_reserve"] and over["cap_above_plan_and_reserve_gb"] > 0
    assert gc.judge(held(outside=5.5 * GB), 24.0, False)["failed"] == ["fits_the_card"]
    assert "allocated_within_plan" in gc.judge(held(planned=15 * GB), 24.0, False)["failed"]
    r = {"smoke": False, "sections": {"time_model": {"judged": True, "visits": {
        "a": {"ok": True, "streamed_ratio": 0.7}, "b": {"ok": False, "streamed_ratio": 0.3}}}}, "out_files": 9}
    bad = gc.verdict(r)
    assert len(bad) == 2 and bad[0].startswith("time_model b:") and "9 files" in bad[1], bad


def test_gpu_check_refuses_a_machine_with_a_gpu_but_no_cuda_torch(tmp_path):
    """A GPU on the machine (nvidia-smi answers) but no Python there whose torch sees CUDA: one line naming the
    Pythons it tried, exit 2, nothing run."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SYS_PY": sys.executable}
    p = subprocess.run(["bash", "benchmarks/gpu/check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "no Python here has a CUDA torch" in err[0] and sys.executable in err[0], err
    assert not (tmp_path / "out" / "gpu_check.json").exists()

@pytest.mark.slow
def test_peers_tiny_end_to_end(tmp_path, monkeypatch, prefect_server, capsys):
    """``python -m benchmarks peers --tiny`` (issue 35): full AdamW, bcdflow's defaults and every peer through the
    real flows on one corpus, each row with its B-F (or a lower bound), step time and CPU-tracked peak memory beside
    full AdamW's, the report and the plot written; a name the profile lacks is bad input."""
    from bcdflow.models.optimizers import OPTIMIZERS

    monkeypatch.delenv("BCDFLOW_BENCH_SIZE", raising=False)
    assert main(["peers", "--tiny", "--methods", "nope", "--out", str(tmp_path)]) == 2
    assert "--methods: unknown nope (choose from full, bcdflow, badam" in capsys.readouterr().out
    assert main(["peers", "--tiny", "--method-set", "lisa=optim.lr=1", "--out", str(tmp_path)]) == 2
    assert "--method-set: 'lisa=optim.lr=1' is not METHOD:KEY=VALUE" in capsys.readouterr().out
    # one method's tuned rate, the others' left alone
    rc = main(["peers", "--tiny", "--method-set", "lisa:optim.lr=0.004", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "peers.json").read_text())
    assert rc == 0 and not data["errors"]
    peers = {n for n, o in OPTIMIZERS.items() if o.peer}
    assert set(data["peers"]["methods"]) == {"full", "bcdflow", "adamw-lr1e-2"} | peers
    (group,) = data["groups"]
    seed = group["seeds"]["0"]
    assert seed["full"]["mode"] == "full" and seed["target"] == seed["full"]["final_val"] + data["peers"]["tol"]
    for name, cell in seed["methods"].items():
        run = cell["run"]
        assert run["mode"] == ("bcd" if name == "bcdflow" else "full"), name
        assert name in ("bcdflow", "adamw-lr1e-2") or f"optim.name={name}" in run["sets"]
        assert cell["steps"]["full"] > 0 and cell["steps"]["bcd"] > 0 and isinstance(cell["steps"]["reached"], bool)
        assert group["rows"][name]["steps"]["mean"] == cell["steps"]["value"]
        assert (run["sets"][-1] == "optim.lr=0.004") == (name == "lisa"), name
    steps = data["steps"]["l2"]["methods"]
    assert set(steps) == set(data["peers"]["methods"])
    for name, r in steps.items():
        assert r["step_s"] > 0 and r["peak_bytes"] > 0 and r["time_ratio"] > 0, name
    assert steps["full"]["time_ratio"] == 1.0 and not steps["lora"]["full_parameter"]
    assert steps["lora"]["trainable"] < steps["full"]["trainable"]
    md = (tmp_path / "peers.md").read_text()
    assert "| galore |" in md and "| bcdflow |" in md and "B-F ×" in md and "galore-torch 1.0" in md
    assert "`optim.name=lisa optim.lr=0.003 train.steps=10 optim.lr=0.004`" in md
    assert (tmp_path / "peers-pysrc.png").stat().st_size > 1000
    # --merge: one report from earlier runs' peers.json, running nothing: the same rows
    assert main(["peers", "--merge", str(tmp_path), "--out", str(tmp_path / "merged")]) == 0
    merged = (tmp_path / "merged" / "peers.md").read_text()
    assert [ln for ln in merged.splitlines() if ln.startswith("| galore")] == \
        [ln for ln in md.splitlines() if ln.startswith("| galore")]
