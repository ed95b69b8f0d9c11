"""Cost: the what-if spend of the runs above on the catalog's devices (paper §4.4, Tables 5-7, 12-14).

Each run's GPU-hours are its measured stage seconds (pre-inference, training, evaluation) × GPUs, as the
product's spend tracking records them (``core.spend``); here those seconds are this machine's, so the
absolute dollars only say what the same hours would cost on each device. The ratio that carries over is
BCD against full on the same device, to the same validation loss: GPU-hours to reach the full run's final
loss (+ tol). Pricing BCD's hours on an RTX 4090 against full training's on an A100/A800 (Tables 6, 7,
13, 14) assumes equal hours on both, which flatters the A100 less than its speed would: read it as the
price ratio times the hours ratio. ``flows.compare`` (``bcdflow compare``) renders the product's table.
"""
from __future__ import annotations

from pathlib import Path

from benchmarks import report
from benchmarks.runs import RunBook, first_reach
from benchmarks.training import pair
from bcdflow.core.spend import DEFAULT_PRICES as CATALOG  # the product's catalog (docs/DESIGN.md §7)
from bcdflow.storage.store import Store

# paper Tables 12-14, G-1.6B: GPU-hour reduction of BCD (on RTX 4090) vs full (average B-F / worst B-F)
PAPER_GPUH = {"rtx4090": (0.802, 0.561), "a100": (0.556, 0.015), "a800": (0.578, 0.064)}


def cost(book: RunBook, out: Path, **_) -> dict:
    pairs = {"adamw": pair(book, "adamw")}
    prices = dict(CATALOG)
    rows, split = [], []
    for r in book.all():
        gpu_h = r["curve"][-1]["gpu_hours"] if r["curve"] else 0.0
        rows.append({"run": r["label"], "mode": r["mode"], "steps": r["steps"], "gpu_hours": gpu_h,
                     **{k: gpu_h * p for k, p in prices.items()}})
        t, wall = r["time"], r["wall_seconds"]
        split.append({"run": r["label"], "visits": len(r["visits"]), "wall": wall, "train": t["train"] / wall,
                      "preinfer": t["preinfer"] / wall, "eval": t["eval"] / wall,
                      "other": 1 - sum(t.values()) / wall, "ms_per_step": 1e3 * t["train"] / max(r["steps"], 1)})
    a = pairs["adamw"]
    t = a["target"]
    full_h = first_reach(a["full"]["curve"], t, "gpu_hours")
    bcd_h = first_reach(a["bcd"]["curve"], t, "gpu_hours")
    to_target = []
    for kind, price in prices.items():
        to_target.append({"device for full": kind, "full $": full_h * price if full_h else None,
                          "BCD $ (rtx4090)": bcd_h * prices.get("rtx4090", price) if bcd_h else None,
                          "BCD $ (same device)": bcd_h * price if bcd_h else None})
    for row in to_target:
        f = row["full $"]
        row["reduction, BCD on rtx4090"] = 1 - row["BCD $ (rtx4090)"] / f if f and row["BCD $ (rtx4090)"] else None
        row["reduction, same device"] = 1 - row["BCD $ (same device)"] / f if f and row["BCD $ (same device)"] else None
    same = 1 - bcd_h / full_h if full_h and bcd_h else None
    claims = [report.claim("cost", "GPU-hours to the full run's loss, BCD / full (same device)",
                           bcd_h / full_h if full_h and bcd_h else None,
                           paper=f"{1 - PAPER_GPUH['rtx4090'][0]:.2f} avg, {1 - PAPER_GPUH['rtx4090'][1]:.2f} worst "
                           "(T12, G-1.6B; full on 2× GPUs)")]
    if "a100" in prices and full_h and bcd_h:
        red = 1 - bcd_h * prices.get("rtx4090", 0.29) / (full_h * prices["a100"])
        claims.append(report.claim("cost", "cost reduction, BCD on rtx4090 vs full on a100 (equal hours)", red,
                                   fmt=".0%", paper=f"{PAPER_GPUH['a100'][0]:.0%} avg (T13, GPU-h, G-1.6B)"))
    compare_md = product_compare(book, a)
    other = sum(x["other"] * x["wall"] for x in split) / sum(x["wall"] for x in split) if split else None
    res = {"catalog": prices, "runs": rows, "time_split": split, "to_target": to_target, "same_device_reduction": same,
           "target": t, "claims": claims, "plots": [plot(rows, prices, out)]}
    res["markdown"] = "\n".join([
        "## cost: what-if spend on the catalog's devices (§4.4, Tables 5-7, 12-14)", "",
        "GPU-hours = this machine's measured stage seconds (pre-inference + training + evaluation, as "
        "`core.spend` records them) priced at " + ", ".join(f"{k} ${v:g}/h" for k, v in prices.items())
        + ". Equal hours on every device: a what-if on price, not a speed model.", "",
        report.md_table(rows, [("run", "run", "s"), ("mode", "mode", "s"), ("steps", "steps", "d"),
                               ("gpu_hours", "GPU-h", ".6f")] + [(k, f"{k} $", ".6f") for k in prices]), "",
        f"To the full AdamW run's final loss + tol ({t:.4f}):", "",
        report.md_table(to_target, [(k, k, "s" if k == "device for full" else (".0%" if "reduction" in k else ".6f"))
                                    for k in to_target[0]]),
        "", "Where each run's wall time went (stage seconds as the visit records them; 'other' = orchestration, "
        "data preparation, commits and store I/O outside the stages; spend counts only the stages):", "",
        report.md_table(split, [("run", "run", "s"), ("visits", "visits", "d"), ("wall", "wall s", ".1f"),
                                ("train", "train", ".0%"), ("preinfer", "pre-infer", ".0%"), ("eval", "eval", ".0%"),
                                ("other", "other", ".0%"), ("ms_per_step", "train ms / step", ".1f")]),
        "", compare_md])
    res["claims"].append(report.claim("cost", "share of run wall time outside train/pre-infer/eval (all runs)",
                                      other, fmt=".0%"))
    return res


def product_compare(book: RunBook, a: dict) -> str:
    """The product's own comparison (``bcdflow compare full bcd``), when flows.compare is there."""
    try:
        # local: imported where used, as the other benchmarks' product tables are (see runs.py)
        from bcdflow.flows.compare import compare

        out = compare(Store(a["full"]["store"]), [a["full"]["run_id"], a["bcd"]["run_id"]])
        return "`bcdflow compare` of the AdamW pair (the product's table; L* = the baseline's best + 0.02):\n\n" \
            + out["markdown"]
    except Exception as e:  # the product table is a bonus; the figures above stand without it
        return f"(`flows.compare` unavailable: {type(e).__name__}: {e})"


def plot(rows: list[dict], prices: dict, out: Path) -> str:
    fig, ax = report.figure(figsize=(6.5, 3.6))
    width = 0.8 / max(1, len(prices))
    for i, (kind, _) in enumerate(prices.items()):
        ax.bar([k + i * width for k in range(len(rows))], [r[kind] for r in rows], width, label=kind)
    ax.set_xticks([k + width * (len(prices) - 1) / 2 for k in range(len(rows))], [r["run"] for r in rows],
                  rotation=25, fontsize=7)
    ax.set_ylabel("USD (what-if)")
    ax.legend(fontsize=7)
    return report.save(fig, out, "cost.png")
