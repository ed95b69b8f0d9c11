"""The prepared GPU check (``make gpu-check``): what only a GPU can show about the device path, measured in one run
that fits 5 minutes on one H100/H200 by its own estimate (``SECTIONS``, ``--budget``), so that a lent GPU's
15 minutes hold a machine start, this and a rerun; into a JSON and a markdown report, at most ``MAX_OUT_FILES``
files in all (what a lent machine sends back).

    python -m benchmarks.gpu_check OUT_DIR --budget 270   # a CUDA torch (benchmarks/gpu/check.sh finds or makes one)
    python -m benchmarks.gpu_check OUT_DIR --smoke        # no GPU: the same code paths at tiny shapes on the CPU

Sections, in this order, each with its estimate on an H100/H200 (each recorded even when another fails; one whose
estimate exceeds what is left of the budget is skipped, and that is a failure: the check did not finish):

- ``rates`` (in a process of its own, so the measuring processes start from an empty card): host-to-device GB/s
  from a page-locked buffer and bf16/fp32 matmul TFLOP/s (the time model's rates, printed as the
  ``train.tflops=... train.pcie_gbs=...`` a run on this machine should set), the device memory outside the caching
  allocator (context, kernel modules, cuBLAS), and whether bitsandbytes runs here (``adamw8bit-bf16``'s step);
- ``llama8b``: Llama-3-8B's shape (benchmarks/shapes/llama-3-8b, random weights, bf16, 2 x 1024 tokens) planned for a
  24 GB card, a visit that recomputes and streams most of its suffix (block 0 of nine) and one that streams without
  recompute (block 5 of nine), each in its own process (benchmarks/streaming.py), judged by ``judge``;
- ``gpu_tests``: ``pytest -m gpu`` over every test file of tests/ with a ``gpu`` mark;
- ``light_rows`` (issue 33; "skipped: bitsandbytes absent" where it is): the lighter state (``adamw8bit-bf16``) on
  block 0 of the 16 GB plan, and the embedding's first row block (``bcd.vocab_blocks=2``) of the 8 GB plan, judged
  as the 24 GB visits are;
- ``llama8b_resident``: the two 24 GB visits all resident and uncapped, in one process: tokens/s streamed against
  resident;
- ``time_model``: the planner's step time (models/holding.step_time) with the measured rates against each measured
  step, failed beyond a factor of ``TIME_TOLERANCE`` either way.

A capped visit (``judge``) fails when the planner's holding does not fit the card by the planner's own figures, when
the allocator retried or ran out of memory in the build, the warm-up or the timed steps, when a timed step freed
device memory (a cache flush, partial ones included), when its peak allocated bytes exceed the plan by over
``ALLOC_TOLERANCE``, its peak reserved bytes the plan and its reserve, or its peak reserved plus the device memory
measured outside the allocator the card, and when the page-locked bytes are not the planner's. Its allocator is
capped ``ALLOC_HEADROOM_GB`` above the card less what is measured outside it, so none of these is implied by the cap.

The smoke mode runs the same code on the CPU at tiny shapes (the suite runs it, tests/test_benchmarks.py, so the
check cannot rot); it takes no GPU figure, judges no timing and says so.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPE = str(ROOT / "benchmarks" / "shapes" / "llama-3-8b")
GB = 1e9
MB = 2**20

BUDGET_S = 270.0
"""The default ``--budget`` on a GPU: 4.5 minutes, so ``make gpu-check`` with the wheels' install stays within 5."""
SECTIONS = {  # name: (estimated seconds on one H100/H200, the processes it starts), run in this order
    "rates": (10, "one process: CUDA context, 9 x 436 MB copies, 26 matmuls, bitsandbytes' import and one step"),
    "llama8b": (60, "two processes at 30 s: start 8 s, an 8B part drawn and placed 12 s, 5 steps and a profiled one"),
    "gpu_tests": (90, "pytest: collection 10 s, test_device's 6 visits in their own processes 25 s, test_gpu 55 s"),
    "light_rows": (60, "two processes at 30 s, as llama8b's"),
    "llama8b_resident": (40, "one process: two 8B visits resident, uncapped"),
    "time_model": (2, "arithmetic in this process"),
}
"""What each section should take on an H100/H200 (no GPU has timed this version yet: each run records its sections'
seconds beside these, to correct them). A section starts only if its estimate fits what is left of the budget."""
LIMITS = {"rates": 60, "visit": 90, "resident": 100, "gpu_tests": 150}
"""Seconds a process of a section may run (about twice its estimate) before it is killed with its process group."""
MAX_OUT_FILES = 8
"""Files a lent GPU machine sends back from OUT: the check writes gpu_check.json, gpu_check.md, gpu-tests.xml and
streaming.json (the visits' raw figures), and fails if OUT holds more."""
ALLOC_TOLERANCE = 0.10
"""A capped visit's peak allocated bytes may exceed the planner's peak by this share (and 2 MB of the allocator's
rounding), as tests/test_gpu.py allows."""
ALLOC_HEADROOM_GB = 2.0
"""How far above the card less the memory measured outside the allocator a capped visit's allocator is capped, so that
reserved bytes past the plan and its reserve, or past the card, are measured rather than refused."""
TIME_TOLERANCE = 2.0
"""The time model's step time with the measured rates must be within this factor of the measured step, either way
(it leaves out attention kernels, norms and the optimizer, so it runs under the measured step by their share)."""

