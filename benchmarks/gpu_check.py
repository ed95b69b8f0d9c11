"""The prepared GPU check (``make gpu-check``): what only a GPU can show about the device path, measured in one run
of under 8 minutes on one H100, into a JSON and a markdown report.

    python -m benchmarks.gpu_check OUT_DIR             # a CUDA torch (benchmarks/gpu/check.sh finds or makes one)
    python -m benchmarks.gpu_check OUT_DIR --smoke     # no GPU: the same code paths at tiny shapes on the CPU

Sections (each recorded even when another fails):

- ``gpu_tests``: ``pytest -m gpu`` (tests/test_gpu.py): streamed against resident on CUDA with the device named
  ``cuda`` and ``cuda:0``, slots and events, page-locked bytes, the allocator cap, a visit through the engine;
- ``llama8b``: Llama-3-8B's shape (benchmarks/shapes/llama-3-8b, random weights, bf16, 2 x 1024 tokens) under a
  24 GB cap, for a visit that recomputes and streams most of its suffix (block 0 of nine) and one that streams
  without recompute (block 5 of nine): peak reserved against the planner's figure and the reserve, allocator
  retries, page-locked bytes against the planner's, tokens/s against the same visit all resident (uncapped, in its
  own process), and the copy/compute overlap a profiled step shows (benchmarks/streaming.py);
- ``time_model``: host-to-device GB/s and bf16/fp32 matmul TFLOP/s measured, fed into the planner's step-time
  model (models/holding.step_time), its prediction against each measured step;
- ``engine``: one visit through the product's engine with landscape expansion on, streamed, against the same visit
  resident: losses and committed blocks within bf16 rounding;
- ``light_rows`` (issue 33): the lighter state (``adamw8bit-bf16``: bf16 master weights, 8-bit moments) on block 0
  of the 16 GB plan under a 16 GB cap, and the embedding's first row block (``bcd.vocab_blocks=2``) of the 8 GB plan
  under an 8 GB cap: peak reserved against the planner's figure and the reserve, retries, pinned bytes.

The smoke mode runs the same code on the CPU at tiny shapes (the suite runs it, tests/test_benchmarks.py, so the
check cannot rot); it takes no GPU figure and says so.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPE = str(ROOT / "benchmarks" / "shapes" / "llama-3-8b")
GB = 1e9


DEADLINE = [float("inf")]
"""Wall-clock time (time.time) by which the check must be done (``--budget``): every subprocess gets at most what is
left of it, so the report comes back however the sections go."""


def left() -> float:
    return DEADLINE[0] - time.time()


def _run(cmd: list[str], timeout: float) -> tuple[int | str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    timeout = min(timeout, left() - 15)
    if timeout < 20:
        return "skipped", "out of time (--budget)"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", str(e)


# -- the GPU tests -------------------------------------------------------------------------------------------------
def gpu_tests(out: Path, smoke: bool) -> dict:
    xml = out / "gpu-tests.xml"
    rc, log = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py",
                    f"--junitxml={xml}"], 60 if smoke else 240)
    counts = {}
    if xml.exists():
        import xml.etree.ElementTree as ET

        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["failed"] = [f"{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:300]}"
                            for c in suite.iter("testcase")
                            if c.find("failure") is not None or c.find("error") is not None]
    return {"rc": rc, **counts, "tail": log[-1500:] if rc not in (0, 5) else None}


# -- Llama-3-8B's shape under a 24 GB cap --------------------------------------------------------------------------
VISITS = {  # (block of nine, bcd.recompute): the planner chooses what streams for the card
    "block0_recompute": (0, "on"),
    "block5_no_recompute": (5, "off"),
}


def _streaming(out: Path, tag: str, args: list[str], timeout: float) -> dict:
    path = out / f"{tag}.json"
    rc, log = _run([sys.executable, "benchmarks/streaming.py", *args, "--out", str(path)], timeout)
    res = json.loads(path.read_text()) if path.exists() else None
    return {"rc": rc, "result": res, "tail": None if rc == 0 else log[-1500:]}


def _visit_args(smoke: bool, block: int, rc: str, sets: tuple[str, ...] = ("bcd.blocks=9",)) -> list[str]:
    if smoke:  # the same benchmark, a tiny LLaMA on the CPU
        base = ["--set", "model.name=tiny-llama", "--set", "model.n_layer=9", "--set", "data.seq_len=32",
                "--set", "train.batch_size=2", "--steps", "1", "--device", "cpu"]
    else:
        base = ["--set", f"model.from_hf={SHAPE}", "--set", "train.precision=bf16", "--set", "data.seq_len=1024",
                "--set", "train.batch_size=2", "--steps", "3", "--device", "cuda"]
    return [*base, *[x for k in sets for x in ("--set", k)], "--set", f"bcd.recompute={rc}", "--blocks-to-run",
            str(block)]


def llama8b(out: Path, smoke: bool) -> dict:
    """Each visit under the 24 GB cap, held as the planner holds it there (on the CPU, which has no allocator to
    cap, every frozen layer streamed, to run the slots)."""
    rows = {}
    for tag, (block, rc) in VISITS.items():
        cap = [] if smoke else ["--cap-gb", "24"]
        held = _streaming(out, f"{tag}-cap24", [*_visit_args(smoke, block, rc), *cap, "--holdings",
                                                "stream" if smoke else "auto", "--profile"], 60 if smoke else 150)
        rows[tag] = judge(held, 24.0)
    return rows


# issue 33 on the card: the lighter state and a row block at Llama-3-8B's shape, each under the card the planner
# recommends it for (docs/guide/memory-planner-fit.md, docs/guide/row-blocks.md): (card GB, settings, visit)
# the 8 GB plan (plan-memory's recommendation, expansion counted): 18 layer blocks, then the row blocks
PLAN_8GB = "bcd.boundaries=[" + ",".join(map(str, [1, 2, 3, 4, *range(5, 31, 2)])) + "]"
LIGHT_ROWS = {
    "light_block0_16gb": (16, ["optim.name=adamw8bit-bf16", "bcd.boundaries=[5,12,19,26]"], 0),
    "rows_embedding_8gb": (8, ["optim.name=adamw8bit-bf16", "bcd.vocab_blocks=2", PLAN_8GB], 18),
}
LIGHT_ROWS_SMOKE = {  # the same code paths: a tiny LLaMA of nine layers, bf16 on the CPU
    "light_block0_16gb": (16, ["optim.name=adamw8bit-bf16", "bcd.blocks=3"], 0),
    "rows_embedding_8gb": (8, ["optim.name=adamw8bit-bf16", "bcd.vocab_blocks=2", "bcd.blocks=3"], 3),
}


def light_rows(out: Path, smoke: bool) -> dict:
    """Block 0 of the 16 GB plan with bf16 master weights and 8-bit moments (``adamw8bit-bf16``), and the
    embedding's first row block of the 8 GB plan (``bcd.vocab_blocks=2``: the whole model on the gradient path, its
    layers frozen and mostly streamed), each under its card's cap, held as the planner holds it there: peak
    reserved against the planner's figure and the reserve, retries, pinned bytes (``judge``)."""
    rows = {}
    for tag, (card, sets, block) in (LIGHT_ROWS_SMOKE if smoke else LIGHT_ROWS).items():
        args = _visit_args(smoke, block, "auto", ("train.precision=bf16", *sets))
        cap = [] if smoke else ["--cap-gb", str(card)]
        held = _streaming(out, tag, [*args, *cap, "--holdings", "stream" if smoke else "auto"], 60 if smoke else 150)
        rows[tag] = judge(held, float(card))
    return rows


