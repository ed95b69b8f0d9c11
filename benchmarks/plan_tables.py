"""The planning guide's four scales (docs/guide/planning-a-run.md) and the peers page's 8B table
(docs/guide/peers.md), generated: the ``bcdflow plan`` commands and the tables of what they print, with
``bcd.preinfer`` true and auto, and full training on the same cluster to the same loss beside each. ``--check``
fails (exit 1, naming the first differing line) when a page's block differs from what the code prints today
(tests/test_docs.py runs it); ``--write`` rewrites the blocks between their markers.

    python -m benchmarks.plan_tables            # the blocks, to stdout
    python -m benchmarks.plan_tables --check    # the pages against them
    python -m benchmarks.plan_tables --write    # the pages updated
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide" / "planning-a-run.md"
BEGIN, END = "<!-- plan-tables: begin (python -m benchmarks.plan_tables --write) -->", "<!-- plan-tables: end -->"
LLAMA = ["--set", "model.from_hf=benchmarks/shapes/llama-3-8b", "--set", "data.seq_len=1024",
         "--set", "train.precision=bf16"]
def per_visit(tokens: float, batch: int, seq: int, blocks: int, layers: int, cycles: int = 2) -> tuple[int, str]:
    """A visit's step cap sized from the tokens: one epoch of full training at the same tokens a step, times the
    measured B-F at the layers a visit trains (``layers`` / ``blocks``, ``core/forecast.measured_bf``), shared over
    the run's visits; and the arithmetic in words."""
    from bcdflow.core.forecast import measured_bf

    epoch, bf = int(tokens // (batch * seq)), measured_bf(layers / blocks)
    steps = round(epoch * bf / (blocks * cycles))
    return steps, f"{epoch:,} x {bf:.3g} / {blocks * cycles} = {steps:,} a visit"


def layers(shape: str) -> int:
    """Decoder layers of a shape under benchmarks/shapes (its config.json)."""
    return json.loads((ROOT / "benchmarks" / "shapes" / shape / "config.json").read_text())["num_hidden_layers"]


S1, S1_WORDS = per_visit(100e6, 8, 1024, 8, layers("llama-3-8b"))
S2, S2_WORDS = per_visit(100e6, 16, 1024, 8, layers("llama-3-8b"))
S3, S3_WORDS = per_visit(10e9, 64, 2048, 8, layers("qwen2.5-32b"))
B_PER_VISIT = "steps sized from the tokens: one epoch of full training at the same tokens a step, x B-F, over "
EIGHT = ["--set", "optim.name=adamw8bit-bf16", "--set", "bcd.blocks=8"]  # the planner's count with 8-bit state
CUT = ["--set", "bcd.boundaries=[3,7,11,15,19,23,28]"]  # and its cut for one process (streaming its frozen layers)
CACHE = ["--set", "bcd.block_cache=/scratch/blocks"]  # the box keeps its copies of the block files (no egress on loads)
SCALES = [
    ("1. Llama-3-8B fine-tune on 100M tokens on one rented RTX 4090, the bucket in S3 (store at 0.2 GB/s: the box's "
     "~1.6 Gbit/s; its reads pay egress, 0.09 USD/GB by default for an s3:// store), the box's copies of the block "
     "files on its disk (bcd.block_cache: the model crosses the link once); the planner's 8 blocks of 8-bit "
     "state (bcdflow plan-memory's recommendation); " + B_PER_VISIT + "8 blocks x 2 cycles: " + S1_WORDS,
     [*LLAMA, *EIGHT, *CUT, "--set", "train.batch_size=8", "--set", f"bcd.max_steps={S1}",
      "--set", "store=s3://my-bucket/runs", *CACHE, "--tokens", "100e6", "--gpu-gb", "24", "--store-gbs", "0.2"]),
    ("2. the same on one box of 8 rented 4090s (10 GB/s between cards, no NVLink; a replica a card, 8 equal blocks), "
     "the activations and the block files' copies on the box's own NVMe disk (bcd.act_store, 2 GB/s; "
     "bcd.block_cache: no egress on them), the bucket in S3 as above; batch 16: " + S2_WORDS,
     [*LLAMA, *EIGHT, "--set", "train.batch_size=16", "--set", "train.gpus=8", "--set", "bcd.expand=off",
      "--set", f"bcd.max_steps={S2}", "--set", "bcd.act_store=/scratch/acts", *CACHE, "--set", "store=s3://my-bucket/runs",
      "--tokens", "100e6", "--gpu-gb", "24", "--store-gbs", "0.2"]),
    ("3. Qwen2.5-32B pre-training on 10B tokens on 64 A100-80GB in 8 boxes (400 Gbit/s between them: 50 GB/s) in "
     "the bucket's cloud (FSDP; 150 TFLOP/s; store at 1.25 GB/s = 10 Gbit/s, no egress; checkpoints every 5000 steps "
     "or hour); batch 64 x 2048, 8 blocks x 2 cycles: " + S3_WORDS,
     ["--set", "model.from_hf=benchmarks/shapes/qwen2.5-32b", "--set", "data.seq_len=2048",
      "--set", "train.precision=bf16", "--set", "train.batch_size=64", "--nodes", "8", "--gpus", "8",
      "--link-gbs", "50",
      "--set", "train.parallel=fsdp", "--set", "bcd.expand=off", "--set", "bcd.blocks=8",
      "--set", f"bcd.max_steps={S3}", "--set", "checkpoint.every_steps=5000", "--set", "checkpoint.every_seconds=3600",
      "--set", "spend.train_device=a100", "--set", "spend.preinfer_device=a100", "--set", "store=s3://my-bucket/runs",
      "--set", "spend.egress_usd_gb=0", "--tokens", "10e9", "--gpu-gb", "80", "--tflops", "150",
      "--store-gbs", "1.25"]),
    ("4. Llama-3-8B on 100M tokens on 16 rented RTX 4090s in 4 boxes joined by 10 Gbit/s (1.25 GB/s; 10 GB/s "
     "between the 4 cards of a box), the bucket beside them (no egress), 8-bit state: batch 16: " + S2_WORDS,
     [*LLAMA, *EIGHT, "--set", "train.batch_size=16", "--set", "bcd.expand=off", "--set", f"bcd.max_steps={S2}",
      "--set", "store=s3://my-bucket/runs",
      "--set", "spend.egress_usd_gb=0", "--nodes", "4", "--gpus", "4", "--link-gbs", "1.25", "--tokens", "100e6",
      "--gpu-gb", "24", "--store-gbs", "1.25"]),
]
SETTINGS = ("true", "auto")


def plan_json(args: list[str]) -> dict:
    """``bcdflow plan ARGS --json``, run in this process from the repository root."""
    from bcdflow.flows.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.chdir(ROOT):
        rc = main(["plan", *args, "--json"])
    if rc != 0:
        raise SystemExit(f"bcdflow plan {' '.join(args)}: exit {rc}")
    return json.loads(out.getvalue())


def _bytes(b: float) -> str:
    return f"{b / 1e9:,.1f} GB" if b < 1e11 else f"{b / 1e12:,.2f} TB" if b < 1e15 else f"{b / 1e12:,.0f} TB"


def _usd(x: float) -> str:
    return f"${x:,.0f}"


def row(scale: int, setting: str, p: dict) -> str:
    """One line of the guide's table from a plan's JSON."""
    v, c = p["visits"], p["cycle"]
    pre = [x for x in v if x["preinfer"]]
    acts = _bytes(max(x["written"] for x in pre)) if pre else "–"
    moved = f"{_bytes(c['written'])} / {_bytes(c['read'])}" if pre else "–"
    hours = ", ".join(f"{h:,.0f} {k}" for k, h in sorted(c["gpu_hours"].items(), key=lambda kv: -kv[1]))
    money = (f"{_usd(c['gpu_usd'])} + {_usd(c['storage_usd'])} + {_usd(c['request_usd'])} + {_usd(c['egress_usd'])}"
             f" = {_usd(c['usd'])}")
    return (f"| {scale} | `{setting}` | {len(pre)}/{len(v)} | {acts} | {moved} | {c['wall_s'] / 3600:,.1f} h | {hours} "
            f"| {_bytes(c['store_peak'])} | {money} | {_usd(p['run']['usd'])} |")


def full_row(scale: int, p: dict) -> str:
    """One line of the guide's second table: full training on the same cluster to the same loss."""
    f = p["full"]
    ways = "; ".join(f"{w['way']} {w['wall_s'] / 3600:,.1f} h, {_usd(w['usd'])}" + ("" if w["fits"] else
                     f" (does not fit: {w['peak'] / 1e9:,.0f} GB a GPU)") for w in f["ways"])
    b = f["best"]
    verdict = "full training fits no way" if b is None else (
        f"bcdflow {b['time_x']:.2f}x the time, {b['usd_x']:.2f}x the money of {b['way']}")
    per_step = max(v["comm"]["exposed_s"] for v in p["visits"])
    return (f"| {scale} | {f['cluster']} | {f['steps']:,.0f} | {p['run']['wall_s'] / 3600:,.1f} h, "
            f"{_usd(p['run']['usd'])} | {per_step:.2f} s | {ways} | {verdict} |")


def block() -> str:
    """The guide's block: the commands, then the tables."""
    cmds = ["```"]
    for title, args in SCALES:
        cmds.append(f"# {title}")
        cmds.append("bcdflow plan " + " ".join(a if "[" not in a else f'"{a}"' for a in args)
                    + " --set bcd.preinfer=auto")
    cmds.append("```")
    rows = ["| scale | `bcd.preinfer` | visits pre-inferred | activations a visit | written / read a cycle | wall a cycle "
            "| GPU-hours a cycle | store peak | money a cycle: GPUs + storage + requests + egress | the run |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    full = ["| scale | cluster | full training's steps to the run's loss | bcdflow's run (`auto`) | a visit's exposed "
            "communication a step, at most | full training on the same cluster: wall, money | which wins |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, (_, args) in enumerate(SCALES, 1):
        for s in SETTINGS:
            p = plan_json([*args, "--set", f"bcd.preinfer={s}"])
            rows.append(row(i, s, p))
        full.append(full_row(i, p))
    return "\n".join([BEGIN, "", "\n".join(cmds), "", "\n".join(rows), "", "\n".join(full), "", END])


PEERS = ROOT / "docs" / "guide" / "peers.md"
PEERS_BEGIN, PEERS_END = ("<!-- peers-8b: begin (python -m benchmarks.plan_tables --write) -->",
                          "<!-- peers-8b: end -->")


def peers_block() -> str:
    """The peers page's time-to-quality table at 8B on one 4090: scale 1's plan (``auto``) with full training's exact
    single-card recipes beside it (``bcdflow plan``'s ``full``)."""
    title, args = SCALES[0]
    p = plan_json([*args, "--set", "bcd.preinfer=auto"])
    f = p["full"]
    rows = ["| way | device GB | host GB | a step | steps | wall | money |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    mem = p["memory"]["recommendation"]
    bcd_steps = f["bcd_steps"]
    rows.append(f"| **bcdflow** (this plan: 8 blocks, 8-bit state) | {mem['worst_peak'] / 1e9:.1f} | "
                f"{mem['host_bytes'] / 1e9:.1f} pinned | {p['run']['wall_s'] / bcd_steps:.1f} s (all stages) | "
                f"{bcd_steps:,} | {p['run']['wall_s'] / 3600:.1f} h | {_usd(p['run']['usd'])} |")
    for w in f["ways"]:
        fits = "" if w["fits"] else " (does not fit)"
        host = f"{w['host_bytes'] / 1e9:.0f}" if w["host_bytes"] else "–"
        rows.append(f"| {w['way']}{fits} | {w['peak'] / 1e9:.1f} | {host} | {w['step_s']:.1f} s | {w['steps']:,.0f} | "
                    f"{w['wall_s'] / 3600:.1f} h | {_usd(w['usd'])} |")
    b = f["best"]
    line = (f"bcdflow takes {b['time_x']:.2f}x the time of {b['way']} and {b['usd_x']:.2f}x its money, at B-F "
            f"{f['bf']:g}." if b else "Full training fits no way on this card.")
    cmd = "bcdflow plan " + " ".join(a if "[" not in a else f'"{a}"' for a in args) + " --set bcd.preinfer=auto"
    return "\n".join([PEERS_BEGIN, "", "```", cmd, "```", "", "\n".join(rows), "", line, "", PEERS_END])


def _check(path: Path, begin: str, end: str, new: str, write: bool) -> int:
    text = path.read_text()
    i, j = text.index(begin), text.index(end) + len(end)
    if write:
        path.write_text(text[:i] + new + text[j:])
        return 0
    old = text[i:j]
    if old != new:
        for k, (x, y) in enumerate(zip(old.splitlines() + [""] * 99, new.splitlines() + [""] * 99)):
            if x != y:
                print(f"{path}: the plan tables differ from what the code prints (line {k + 1} of the block):\n"
                      f"  page: {x}\n  code: {y}\n(python -m benchmarks.plan_tables --write)", file=sys.stderr)
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where the guide's block differs from the code's")
    ap.add_argument("--write", action="store_true", help="rewrite the guide's block")
    a = ap.parse_args(argv)
    new, peers = block(), peers_block()
    if not (a.check or a.write):
        print(new + "\n\n" + peers)
        return 0
    return _check(GUIDE, BEGIN, END, new, a.write) or _check(PEERS, PEERS_BEGIN, PEERS_END, peers, a.write)


if __name__ == "__main__":
    sys.exit(main())