DEADLINE = [float("inf")]
"""Wall-clock time (time.time) by which the check must be done (``--budget``): every subprocess gets at most what is
left of it, so the report comes back however the sections go."""


RUNNING: list[subprocess.Popen] = []
"""The process a section is waiting on, killed with its group if this one is told to stop (check.sh's timeout)."""


def left() -> float:
    return DEADLINE[0] - time.time()


def _stop(signum, frame) -> None:
    """SIGTERM: kill the running process (and its group), skip what is left, and let the report be written."""
    DEADLINE[0] = 0.0
    for p in RUNNING:
        os.killpg(p.pid, signal.SIGKILL)


def _run(cmd: list[str], limit: float) -> tuple[int | str, str]:
    """``cmd`` from the checkout with its output, killed with its process group (a test's worker processes too) after
    ``limit`` seconds or at the deadline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    timeout = min(limit, left() - 10)
    if timeout < 5:
        return "skipped", "out of time (--budget)"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                         start_new_session=True)
    RUNNING[:] = [p]
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()  # what it printed before (communicate keeps it across the timeout)
        return "timeout", f"{out or ''}\n[killed after {timeout:.0f} s]"
    finally:
        RUNNING.clear()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# -- rates: in a process of its own --------------------------------------------------------------------------------
def probe(smoke: bool) -> dict:
    """The device, the time model's rates, the memory outside the allocator and bitsandbytes (``--probe``)."""
    dev = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    out: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if smoke:
        out.update(device="cpu (smoke)", h2d_gbs=None, tflops={"bf16": None, "fp32": None})
    else:
        props = torch.cuda.get_device_properties(dev)
        out.update(device=props.name, total_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                   **rates(dev))
        free, total = torch.cuda.mem_get_info(dev)  # after the matmuls: context, cuBLAS and its modules loaded
        out["outside_allocator_bytes"] = int(total - free - torch.cuda.memory_reserved(dev))
    out["bitsandbytes"] = bnb_probe(dev)
    return out


def rates(dev: torch.device) -> dict:
    """Host-to-device GB/s from a page-locked buffer (as the stream's) and matmul TFLOP/s at an 8B MLP's shape."""
    from bcdflow.models.stream import host_buffer

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


def bnb_probe(dev: torch.device) -> dict:
    """Whether ``adamw8bit-bf16`` (bitsandbytes' 8-bit moments, models/light.py) steps on ``dev``: ``present`` false
    with ``absent`` where bitsandbytes cannot be imported, with ``why`` where it imports but does not run here (its
    native library for this CUDA missing, say)."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - ImportError, or what a broken install raises on import
        return {"present": False, "absent": True, "why": _first_line(e)}
    try:
        from bcdflow.models.specs import OptimSpec
        from bcdflow.models.trainer import make_optimizer

        w = torch.zeros(64, 128, dtype=torch.bfloat16, device=dev, requires_grad=True)  # over the 8-bit floor (4096)
        opt = make_optimizer([w], OptimSpec("adamw8bit-bf16", lr=1e-2))
        w.grad = torch.ones_like(w)
        opt.step()
        moved = bool((w.detach().float() != 0).all())
        lib = getattr(getattr(bnb, "cextension", None), "lib", None)
        name = getattr(getattr(lib, "_lib", None), "_name", None)
        return {"present": moved, "absent": False, "version": bnb.__version__,
                "library": os.path.basename(name) if name else type(lib).__name__,
                **({} if moved else {"why": "a step left the weights unchanged"})}
    except Exception as e:  # noqa: BLE001 - recorded: the light sections say why they did not run
        return {"present": False, "absent": False, "version": getattr(bnb, "__version__", None),
                "why": _first_line(e)}


def rates_section(tmp: Path, smoke: bool) -> dict:
    path = tmp / "probe.json"
    rc, log = _run([sys.executable, "-m", "benchmarks.gpu_check", str(tmp), "--probe", str(path),
                    *(["--smoke"] if smoke else [])], LIMITS["rates"])
    if not path.exists():
        return {"rc": rc, "error": f"the probe did not report (rc {rc}): {log[-500:]}"}
    return {"rc": rc, **json.loads(path.read_text())}


def overrides(rates: dict) -> str | None:
    """The time model's rates measured here as the config overrides a run on this machine should set."""
    t = rates.get("tflops") or {}
    if not rates.get("h2d_gbs") or not t.get("bf16"):
        return None
    return (f"train.tflops={t['bf16']:.0f} train.pcie_gbs={rates['h2d_gbs']:.1f} (train.precision=bf16; "
            f"train.tflops={t['fp32']:.0f} with fp32)")


