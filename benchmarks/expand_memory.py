"""What landscape expansion (``bcd.expand=lora``) costs in device memory at the shapes of docs/guide/memory.md, by the planner
(models/memory.py, within 10% of the CPU tensor tracker with adapters: tests/test_expand.py): for each model, the
recommended plan without expansion (the smallest ``bcd.blocks`` whose visits fit the card's usable budget, each held
as models/holding.py chooses), its worst visit's predicted peak with adapters of each rank added, held the same way
and held as the planner would hold it with them (more streaming or recompute where they no longer fit).

    python benchmarks/expand_memory.py                      # G-1.6B, G-5.4B, L-1.5B, L-6B; batch 2x1024, bf16, 24 GB
    python benchmarks/expand_memory.py --models L-6B --ranks 4 16 64 --gpu-gb 16
    python benchmarks/expand_memory.py --models benchmarks/shapes/llama-3-8b    # a checkpoint's config.json alone
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from bcdflow.core.config import load_config
from bcdflow.core.context import model_config
from bcdflow.models import get_config, model_plan
from bcdflow.models.holding import fit_holding, recommend
from bcdflow.models.memory import GB, device_budget, visit_memory
from bcdflow.models.specs import StepShape


def row(name: str, ranks: list[int], batch: int, seq: int, gpu_gb: float) -> dict:
    """The recommended plan without expansion, then per rank: each visit held the same way with adapters, and held
    as the planner would hold it with them (more streaming or recompute where they no longer fit)."""
    if "/" in name:  # a directory holding a checkpoint's config.json (benchmarks/shapes/)
        cfg = model_config(load_config(sets=[f"model.from_hf={name}", f"data.seq_len={seq}"]))
    else:
        cfg = get_config(name, vocab_size=50304)
    budget = device_budget(gpu_gb * GB)
    shape = StepShape(batch, seq, "bf16")
    base = recommend(cfg, shape, budget)
    out = {"model": name, "plan": base, "budget": budget, "ranks": {}}
    if base.blocks is None:
        return out
    plan = model_plan(cfg, base.blocks)
    for r in ranks:
        same = [visit_memory(cfg, plan, b, replace(h.shape, expand_rank=r)) for b, h in enumerate(base.holdings)]
        held = [fit_holding(cfg, plan, b, replace(shape, expand_rank=r), budget.usable) for b in range(len(plan.visits))]
        out["ranks"][r] = {"same": max(e.peak for e in same), "adapters": max(e.expand_params for e in same),
                           "held": max(h.estimate.peak for h in held), "fits": all(h.fits for h in held),
                           "streamed": sum(len(h.streamed) for h in held), "recompute": sum(h.recompute for h in held),
                           "blocks": base.blocks if all(h.fits for h in held) else fitting_blocks(cfg, base.blocks + 1,
                                                                                                   batch, seq, budget, r)}
    return out


def fitting_blocks(cfg, start: int, batch: int, seq: int, budget, rank: int) -> int | None:
    """The smallest block count from ``start`` whose every visit, with adapters of ``rank``, fits the budget."""
    for m in range(start, cfg.n_layer + 1):
        plan = model_plan(cfg, m)
        if all(fit_holding(cfg, plan, b, StepShape(batch, seq, "bf16", expand_rank=rank), budget.usable).fits
               for b in range(len(plan.visits))):
            return m
    return None


def plan_text(rec) -> str:
    if rec.blocks is None:
        return "none fits"
    st = sum(len(h.streamed) for h in rec.holdings)
    rc = sum(h.recompute for h in rec.holdings)
    return f"bcd.blocks={rec.blocks} ({rc} visits recompute, {st} layers streamed in all)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["G-1.6B", "G-5.4B", "L-1.5B", "L-6B"],
                    help="registry names (vocabulary 50304) or directories holding a config.json")
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-gb", type=float, default=24.0)
    a = ap.parse_args(argv)
    head = ["model", "plan without expansion", "worst visit"]
    for r in a.ranks:
        head += [f"r={r}: adapters", f"r={r}: worst visit, held the same", f"r={r}: worst visit, held anew"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for name in a.models:
        res = row(name, a.ranks, a.batch, a.seq, a.gpu_gb)
        base, usable = res["plan"], res["budget"].usable
        cells = [name.rstrip("/").split("/")[-1], plan_text(base), f"{base.worst_peak / GB:.1f} GB" if base.blocks else "–"]
        for r in a.ranks:
            x = res["ranks"].get(r)
            if x is None:
                cells += ["–"] * 3
                continue
            cells += [f"{x['adapters'] / 1e6:.1f}M",
                      f"{x['same'] / GB:.1f} GB (+{(x['same'] - base.worst_peak) / GB:.2f}; "
                      f"{'fits' if x['same'] <= usable else 'does not fit'})",
                      f"{x['held'] / GB:.1f} GB ({x['recompute']} recompute, {x['streamed']} streamed; "
                      + ("fits)" if x["fits"] else f"does not fit: bcd.blocks={x['blocks']} does)")]
        print("| " + " | ".join(cells) + " |")
    print(f"\nbatch {a.batch}x{a.seq}, bf16, AdamW, vocabulary 50304 (a registry model), a {a.gpu_gb:g} GB card "
          f"({device_budget(a.gpu_gb * GB).usable / GB:.1f} GB usable); planner figures (models/memory.py, "
          "models/holding.py), not measured on a GPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