def llama8b_resident(out: Path, rows: dict, smoke: bool) -> dict:
    """The same visits all resident and uncapped, each in its own process: tokens/s streamed against resident."""
    done = {}
    for tag, (block, rc) in VISITS.items():
        res = _streaming(out, f"{tag}-resident", [*_visit_args(smoke, block, rc), "--holdings", "resident"],
                         60 if smoke else 120)
        r = (res.get("result") or {}).get("visits", [{}])[0].get("resident", {})
        row = {"rc": res["rc"], "tail": res["tail"]}
        if "tokens_per_s" in r:
            row.update(tokens_per_s=r["tokens_per_s"], step_s=r["step_s"])
            if "tokens_per_s" in rows.get(tag, {}):
                row["streamed_over_resident"] = rows[tag]["tokens_per_s"] / r["tokens_per_s"]
                rows[tag]["resident_step_s"] = r["step_s"]
                rows[tag]["streamed_over_resident"] = row["streamed_over_resident"]
        done[tag] = row
    return done


def judge(held: dict, card_gb: float) -> dict:
    """The capped visit's figures against the planner's: ``ok`` when it ran without an allocator retry and its
    reserved memory stayed within the planner's peak plus the reserve (the cap alone cannot say: it refuses anything
    past the card, so reserved is always within it; an out-of-memory under it is a failure too)."""
    from bcdflow.models.memory import device_budget

    row: dict = {"rc": held["rc"], "ok": False}
    if held["tail"] or not held["result"]:
        return {**row, "tail": held["tail"]}
    v = held["result"]["visits"][0]
    a = v.get("auto") or v["stream"]
    row.update(block=v["block"], layers=v["layers"], fits_plan=a.get("fits_plan"))
    if "error" in a:
        return {**row, "error": a["error"]}
    budget = device_budget(card_gb * GB)
    row.update(recompute=a["recompute"], streamed_layers=a["streamed_layers"], streamed=a["streamed"],
               resident_layers=a["resident_layers"],
               expand_rank=a.get("expand_rank"), planned_peak_gb=a["planned_peak_bytes"] / GB,
               usable_gb=budget.usable / GB, reserve_gb=budget.reserve / GB,
               peak_allocated_gb=(a["peak_allocated_bytes"] or 0) / GB,
               peak_reserved_gb=(a["peak_reserved_bytes"] or 0) / GB, alloc_retries=a["alloc_retries"],
               host_bytes=a["host_bytes"], planned_host_bytes=a["planned_host_bytes"],
               pinned_allocator_bytes=a["pinned_allocator_bytes"], copied_bytes_per_step=a["copied_bytes_per_step"],
               planned_copy_bytes=a["planned_copy_bytes"], step_s=a["step_s"], tokens_per_s=a["tokens_per_s"],
               planned_step_s=a["planned_step_s"], trace=a.get("trace"), h2d_gbs=held["result"].get("h2d_gbs"))
    if a["peak_reserved_bytes"] is not None:
        row["allocated_over_plan"] = a["peak_allocated_bytes"] / a["planned_peak_bytes"] - 1
        row["reserved_over_plan_and_reserve"] = a["peak_reserved_bytes"] / (a["planned_peak_bytes"] + budget.reserve) - 1
        row["ok"] = not a["alloc_retries"] and a["peak_reserved_bytes"] <= a["planned_peak_bytes"] + budget.reserve
    else:  # the CPU: no allocator figures, the code ran
        row["ok"] = a["host_bytes"] == a["planned_host_bytes"]
    return row