# -- the GPU tests -------------------------------------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """Every test file of tests/ with a ``gpu`` mark (not the whole folder: collecting every file would import what
    a GPU machine lacks, MLflow and moto among them)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def gpu_tests(out: Path, smoke: bool) -> dict:
    xml, files = out / "gpu-tests.xml", gpu_test_files()
    xml.unlink(missing_ok=True)
    rc, log = _run([sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", *files,
                    f"--junitxml={xml}"], LIMITS["gpu_tests"])
    row: dict = {"rc": rc, "files": files}
    if xml.exists():
        import xml.etree.ElementTree as ET

        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        row.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        row["failed"] = [f"{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:300]}"
                         for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
    else:  # killed: what pytest -v printed of each test before
        done = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, re.M)
        row.update(tests=len(done), failures=sum(s == "FAILED" for _, s in done),
                   errors=sum(s == "ERROR" for _, s in done), skipped=sum(s == "SKIPPED" for _, s in done),
                   failed=[f"{t}: {s}" for t, s in done if s in ("FAILED", "ERROR")])
    row["tail"] = log[-1500:] if rc not in (0, 5) else None
    return row


# -- the visits under a card's cap ---------------------------------------------------------------------------------
# issue 33 on the card: the lighter state and a row block at Llama-3-8B's shape, each under the card the planner
# recommends it for (docs/guide/memory-planner-fit.md, docs/guide/row-blocks.md). The 8 GB plan (plan-memory's
# recommendation, expansion counted): 18 layer blocks, then the row blocks
PLAN_8GB = "bcd.boundaries=[" + ",".join(map(str, [1, 2, 3, 4, *range(5, 31, 2)])) + "]"
VISITS = {  # tag: (section, card GB, block, settings)
    "block0_recompute": ("llama8b", 24, 0, ("bcd.blocks=9", "bcd.recompute=on")),
    "block5_no_recompute": ("llama8b", 24, 5, ("bcd.blocks=9", "bcd.recompute=off")),
    "light_block0_16gb": ("light_rows", 16, 0, ("optim.name=adamw8bit-bf16", "bcd.boundaries=[5,12,19,26]")),
    "rows_embedding_8gb": ("light_rows", 8, 18, ("optim.name=adamw8bit-bf16", "bcd.vocab_blocks=2", PLAN_8GB)),
}
VISITS_SMOKE = {  # the same code paths: a tiny LLaMA of nine layers on the CPU
    "block0_recompute": ("llama8b", 24, 0, ("bcd.blocks=9", "bcd.recompute=on")),
    "block5_no_recompute": ("llama8b", 24, 5, ("bcd.blocks=9", "bcd.recompute=off")),
    "light_block0_16gb": ("light_rows", 16, 0, ("train.precision=bf16", "optim.name=adamw8bit-bf16", "bcd.blocks=3")),
    "rows_embedding_8gb": ("light_rows", 8, 3, ("train.precision=bf16", "optim.name=adamw8bit-bf16",
                                                "bcd.vocab_blocks=2", "bcd.blocks=3")),
}


def visits(smoke: bool, section: str | None = None) -> dict:
    return {t: v for t, v in (VISITS_SMOKE if smoke else VISITS).items() if section in (None, v[0])}


def visit_sets(smoke: bool, tag: str) -> list[str]:
    """The run config of visit ``tag`` (the streaming benchmark's ``--set``s, and the time model's)."""
    base = (["model.name=tiny-llama", "model.n_layer=9", "data.seq_len=32"] if smoke else  # fp32 on the CPU: faster
            [f"model.from_hf={SHAPE}", "data.seq_len=1024", "train.precision=bf16"])
    return [*base, "train.batch_size=2", *visits(smoke)[tag][3]]


