"""What landscape expansion (``bcd.expand=lora``) costs in device memory at the README's shapes, by the planner
(models/memory.py, within 10% of the CPU tensor tracker with adapters: tests/test_expand.py): for each model, the
recommended plan without expansion (the smallest ``bcd.blocks``, recompute, streaming that fit the card), its worst
visit's predicted peak with adapters of each rank added, and the plan the planner recommends with them.

    python benchmarks/expand_memory.py                      # G-1.6B, G-5.4B, L-1.5B, L-6B; batch 2x1024, bf16, 24 GB
    python benchmarks/expand_memory.py --models L-6B --ranks 4 16 64 --gpu-gb 16
"""
from __future__ import annotations

import argparse

from bcdflow.models import get_config, model_plan
from bcdflow.models.memory import GB, plan_visits, recommend


def row(name: str, ranks: list[int], batch: int, seq: int, gpu_gb: float) -> dict:
    cfg = get_config(name, vocab_size=50304)
    base = recommend(cfg, batch, seq, "bf16", gpu_gb * GB)
    out = {"model": name, "params": sum(e.held_params for e in plan_visits(cfg, 1, batch, seq, "bf16")),
           "plan": base, "ranks": {}}
    if base.blocks is None:
        return out
    for r in ranks:
        est = plan_visits(cfg, base.blocks, batch, seq, "bf16", recompute=base.recompute, stream=base.stream,
                          expand_rank=r)
        worst = max(est, key=lambda e: e.peak)
        again = recommend(cfg, batch, seq, "bf16", gpu_gb * GB, expand_rank=r)
        out["ranks"][r] = {"worst": worst.peak, "adapters": max(e.expand_params for e in est), "rec": again}
    return out


def plan_text(rec) -> str:
    if rec.blocks is None:
        return "none fits"
    return (f"bcd.blocks={rec.blocks}" + (" + recompute" if rec.recompute else "") + (" + stream" if rec.stream
                                                                                       else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["G-1.6B", "G-5.4B", "L-1.5B", "L-6B"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-gb", type=float, default=24.0)
    a = ap.parse_args(argv)
    head = ["model", "plan without expansion", "worst visit"]
    for r in a.ranks:
        head += [f"r={r}: adapters (worst visit)", f"r={r}: worst visit, same plan", f"r={r}: plan that fits"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for name in a.models:
        res = row(name, a.ranks, a.batch, a.seq, a.gpu_gb)
        base = res["plan"]
        cells = [name, plan_text(base), f"{base.worst_peak / GB:.1f} GB" if base.blocks else "–"]
        for r in a.ranks:
            x = res["ranks"].get(r)
            if x is None:
                cells += ["–"] * 3
                continue
            fits = "fits" if x["worst"] <= a.gpu_gb * GB else "does not fit"
            cells += [f"{x['adapters'] / 1e6:.1f}M", f"{x['worst'] / GB:.1f} GB (+{(x['worst'] - base.worst_peak) / GB:.1f}"
                      f", {fits})", plan_text(x["rec"]) + (f" ({x['rec'].worst_peak / GB:.1f} GB)" if x["rec"].blocks
                                                           else "")]
        print("| " + " | ".join(cells) + " |")
    print(f"\nbatch {a.batch}x{a.seq}, bf16, AdamW, vocabulary 50304, {a.gpu_gb:g} GB card; planner figures "
          "(models/memory.py), not measured on a GPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
