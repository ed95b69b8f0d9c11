"""What a visit's live progress (tasks/progress.py) costs a training step: ``models.trainer.run_steps`` on the tiny
model for ``--steps`` steps with no progress, with the log line and with the rich bar, interleaved ``--repeats``
times (median ms/step), and the cost of one progress call on its own (200k calls).

Target (issue 19): nothing measurable per step. On a shared CPU the step time varies far more than the progress
costs, so the per-call figure is the one to read: it is what run_steps adds to each step.

    python benchmarks/progress_overhead.py                   # 200 steps x 3 repeats x 3 modes: ~1-2 min on 2 cores
    python benchmarks/progress_overhead.py --steps 100 --repeats 5
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

from bcdflow.models import build_model, get_config
from bcdflow.models.trainer import LoopHooks, OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.tasks.progress import Progress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = build_model(cfg)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=g) for _ in range(2))
    spec = OptimSpec("adamw", lr=1e-4)

    def ms_per_step(progress) -> float:
        opt = make_optimizer(params, spec)
        t0 = time.perf_counter()
        run_steps(lambda b: model(*b), params, itertools.repeat(batch), opt, spec,
                  StopRule(max_steps=args.steps, window=20), LoopHooks(progress=progress))
        return (time.perf_counter() - t0) / args.steps * 1e3

    ms_per_step(None)  # warm-up
    times: dict[str, list[float]] = {"none": [], "log": [], "bar": []}
    for _ in range(args.repeats):
        for mode in times:
            if mode == "none":
                times[mode].append(ms_per_step(None))
                continue
            os.environ["BCDFLOW_PROGRESS"] = mode
            prog = Progress("bench train", args.steps)
            times[mode].append(ms_per_step(prog))
            prog.close()
    per_call = {}
    for mode in ("log", "bar"):
        os.environ["BCDFLOW_PROGRESS"] = mode
        prog, n = Progress("bench train", 10 ** 9), 200_000
        prog(0, 0, None)
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            prog(i, i * 512, 3.2)
        per_call[mode] = (time.perf_counter() - t0) / n * 1e6
        prog.close()
    print(f"tiny model, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"{'progress':<9} {'ms/step (median)':>17}  runs")
    for mode, v in times.items():
        print(f"{mode:<9} {statistics.median(v):>17.2f}  {', '.join(f'{x:.1f}' for x in v)}")
    for mode, us in per_call.items():
        share = us / 1e3 / statistics.median(times["none"]) * 100
        print(f"one {mode} progress call: {us:.2f} us ({share:.5f}% of a step)")


if __name__ == "__main__":
    main()