def _visit_args(smoke: bool, tag: str, holding: str, out: Path) -> list[str]:
    """benchmarks/streaming.py's arguments for visit ``tag`` held ``holding`` (``auto``: the planner's holding for its
    card, capped there; ``resident``: uncapped). On the CPU, which has no allocator to cap, every frozen layer
    streams instead of ``auto``, to run the slots."""
    section, card, block, _ = visits(smoke)[tag]
    args = [x for s in visit_sets(smoke, tag) for x in ("--set", s)]
    args += ["--steps", "1", "--device", "cpu"] if smoke else ["--steps", "3", "--device", "cuda"]
    if holding == "auto" and not smoke:
        args += ["--cap-gb", str(card), "--alloc-headroom-gb", str(ALLOC_HEADROOM_GB)]
        args += ["--profile"] if section == "llama8b" else []
    return [*args, "--holdings", "stream" if smoke and holding == "auto" else holding, "--blocks-to-run", str(block),
            "--out", str(out)]


def capped(tmp: Path, raw: dict, section: str, smoke: bool) -> dict:
    """Each of the section's visits in its own process, held as the planner holds it for its card, judged."""
    rows = {}
    for tag, (_, card, _, _) in visits(smoke, section).items():
        path = tmp / f"{tag}-auto.json"
        rc, log = _run([sys.executable, "benchmarks/streaming.py", *_visit_args(smoke, tag, "auto", path)],
                       LIMITS["visit"])
        raw[f"{tag}-auto"] = res = json.loads(path.read_text()) if path.exists() else None
        rows[tag] = judge({"rc": rc, "result": res, "tail": None if rc == 0 else log[-1500:]}, float(card), smoke)
    return rows


def judge(held: dict, card_gb: float, smoke: bool) -> dict:
    """A capped visit's figures against the planner's, as named checks (``ok``: all hold; ``failed``: those that do
    not, in words). On the CPU only the plan's fit and the page-locked bytes are judged (no allocator)."""
    from bcdflow.models.memory import device_budget

    row: dict = {"rc": held["rc"], "ok": False}
    if held["tail"] or not held["result"]:
        return {**row, "failed": [f"did not run (rc {held['rc']})"], "tail": held["tail"]}
    v = held["result"]["visits"][0]
    a = v.get("auto") or v["stream"]
    row.update(block=v["block"], layers=v["layers"], fits_plan=a.get("fits_plan"))
    if "error" in a:
        return {**row, "error": a["error"], "failed": [f"{a['error']} under the {card_gb:g} GB card"]}
    budget, planned = device_budget(card_gb * GB), a["planned_peak_bytes"]
    row.update(recompute=a["recompute"], streamed_layers=a["streamed_layers"], streamed=a["streamed"],
               resident_layers=a["resident_layers"], expand_rank=a.get("expand_rank"), card_gb=card_gb,
               planned_peak_gb=planned / GB, usable_gb=budget.usable / GB, reserve_gb=budget.reserve / GB,
               host_bytes=a["host_bytes"], planned_host_bytes=a["planned_host_bytes"],
               pinned_allocator_bytes=a["pinned_allocator_bytes"], copied_bytes_per_step=a["copied_bytes_per_step"],
               planned_copy_bytes=a["planned_copy_bytes"], step_s=a["step_s"], tokens_per_s=a["tokens_per_s"],
               planned_step_s=a["planned_step_s"], trace=a.get("trace"), h2d_gbs=held["result"].get("h2d_gbs"))
    checks = {"planned_to_fit": bool(a.get("fits_plan")),  # a holding the planner says overflows the card fails
              "pinned_as_planned": a["host_bytes"] == a["planned_host_bytes"]}
    if a.get("allocator") is not None:  # CUDA: the allocator's own figures, over the build, warm-up and timed steps
        phases, outside = a["allocator"], a["outside_allocator_bytes"]
        alloc = max(a["peak_allocated_bytes"], a["warmup_peak_allocated_bytes"])
        reserved = max(a["peak_reserved_bytes"], a["warmup_peak_reserved_bytes"])
        cap = held["result"].get("alloc_cap_bytes")
        row.update(peak_allocated_gb=alloc / GB, peak_reserved_gb=reserved / GB, outside_allocator_gb=outside / GB,
                   alloc_cap_gb=cap and cap / GB, allocator=phases, alloc_retries=a["alloc_retries"],
                   allocated_over_plan=alloc / planned - 1,
                   reserved_over_plan_and_reserve=reserved / (planned + budget.reserve) - 1,
                   # how far the cap sat above what is judged: > 0, so the reserved check is not the cap's
                   cap_above_plan_and_reserve_gb=cap and (cap - planned - budget.reserve) / GB)
        checks.update(
            no_retry_or_oom=all(p["num_alloc_retries"] == 0 and p["num_ooms"] == 0 for p in phases.values()),
            no_frees_in_timed_steps=phases["timed"]["num_device_free"] == 0
            and phases["timed"]["num_sync_all_streams"] == 0,
            allocated_within_plan=alloc <= (1 + ALLOC_TOLERANCE) * planned + 2 * MB,
            reserved_within_plan_and_reserve=reserved <= planned + budget.reserve,
            fits_the_card=reserved + outside <= card_gb * GB)
    elif not smoke:
        checks["allocator_figures"] = False
    row["checks"] = checks
    row["failed"] = [k for k, ok in checks.items() if not ok]
    row["ok"] = not row["failed"]
    return row