# -- the time model ------------------------------------------------------------------------------------------------
def rates(smoke: bool) -> dict:
    """Host-to-device GB/s from a page-locked buffer (as the stream's) and matmul TFLOP/s at an 8B MLP's shape."""
    if smoke:
        return {"h2d_gbs": None, "tflops": {"bf16": None, "fp32": None}}
    from bcdflow.models.stream import host_buffer

    dev = torch.device("cuda", torch.cuda.current_device())
    src = host_buffer(436 * 2**20, pin=True, device=dev)  # a Llama-3-8B layer in bf16
    dst = torch.empty_like(src, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(8):
        dst.copy_(src, non_blocking=True)
    e1.record()
    e1.synchronize()
    out = {"h2d_gbs": 8 * src.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9, "tflops": {}}
    del src, dst
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(2048, 4096, device=dev, dtype=dt)  # a step's 2 x 1024 tokens
        w = torch.randn(14336, 4096, device=dev, dtype=dt)
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        e0.record()
        for _ in range(10):
            torch.nn.functional.linear(a, w)
        e1.record()
        e1.synchronize()
        out["tflops"][name] = 10 * 2 * 2048 * 4096 * 14336 / (e0.elapsed_time(e1) / 1e3) / 1e12
        del a, w
    torch.cuda.empty_cache()
    return out


def time_model(rows: dict, smoke: bool) -> dict:
    """The planner's step time for each measured visit, with the assumed constants and with the measured ones (its
    matmuls and copies; attention kernels, norms, the optimizer and the adapters' small matmuls are not in it, so the
    calibrated prediction runs under the measured step by their share)."""
    measured = rates(smoke)
    from bcdflow.core.config import load_config
    from bcdflow.core.context import block_plan, model_config
    from bcdflow.models.holding import step_time
    from bcdflow.models.specs import PCIE_GBS, tflops_for
    from bcdflow.models.memory import visit_memory

    sets = (["model.name=tiny-llama", "model.n_layer=9", "data.seq_len=32"] if smoke else
            [f"model.from_hf={SHAPE}", "train.precision=bf16", "data.seq_len=1024"])
    run = load_config(sets=["tracking_uri=none", "bcd.blocks=9", "train.batch_size=2", *sets])
    mcfg, p = model_config(run), run.train.precision
    plan = block_plan(run, mcfg)
    out = {"measured": measured, "assumed": {"pcie_gbs": PCIE_GBS, "tflops": tflops_for(p)}, "visits": {}}
    for tag, (block, rc) in VISITS.items():
        r = rows.get(tag, {})
        if "streamed_layers" not in r:
            continue
        shape = replace(run.step_shape(), recompute="on" if r["recompute"] else "off",
                        streamed=tuple(r["streamed"]))  # as the measured run held it
        sizes = {i: f for i, (_, f) in visit_memory(mcfg, plan, block, shape).layer_sizes.items()}
        assumed = step_time(mcfg, plan, block, shape, sizes)
        row = {"assumed_streamed_s": assumed.streamed_s, "assumed_resident_s": assumed.resident_s,
               "measured_streamed_s": r.get("step_s"), "measured_resident_s": r.get("resident_step_s")}
        if measured["h2d_gbs"]:
            cal = step_time(mcfg, plan, block, replace(shape, pcie_gbs=measured["h2d_gbs"],
                                                       tflops=measured["tflops"][p]), sizes)
            row.update(calibrated_streamed_s=cal.streamed_s, calibrated_resident_s=cal.resident_s,
                       error_streamed=cal.streamed_s / r["step_s"] - 1 if r.get("step_s") else None,
                       error_resident=(cal.resident_s / r["resident_step_s"] - 1) if r.get("resident_step_s") else None)
        out["visits"][tag] = row
    return out


# -- one visit through the engine, expansion on, streamed against resident ----------------------------------------
ENGINE = ["model.name=tiny-llama", "model.n_layer=8", "model.d_model=512", "model.n_head=8", "model.n_kv_head=2",
          "data.seq_len=256", "data.vocab_size=4096", "train.batch_size=8", "data.builtin_bytes=300000",
          "bcd.blocks=3", "bcd.cycles=1", "bcd.max_steps=6", "bcd.window=3", "bcd.patience=0", "bcd.shard_rows=16",
          "optim.lr=0.003", "train.eval_rows=32", "bcd.expand=lora", "bcd.recompute=off", "tracking_uri=none"]
ENGINE_SMOKE = ["model.name=tiny-llama", "model.d_model=64", "model.n_head=4", "data.seq_len=32",
                "data.vocab_size=512", "data.builtin_bytes=60000"]


def engine_visits(store_root: str, sets: list[str], device: str, block: int = 0) -> dict:
    """Block ``block``'s visit through the train task, resident (``train.offload=off``) and streamed (``stream``) on
    ``device``, each in a store of its own under ``store_root``: both results and their committed tensors."""
    from bcdflow.core.config import load_config
    from bcdflow.core.context import RunContext
    from bcdflow.storage.checkpoints import load_from_manifest
    from bcdflow.storage.store import Store
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
    from bcdflow.tasks.run import init_run
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block

    out = {}
    for offload in ("off", "stream"):
        cfg = load_config(sets=[*sets, f"train.device={device}", f"train.offload={offload}",
                                f"store={store_root}/{offload}"])
        ds_id = prepare_data.fn(cfg, Store(cfg.store))
        init_run.fn(cfg, "r", ds_id)
        ctx = RunContext.of(cfg, "r", ds_id)
        if ctx.from_acts(block):
            for s in plan_shards.fn(ctx, 0, block):
                preinfer_shard.fn(ctx, 0, block, 0, s)
        res = train_block.fn(ctx, VisitSpec(0, block, 0))
        tensors = load_from_manifest(Store(cfg.store), "r", {"blocks": {str(b): f for b, f in res.files(block).items()}})
        out[offload] = (res, tensors, ctx.holding(block))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def engine(smoke: bool) -> dict:
    sets = [*ENGINE, *(ENGINE_SMOKE if smoke else ["train.precision=bf16"])]
    with tempfile.TemporaryDirectory() as tmp:
        pair = engine_visits(tmp, sets, "cpu:0" if smoke else "cuda")
    (off, t_off, _), (on, t_on, h_on) = pair["off"], pair["stream"]
    diff = max(float((t_off[n].float() - t_on[n].float()).abs().max()) for n in t_off)
    scale = max(float(t_off[n].float().abs().max()) for n in t_off)
    return {"streamed_layers": on.streamed, "expanded_blocks": sorted(on.suffix_files),
            "first_loss": [off.first_loss, on.first_loss], "train_loss": [off.train_loss, on.train_loss],
            "val_points": [off.val_points, on.val_points], "max_abs_diff_committed": diff,
            "committed_scale": scale, "same_tensors": sorted(t_off) == sorted(t_on),
            # bf16 rounding: a relative 2^-8 of the largest weight, accumulated over a few AdamW steps at most
            "within_bf16_rounding": sorted(t_off) == sorted(t_on) and diff <= 2 ** -8 * scale,
            "bitwise": all(torch.equal(t_off[n], t_on[n]) for n in t_off),
            "peak_allocated": [off.peak_mem_bytes, on.peak_mem_bytes], "planned_peak": h_on.estimate.peak,
            "alloc_retries": [off.alloc_retries, on.alloc_retries],
            "ok": (sorted(t_off) == sorted(t_on) and diff <= 2 ** -8 * scale and bool(on.suffix_files)
                   and off.first_loss == on.first_loss and not any(x.alloc_retries or 0 for x in (off, on)))}


# -- the report ----------------------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    s = r["sections"]
    lines = [f"# make gpu-check: {r['device']}", "",
             f"torch {r['torch']} (CUDA {r['cuda']}), Python {r['python']}, {r['wall_s']:.0f} s." +
             (" **Smoke run on the CPU: no GPU figures were taken.**" if r["smoke"] else ""), "",
             "**Failed:** " + "; ".join(r["failures"]) if r.get("failures") else "Every check passed.", ""]
    t = s.get("gpu_tests", {})
    lines += ["## GPU tests (`pytest -m gpu`)", "",
              f"{t.get('tests', '?')} tests, {t.get('failures', '?')} failed, {t.get('errors', '?')} errors, "
              f"{t.get('skipped', '?')} skipped (rc {t.get('rc')})."] + [f"- {f}" for f in t.get("failed", [])] + [""]
    lines += ["## Llama-3-8B shape, bf16, 2x1024, 24 GB cap", "",
              "| visit | recompute | streamed/resident layers | planned GB | allocated GB | reserved GB | usable GB | "
              "retries | pinned = planned | copy overlap | streamed/resident tokens/s |", "|" + "---|" * 11]
    for tag, v in s.get("llama8b", {}).items():
        if not isinstance(v, dict):
            continue
        if "streamed_layers" not in v:
            lines.append(f"| {tag} | {v.get('error') or (v.get('tail') or '')[-200:]!r} |" + " |" * 9)
            continue
        tr = v.get("trace") or {}
        lines.append(f"| {tag} | {v['recompute']} | {v['streamed_layers']}/{v['resident_layers']} | "
                     f"{v['planned_peak_gb']:.2f} | {v['peak_allocated_gb']:.2f} | {v['peak_reserved_gb']:.2f} | "
                     f"{v['usable_gb']:.2f} | {v['alloc_retries']} | {v['host_bytes'] == v['planned_host_bytes']} | "
                     f"{tr.get('overlap') if tr.get('overlap') is None else round(tr['overlap'], 2)} | "
                     f"{v.get('streamed_over_resident') and round(v['streamed_over_resident'], 2)} |")
    lines += ["", "## Issue 33: the lighter state and a row block, Llama-3-8B shape, bf16, 2x1024", "",
              "| visit | card GB | recompute | streamed/resident layers | planned GB | allocated GB | reserved GB | "
              "usable GB | retries | pinned = planned | tokens/s |", "|" + "---|" * 11]
    for tag, v in s.get("light_rows", {}).items():
        if not isinstance(v, dict):
            continue
        card = (LIGHT_ROWS.get(tag) or (None,))[0]
        if "streamed_layers" not in v:
            lines.append(f"| {tag} | {card} | {v.get('error') or (v.get('tail') or '')[-200:]!r} |" + " |" * 8)
            continue
        lines.append(f"| {tag} | {card} | {v['recompute']} | {v['streamed_layers']}/{v['resident_layers']} | "
                     f"{v['planned_peak_gb']:.2f} | {v['peak_allocated_gb']:.2f} | {v['peak_reserved_gb']:.2f} | "
                     f"{v['usable_gb']:.2f} | {v['alloc_retries']} | {v['host_bytes'] == v['planned_host_bytes']} | "
                     f"{v['tokens_per_s'] and round(v['tokens_per_s'])} |")
    tm = s.get("time_model", {})
    m = tm.get("measured", {})
    lines += ["", "## Time model", "",
              f"Measured: H2D {m.get('h2d_gbs')} GB/s, matmul TFLOP/s {m.get('tflops')}; assumed "
              f"{tm.get('assumed')}.", "", "| visit | assumed s | calibrated s | measured s | error |", "|---|---|---|---|---|"]
    for tag, v in tm.get("visits", {}).items():
        lines.append(f"| {tag} | {v['assumed_streamed_s']:.3f} | {v.get('calibrated_streamed_s')} | "
                     f"{v.get('measured_streamed_s')} | {v.get('error_streamed')} |")
    e = s.get("engine", {})
    lines += ["", "## A visit through the engine, expansion on, streamed against resident", "",
              "```", json.dumps({k: e.get(k) for k in ("streamed_layers", "expanded_blocks", "first_loss",
                                                        "train_loss", "max_abs_diff_committed",
                                                        "within_bf16_rounding", "bitwise", "error")}, indent=1),
              "```", ""]
    return "\n".join(lines)


def verdict(r: dict) -> list[str]:
    """What failed, in words (empty: the check passed). A section that errored, GPU tests that failed or did not run
    on a GPU, a capped visit that retried, ran out of memory or reserved more than the plan and its reserve, an
    engine visit streamed that is not the resident one within bf16 rounding."""
    s, bad = r["sections"], []
    bad += [f"{k}: {v['error']}" for k, v in s.items() if isinstance(v, dict) and "error" in v]
    t = s.get("gpu_tests", {})
    if not r["smoke"] and (t.get("rc") != 0 or t.get("skipped") == t.get("tests")):
        bad.append(f"gpu tests: rc {t.get('rc')}, {t.get('failures')} failed, {t.get('errors')} errors, "
                   f"{t.get('skipped')} of {t.get('tests')} skipped" + "".join(f"; {f}" for f in t.get("failed", [])))
    for sec in ("llama8b", "light_rows"):
        for tag, v in s.get(sec, {}).items():
            if isinstance(v, dict) and not v.get("ok"):
                bad.append(f"{sec} {tag}: " + (v.get("error") or v.get("tail") or
                                               f"retries {v.get('alloc_retries')}, reserved "
                                               f"{v.get('peak_reserved_gb')} GB over plan + reserve")[-300:])
    e = s.get("engine", {})
    if "ok" in e and not e["ok"]:
        bad.append(f"engine: streamed differs from resident by {e.get('max_abs_diff_committed')} (scale "
                   f"{e.get('committed_scale')}) or retried {e.get('alloc_retries')}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the prepared GPU check (make gpu-check)")
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="the same code paths on the CPU at tiny shapes")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check; each section gets what is left (default on a GPU 420: a lent "
                         "GPU's 15 minutes hold a machine start, this and a rerun; none for the smoke run)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print(f"no CUDA device visible to {sys.executable} (torch {torch.__version__}); run with --smoke for the CPU "
              "code paths", file=sys.stderr)
        return 2
    smoke = a.smoke or not cuda
    t0 = time.time()
    DEADLINE[0] = t0 + (a.budget or (float("inf") if smoke else 420.0))
    r = {"device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke)", "smoke": smoke,
         "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0], "sections": {}}

    def save() -> None:
        r["wall_s"] = time.time() - t0
        r["failures"] = verdict(r)
        (out / "gpu_check.json").write_text(json.dumps(r, indent=1, default=str))
        (out / "gpu_check.md").write_text(markdown(r))

    def section(name, fn):
        t = time.time()
        try:
            r["sections"][name] = fn() if left() > 20 else {"skipped": "out of time (--budget)"}
        except Exception as e:  # noqa: BLE001 - recorded in the report; the next sections still run
            r["sections"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        r["sections"][name]["seconds"] = round(time.time() - t, 1)
        save()  # after every section: a check cut short still reports what it measured
        print(f"[{time.time() - t0:6.1f}s] {name}: {json.dumps(r['sections'][name], default=str)[:800]}", flush=True)

    # most telling first: correctness on the card, the 24 GB figures, the engine; then the uncapped resident runs
    # (the streamed/resident ratio) and the time model, which compares against both
    section("gpu_tests", lambda: gpu_tests(out, smoke))
    section("llama8b", lambda: llama8b(out, smoke))
    section("engine", lambda: engine(smoke))
    section("light_rows", lambda: light_rows(out, smoke))
    section("llama8b_resident", lambda: {"skipped": "smoke (tests/test_benchmarks.py runs resident holdings)"}
            if smoke else llama8b_resident(out, r["sections"]["llama8b"], smoke))
    section("time_model", lambda: time_model(r["sections"]["llama8b"], smoke))
    save()
    print(f"report: {out / 'gpu_check.md'}" + (" (smoke run on the CPU: no GPU figures were taken)" if smoke else ""))
    for f in r["failures"]:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
