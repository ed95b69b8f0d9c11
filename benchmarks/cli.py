"""``python -m benchmarks run [--quick] [--only NAME ...] [--out DIR]``: the paper's claims, measured here.

Benchmarks (``--only``): memory, iteration, utilization (step-level, one process, round-robin timing) and
validity, sampling, order, cost (training runs through the real flows). Writes ``report.md``,
``results.json`` and PNG plots to ``--out`` (default ``benchmarks/out``) and prints the summary table:
each measured figure beside the paper's, PASS/MISS against the issue's targets. A miss never fails the
command; an error in a benchmark is reported, the others still run, and the exit status is 1.

Sizes: default ``full`` (for a GPU), ``--quick`` (under 10 minutes on 2 CPU cores), ``--tiny`` or
BCDFLOW_BENCH_SIZE=tiny (smoke tests). Threads: the timed step benchmarks use ``--threads`` (default: what
torch sees on this machine); the training runs use ``--flow-threads`` (CPU default 1: their figures are
step counts and losses, and the tiny model's small ops stall at 2 threads on a shared machine).

    python -m benchmarks run --quick
    python -m benchmarks run --quick --only memory iteration --out /tmp/bench
    python -m benchmarks run --only memory iteration --model gpt2-124m --batch-size 8 --seq-len 1024 --blocks 3

``python -m benchmarks suite [--quick|--tiny] ...``: BCD against full-parameter training on local corpora over
models, seeds and settings (benchmarks/suite.py).
``python -m benchmarks finetune [--profile tiny] ...``: the same figures for fine-tuning a pretrained base
(benchmarks/finetune.py).
``python -m benchmarks peers [--quick|--tiny] ...``: bcdflow beside BAdam, LISA, GaLore, APOLLO, LoRA and full AdamW
(benchmarks/peers.py).
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import cost, finetune, iteration, memory, peers, report, suite, training, utilization
from benchmarks.common import machine
from benchmarks.profiles import profile
from benchmarks.runs import book, flow_server
from bcdflow.core.context import resolve_device

STEP = ("memory", "iteration", "utilization")
FLOWS = ("validity", "sampling", "order", "cost")
NAMES = STEP + FLOWS


def setup_env() -> None:
    """For the command line (``__main__``): telemetry off, Prefect's and Hugging Face's homes in a temp
    dir. In-process callers (the tests) bring their own environment.

    It runs after this module is imported, so what this module imports must not import Prefect (which reads its
    settings on import): ``runs`` and ``cost`` import it when runs start."""
    if "prefect" in sys.modules:  # too late: Prefect has read its settings
        return
    home = tempfile.mkdtemp(prefix="bcdflow-bench-home-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["PREFECT_HOME"] = os.path.join(home, "prefect")
    os.environ.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"})
    for k, v in {"PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600",
                 "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                 "TOKENIZERS_PARALLELISM": "false", "BCDFLOW_HF_CACHE": os.path.join(home, "hf-datasets"),
                 "MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(home, "mlflow.db")}.items():
        os.environ.setdefault(k, v)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the benchmarks, write report.md, results.json and plots")
    run.add_argument("--quick", action="store_true", help="CPU-sized: under 10 minutes on 2 cores")
    run.add_argument("--tiny", action="store_true", help="smallest case of each benchmark (smoke tests)")
    run.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help=f"any of {', '.join(NAMES)}")
    run.add_argument("--out", default="benchmarks/out", help="output directory (default benchmarks/out)")
    run.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    run.add_argument("--threads", type=int, help="torch threads for the timed step benchmarks (default: all)")
    run.add_argument("--flow-threads", type=int, help="torch threads for the training runs (CPU default 1)")
    step = run.add_argument_group("step benchmarks (memory, iteration, utilization): the model and batch, "
                                  "overriding the size's")
    step.add_argument("--model", help="registry name (models/model_config.py), e.g. gpt2-124m, G-1.6B, L-1.5B")
    for field in ("n-layer", "d-model", "n-head", "n-kv-head", "d-ff", "vocab-size"):
        step.add_argument(f"--{field}", type=int, help=f"model.{field.replace('-', '_')}")
    step.add_argument("--batch-size", type=int)
    step.add_argument("--seq-len", type=int)
    step.add_argument("--precision", choices=("fp32", "bf16"))
    step.add_argument("--compile", action="store_true", help="torch.compile each layer (train.compile=true)")
    step.add_argument("--loss-chunk-rows", type=int, help="train.loss_chunk_rows (default: 128 MB of fp32 logits)")
    step.add_argument("--blocks", type=int, nargs="+", help="bcd.blocks values to measure (default: the size's)")
    suite.add_parser(sub)
    finetune.add_parser(sub)
    peers.add_parser(sub)
    return ap


def compute_profile(c: dict, args) -> dict:
    """The size's step-benchmark settings with the command line's model, batch and block counts."""
    c = dict(c)
    if args.model:
        c.update(model=args.model, overrides={})
    over = {k: getattr(args, k) for k in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size")
            if getattr(args, k) is not None}
    c["overrides"] = {**c["overrides"], **over}
    for k in ("batch_size", "seq_len", "precision"):
        if getattr(args, k) is not None:
            c[k] = getattr(args, k)
    if args.blocks:
        c.update(memory_blocks=args.blocks, iteration_blocks=args.blocks)
    if args.compile:
        c["compile"] = True
    if args.loss_chunk_rows:
        c["chunk_rows"] = args.loss_chunk_rows
    return c


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.cmd == "suite":
        return suite.main(args, argv)
    if args.cmd == "finetune":
        return finetune.main(args, argv)
    if args.cmd == "peers":
        return peers.main(args, argv)
    size = "tiny" if args.tiny or os.environ.get("BCDFLOW_BENCH_SIZE") == "tiny" else (
        "quick" if args.quick else "full")
    prof = profile(size)
    prof = {**prof, "compute": compute_profile(prof["compute"], args)}
    device = resolve_device(args.device)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    flow_threads = args.flow_threads or (1 if device.type == "cpu" else threads)
    names = [n for n in NAMES if n in (args.only or NAMES)]
    out = Path(args.out)
    info = machine(device)
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = f", load {info['load_avg_1m']:.1f}" if info["load_avg_1m"] is not None else ""
    print(f"bcdflow benchmarks ({size}): {', '.join(names)} on {info['gpu'] or info['cpu']} ({device}), "
          f"torch {info['torch']}, {threads} threads (flows {flow_threads}){load}", flush=True)
    if size == "full" and device.type == "cpu":
        print("  note: the full size is meant for a GPU; --quick is the CPU size", flush=True)

    results: dict[str, dict] = {}
    for name in [n for n in names if n in STEP]:
        results[name] = _one(name, prof, device, out, threads=threads)
    flow_names = [n for n in names if n in FLOWS]
    if flow_names:
        bk = book(size, prof, flow_threads)
        try:
            with flow_server():
                for name in flow_names:
                    results[name] = _one(name, prof, device, out, book=bk)
        except Exception as e:  # the server itself failed to start
            for name in flow_names:
                results.setdefault(name, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})

    claims = [c for r in results.values() for c in r.get("claims", [])]
    meta = {"profile": size, "command": "python -m benchmarks " + " ".join(argv), "machine": info,
            "threads": threads, "flow_threads": flow_threads, "benchmarks": names,
            "started": started, "seconds": time.perf_counter() - t0,
            "profile_settings": prof}
    report.write(out, meta, results, claims)
    print("\n" + report.summary_table(claims))
    errors = [n for n, r in results.items() if r.get("error")]
    for n in errors:
        print(f"ERROR in {n}: {results[n]['error']}")
    print(f"\nwrote {out / 'report.md'}, {out / 'results.json'} and "
          f"{sum(len(r.get('plots', [])) for r in results.values())} plots in {meta['seconds']:.0f} s")
    return 1 if errors else 0


def _one(name: str, prof: dict, device, out: Path, **kw) -> dict:
    fn = _load(name)
    print(f"\n== {name}", flush=True)
    t = time.perf_counter()
    try:
        res = fn(prof=prof, device=device, out=out, **kw)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - t}
    res["seconds"] = time.perf_counter() - t
    print(report.summary_table(res["claims"]) if res["claims"] else "(no figures)")
    print(f"({name}: {res['seconds']:.0f} s)", flush=True)
    return res


def _load(name: str):
    step = {"memory": memory.run, "iteration": iteration.run, "utilization": utilization.run}
    if name in step:
        return step[name]
    fn = {"validity": training.validity, "sampling": training.sampling, "order": training.order,
          "cost": cost.cost}[name]
    return lambda prof, device, out, book, **_: fn(book, out)