def light_rows(tmp: Path, raw: dict, smoke: bool, bnb: dict) -> dict:
    """Block 0 of the 16 GB plan with bf16 master weights and 8-bit moments (``adamw8bit-bf16``), and the
    embedding's first row block of the 8 GB plan (``bcd.vocab_blocks=2``: the whole model on the gradient path, its
    layers frozen and mostly streamed), each under its card's cap, judged as the 24 GB visits are."""
    if not bnb:
        return {"skipped": "bitsandbytes not probed (the rates section failed)"}
    if not bnb.get("present"):
        what = "bitsandbytes absent" if bnb.get("absent") else "bitsandbytes does not run here"
        return {"skipped": f"{what} ({bnb.get('why')})", "bitsandbytes": bnb}
    return capped(tmp, raw, "light_rows", smoke)


def resident(tmp: Path, raw: dict, rows: dict, smoke: bool) -> dict:
    """The 24 GB visits all resident and uncapped, one after the other in one process (their memory is not judged):
    tokens/s streamed against resident."""
    tags = list(visits(smoke, "llama8b"))
    spec = tmp / "resident.json"
    spec.write_text(json.dumps([_visit_args(smoke, t, "resident", tmp / f"{t}-resident.json") for t in tags]))
    rc, log = _run([sys.executable, "-m", "benchmarks.gpu_check", str(tmp), "--streaming-batch", str(spec)],
                   LIMITS["resident"])
    done = {}
    for tag in tags:
        path = tmp / f"{tag}-resident.json"
        raw[f"{tag}-resident"] = res = json.loads(path.read_text()) if path.exists() else None
        r = ((res or {}).get("visits") or [{}])[0].get("resident", {})
        row = {"rc": rc}
        if "step_s" in r:
            row.update(tokens_per_s=r["tokens_per_s"], step_s=r["step_s"], recompute=r["recompute"])
            if "tokens_per_s" in rows.get(tag, {}):
                row["streamed_over_resident"] = rows[tag]["tokens_per_s"] / r["tokens_per_s"]
                rows[tag].update(resident_step_s=r["step_s"], streamed_over_resident=row["streamed_over_resident"])
        else:
            row.update(error=r.get("error") or "no figure", tail=log[-1500:])
        done[tag] = row
    return done


def streaming_batch(spec: Path) -> int:
    """``--streaming-batch``: benchmarks/streaming.py's runs listed in ``spec``, one after the other in this process."""
    from benchmarks.streaming import main as streaming

    bad = 0
    for args in json.loads(spec.read_text()):
        try:
            streaming(args)
        except Exception as e:  # noqa: BLE001 - the next run still goes; the caller finds no JSON for this one
            print(f"FAILED {' '.join(args)}: {_first_line(e)}", file=sys.stderr)
            bad += 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 1 if bad else 0


