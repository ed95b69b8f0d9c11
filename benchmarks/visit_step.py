"""The train task's visit, timed: ms per training step of ``tasks.train.train_block`` (its whole recipe: the data
cursor and prefetch, the step loop, the stop rule) on a small model, for the first block (from tokens) and the
second (from stored pre-inferred activations), ``--repeats`` times each, interleaved; the median.

Issue 16 asks that the one visit engine costs nothing against the recipe it replaced: run this file from both trees
with the same arguments (it uses only ``train_block``'s task function, the same in both) and compare.

    python benchmarks/visit_step.py                      # 3 repeats x 2 blocks x 40 steps: ~2 min on 2 cores
    python benchmarks/visit_step.py --steps 60 --repeats 5 --set train.offload=stream
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from bcdflow.core.config import load_config
from bcdflow.core.context import RunContext
from bcdflow.storage.store import Store
from bcdflow.tasks.data import token_dataset
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.run import init_run
from bcdflow.tasks.train import train_block
from bcdflow.core.rules import VisitSpec

SMALL = ["model.name=tiny", "model.d_model=128", "model.n_head=4", "model.n_layer=6", "data.seq_len=128",
         "data.vocab_size=1024", "data.builtin_bytes=2000000", "bcd.blocks=3", "bcd.cycles=1", "bcd.patience=0",
         "bcd.shard_rows=64", "train.batch_size=8", "train.eval_every=100000", "checkpoint.every_steps=100000",
         "checkpoint.every_seconds=86400", "tracking_uri=none", "bcd.budget=fixed", "bcd.moments=reset"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="more KEY=VALUE overrides")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bcdflow-visit-step-") as tmp:
        cfg = load_config(sets=[*SMALL, f"bcd.max_steps={args.steps}", f"store={tmp}/store", *args.set])
        ds = token_dataset(cfg, Store(cfg.store))
        init_run.fn(cfg, "r", ds)
        for shard in plan_shards.fn(RunContext.of(cfg, "r", ds), 0, 1):
            preinfer_shard.fn(RunContext.of(cfg, "r", ds), 0, 1, 0, shard)
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 0, 0))  # warm-up
        ms: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.repeats):
            for block in ms:
                res = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, block, 0))
                ms[block].append(res.seconds / res.steps * 1e3)
    print(json.dumps({f"block {b}": {"median_ms_per_step": round(statistics.median(v), 2),
                                     "all": [round(x, 2) for x in v]} for b, v in ms.items()}, indent=1))


if __name__ == "__main__":
    main()