# -- the time model ------------------------------------------------------------------------------------------------
def time_model(rows: dict, rates: dict, smoke: bool) -> dict:
    """The planner's step time for each measured visit, with its assumed rates and with the measured ones (its
    matmuls and copies; attention kernels, norms, the optimizer and the adapters' small matmuls are not in it, so the
    calibrated prediction runs under the measured step by their share), against the measured steps: ``ok`` when
    every calibrated prediction is within ``TIME_TOLERANCE`` of its measured step (not judged on the CPU)."""
    from bcdflow.core.config import load_config
    from bcdflow.core.context import block_plan, model_config
    from bcdflow.models.holding import step_time
    from bcdflow.models.memory import visit_memory

    h2d, tflops = rates.get("h2d_gbs"), rates.get("tflops") or {}
    out: dict = {"measured": {"h2d_gbs": h2d, "tflops": tflops}, "tolerance": TIME_TOLERANCE, "visits": {},
                 "judged": bool(h2d) and not smoke}
    for tag, r in rows.items():
        if "streamed_layers" not in r or not r.get("step_s"):
            continue
        run = load_config(sets=["tracking_uri=none", *visit_sets(smoke, tag)])
        mcfg, block = model_config(run), visits(smoke)[tag][2]
        plan = block_plan(run, mcfg)
        shape = replace(run.step_shape(), recompute="on" if r["recompute"] else "off",
                        streamed=tuple(r["streamed"]))  # as the measured run held it
        sizes = {i: f for i, (_, f) in visit_memory(mcfg, plan, block, shape).layer_sizes.items()}
        assumed = step_time(mcfg, plan, block, shape, sizes)
        out["assumed"] = {"pcie_gbs": shape.pcie_gbs, "tflops": shape.tflops}
        row = {"assumed_streamed_s": assumed.streamed_s, "assumed_resident_s": assumed.resident_s,
               "measured_streamed_s": r["step_s"], "measured_resident_s": r.get("resident_step_s")}
        if h2d and tflops.get(run.train.precision):
            cal = step_time(mcfg, plan, block, replace(shape, pcie_gbs=h2d, tflops=tflops[run.train.precision]), sizes)
            row.update(calibrated_streamed_s=cal.streamed_s, calibrated_resident_s=cal.resident_s,
                       streamed_ratio=cal.streamed_s / r["step_s"])
            if r.get("resident_step_s"):
                row["resident_ratio"] = cal.resident_s / r["resident_step_s"]
            ratios = [row[k] for k in ("streamed_ratio", "resident_ratio") if k in row]
            row["ok"] = all(1 / TIME_TOLERANCE <= x <= TIME_TOLERANCE for x in ratios)
        out["visits"][tag] = row
    return out


# -- the report ----------------------------------------------------------------------------------------------------
def _gb(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _visit_table(rows: dict) -> list[str]:
    lines = ["| visit | card GB | recompute | streamed/resident layers | planned GB | allocated GB | reserved GB | "
             "outside GB | usable GB | retries/OOMs | timed frees | pinned = planned | tokens/s | failed |",
             "|" + "---|" * 14]
    for tag, v in rows.items():
        if not isinstance(v, dict):
            continue
        if "streamed_layers" not in v:
            lines.append(f"| {tag} | {v.get('card_gb', '')} | {v.get('error') or (v.get('tail') or '')[-200:]!r} |"
                         + " |" * 10 + f" {', '.join(v.get('failed', []))} |")
            continue
        ph = v.get("allocator") or {}
        retries = ("/".join(str(sum(p[k] for p in ph.values())) for k in ("num_alloc_retries", "num_ooms"))
                   if ph else "-")
        frees = ph.get("timed", {}).get("num_device_free", "-") if ph else "-"
        lines.append(f"| {tag} | {v['card_gb']:g} | {v['recompute']} | {v['streamed_layers']}/{v['resident_layers']} | "
                     f"{_gb(v['planned_peak_gb'])} | {_gb(v.get('peak_allocated_gb'))} | "
                     f"{_gb(v.get('peak_reserved_gb'))} | {_gb(v.get('outside_allocator_gb'))} | "
                     f"{_gb(v['usable_gb'])} | {retries} | {frees} | {v['host_bytes'] == v['planned_host_bytes']} | "
                     f"{v['tokens_per_s'] and round(v['tokens_per_s'])} | {', '.join(v['failed']) or '-'} |")
    return lines


def markdown(r: dict) -> str:
    s = r["sections"]
    lines = [f"# make gpu-check: {r['device']}", "",
             f"torch {r['torch']} (CUDA {r['cuda']}), Python {r['python']}, {r['wall_s']:.0f} s "
             f"(budget {r['budget_s'] or 'none'}, estimate on an H100/H200 {r['estimate_s']} s)." +
             (" **Smoke run on the CPU: no GPU figures were taken.**" if r["smoke"] else ""), "",
             "**Failed:** " + "; ".join(r["failures"]) if r.get("failures") else "Every check passed.", "",
             "| section | estimate s | seconds | |", "|---|---|---|---|"]
    lines += [f"| {k} | {est} | {s.get(k, {}).get('seconds', '-')} | "
              f"{s[k]['skipped'] if isinstance(s.get(k, {}).get('skipped'), str) else ''} |"
              for k, (est, _) in SECTIONS.items()]
    rt = s.get("rates", {})
    bnb = rt.get("bitsandbytes") or {}
    lines += ["", "## Rates", "",
              f"H2D {_num(rt.get('h2d_gbs'))} GB/s, matmul TFLOP/s {rt.get('tflops')}, "
              f"{_gb(rt.get('outside_allocator_bytes') and rt['outside_allocator_bytes'] / GB)} GB outside the "
              "allocator; bitsandbytes: "
              + (f"{bnb.get('version')} ({bnb.get('library')})" if bnb.get("present") else f"no ({bnb.get('why')})")]
    if r.get("overrides"):
        lines += ["", f"A run on this machine: `{r['overrides']}`"]
    t = s.get("gpu_tests", {})
    lines += ["", f"## GPU tests (`pytest -m gpu {' '.join(t.get('files', []))}`)", "",
              f"{t.get('tests', '?')} tests, {t.get('failures', '?')} failed, {t.get('errors', '?')} errors, "
              f"{t.get('skipped', '?')} skipped (rc {t.get('rc')})."] + [f"- {f}" for f in t.get("failed", [])] + [""]
    lines += ["## Llama-3-8B shape, bf16, 2x1024, planned for 24 GB", ""] + _visit_table(s.get("llama8b", {}))
    lines += ["", "## Issue 33: the lighter state and a row block, Llama-3-8B shape, bf16, 2x1024", ""]
    light = s.get("light_rows", {})
    lines += [f"Not run, skipped: {light['skipped']}"] if "skipped" in light else _visit_table(light)
    lines += ["", "## Streamed against resident", "", "| visit | resident tokens/s | streamed/resident |",
              "|---|---|---|"]
    for tag, v in s.get("llama8b_resident", {}).items():
        if isinstance(v, dict):
            lines.append(f"| {tag} | {v.get('tokens_per_s') and round(v['tokens_per_s'])} | "
                         f"{v.get('streamed_over_resident') and round(v['streamed_over_resident'], 2)} |")
    tm = s.get("time_model", {})
    lines += ["", f"## Time model (calibrated within {TIME_TOLERANCE:g}x of measured"
              + ("" if tm.get("judged") else ": not judged here") + ")", "",
              f"Measured: {tm.get('measured')}; assumed {tm.get('assumed')}.", "",
              "| visit | assumed s | calibrated s | measured s | resident: calibrated s | measured s | ok |",
              "|---|---|---|---|---|---|---|"]
    for tag, v in tm.get("visits", {}).items():
        lines.append(f"| {tag} | {_num(v['assumed_streamed_s'])} | {_num(v.get('calibrated_streamed_s'))} | "
                     f"{_num(v['measured_streamed_s'])} | {_num(v.get('calibrated_resident_s'))} | "
                     f"{_num(v.get('measured_resident_s'))} | {v.get('ok', '-')} |")
    return "\n".join(lines) + "\n"


def verdict(r: dict) -> list[str]:
    """What failed, in words (empty: the check passed): a section that errored or did not run in the budget, GPU
    tests that failed or did not run on a GPU, a capped visit that failed a check of ``judge``, bitsandbytes present
    but not running here, a calibrated step time beyond ``TIME_TOLERANCE``, more files in OUT than come back."""
    s, bad = r["sections"], []
    bad += [f"{k}: {v['error']}" for k, v in s.items() if isinstance(v, dict) and "error" in v]
    bad += [f"{k}: not run, {v['skipped']}" for k, v in s.items()
            if isinstance(v, dict) and "out of time" in str(v.get("skipped", ""))]
    t = s.get("gpu_tests", {})
    if "rc" in t and (t["rc"] not in (0, 5) if r["smoke"] else (t["rc"] != 0 or t.get("skipped") == t.get("tests"))):
        bad.append(f"gpu tests: rc {t.get('rc')}, {t.get('failures')} failed, {t.get('errors')} errors, "
                   f"{t.get('skipped')} of {t.get('tests')} skipped" + "".join(f"; {f}" for f in t.get("failed", [])))
    bnb = s.get("rates", {}).get("bitsandbytes") or {}
    if bnb and not bnb.get("present") and not bnb.get("absent"):
        bad.append(f"bitsandbytes is installed but adamw8bit-bf16 does not step here: {bnb.get('why')}")
    for sec in ("llama8b", "light_rows"):
        for tag, v in ({} if "skipped" in s.get(sec, {}) else s.get(sec, {})).items():
            if isinstance(v, dict) and not v.get("ok"):
                bad.append(f"{sec} {tag}: " + ", ".join(v.get("failed", [])) +
                           (f": {(v.get('error') or v.get('tail') or '')[-300:]}" if "checks" not in v else ""))
    for tag, v in s.get("llama8b_resident", {}).items():
        if isinstance(v, dict) and "error" in v:
            bad.append(f"llama8b_resident {tag}: {v['error']}")
    tm = s.get("time_model", {})
    if tm.get("judged"):
        bad += [f"time_model {tag}: calibrated/measured step {v.get('streamed_ratio')} streamed, "
                f"{v.get('resident_ratio')} resident, beyond {TIME_TOLERANCE:g}x"
                for tag, v in tm.get("visits", {}).items() if v.get("ok") is False]
    if r.get("out_files", 0) > MAX_OUT_FILES:
        bad.append(f"{r['out_files']} files in OUT, more than the {MAX_OUT_FILES} a lent machine sends back")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the prepared GPU check (make gpu-check)")
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="the same code paths on the CPU at tiny shapes")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole check (default on a GPU {BUDGET_S:.0f}; none for the smoke run): a "
                         "section starts only if its estimate fits what is left, each process gets at most that")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # the rates section's own process
    ap.add_argument("--streaming-batch", default=None, help=argparse.SUPPRESS)  # the resident visits' process
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.probe:
        Path(a.probe).write_text(json.dumps(probe(a.smoke or not cuda)))
        return 0
    if a.streaming_batch:
        return streaming_batch(Path(a.streaming_batch))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not cuda and not a.smoke:
        print(f"no CUDA device visible to {sys.executable} (torch {torch.__version__}); run with --smoke for the CPU "
              "code paths", file=sys.stderr)
        return 2
    smoke = a.smoke or not cuda
    t0 = time.time()
    budget = a.budget or (None if smoke else BUDGET_S)
    DEADLINE[0] = t0 + (budget or float("inf"))
    signal.signal(signal.SIGTERM, _stop)
    estimate = sum(est for est, _ in SECTIONS.values())
    # this process never touches the GPU: each measuring process finds the card empty (mem_get_info is the device's)
    r = {"device": "cpu (smoke)" if smoke else "cuda", "smoke": smoke, "torch": torch.__version__,
         "cuda": torch.version.cuda, "python": sys.version.split()[0], "budget_s": budget, "estimate_s": estimate,
         "sections": {}}
    print(f"gpu-check: {', '.join(f'{k} {est} s' for k, (est, _) in SECTIONS.items())}: {estimate} s estimated on an "
          f"H100/H200, budget {budget or 'none (smoke)'} s", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # the processes' own JSON: not in OUT, which sends back 8 files
    raw: dict = {}

    def save() -> None:
        r["wall_s"] = time.time() - t0
        (out / "streaming.json").write_text(json.dumps(raw, indent=1, default=str))
        # every file under OUT, the two reports written next included
        r["out_files"] = sum(1 for p in out.rglob("*") if not p.is_dir()) + sum(
            not (out / f).exists() for f in ("gpu_check.json", "gpu_check.md"))
        r["failures"] = verdict(r)
        (out / "gpu_check.json").write_text(json.dumps(r, indent=1, default=str))
        (out / "gpu_check.md").write_text(markdown(r))

    def section(name, fn):
        t, est = time.time(), SECTIONS[name][0]
        try:
            if left() < est:  # the budget's end, or SIGTERM (_stop)
                res = {"skipped": f"out of time (--budget): {max(left(), 0):.0f} s left, estimate {est} s"}
            else:
                res = fn()
        except Exception as e:  # noqa: BLE001 - recorded in the report; the next sections still run
            res = {"error": _first_line(e)}
        r["sections"][name] = {**res, "estimate_s": est, "seconds": round(time.time() - t, 1)}
        save()  # after every section: a check cut short still reports what it measured
        print(f"[{time.time() - t0:6.1f}s] {name} ({est} s estimated): "
              f"{json.dumps(r['sections'][name], default=str)[:800]}", flush=True)

    try:
        section("rates", lambda: rates_section(tmp, smoke))
        rt = r["sections"]["rates"]
        r["device"], r["overrides"] = rt.get("device", r["device"]), overrides(rt)
        section("llama8b", lambda: capped(tmp, raw, "llama8b", smoke))
        section("gpu_tests", lambda: gpu_tests(out, smoke))
        section("light_rows", lambda: light_rows(tmp, raw, smoke, rt.get("bitsandbytes") or {}))
        section("llama8b_resident", lambda: resident(tmp, raw, r["sections"]["llama8b"], smoke))
        measured = {k: v for sec in ("llama8b", "light_rows") for k, v in r["sections"].get(sec, {}).items()
                    if isinstance(v, dict)}
        section("time_model", lambda: time_model(measured, rt, smoke))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save()
    print(f"report: {out / 'gpu_check.md'} ({r['out_files']} files in {out})"
          + (" (smoke run on the CPU: no GPU figures were taken)" if smoke else ""))
    if r.get("overrides"):
        print(f"config overrides for a run on this machine: {r['overrides']}")
    for f in r["failures"]:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
