"""Memory per visit against a full-parameter AdamW step (paper Tables 9, 11 and Figure 5).

For each ``bcd.blocks`` M in the profile's list (2, 3, 4, 5) and each block of the product's plan, the
peak tensor memory of one training step of that block's visit, pre-inference on (the product's default:
block b > 0 holds layers >= b and the head only), against the full step on the same model and batch.

Measured: ``Visit.peak`` (CUDA peak allocated, or the LiveBytes dispatch tracker on CPU) split into the
state alive before the step (weights, optimizer state, batch), the gradients of the trainable block and
the rest (activations and temporaries at the peak); plus the activations autograd saves in a forward
(saved-tensor hooks). Analytic: weights, gradients and AdamW moments from parameter counts (the paper's
Figure 5 counts only these three) and activations from the layer structure (below).
"""
from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.common import MB, Workload, best, round_robin
from benchmarks.isolate import Remote
from bcdflow.models.memory import visit_memory
from bcdflow.models.specs import StepShape

# paper Table 11 (GPT-2, Adam): memory at 1/UFP unfrozen over the full update's
PAPER_ADAM = {1: 2432.60, 2: 1520.38, 3: 1216.30, 4: 1064.26}


def analytic(w: Workload, v) -> dict:
    """Bytes by kind for a visit, from counts (fp32 weights, AdamW = 2 moments).

    Activations per token, pre-LN GPT layer (read off the autograd graph): a layer with trainable
    matrices saves 17C (ln inputs and outputs, qkv, attention output, the projections' inputs, the MLP's
    4C pre- and post-GELU); a frozen layer on the gradient path keeps only what input gradients need,
    about 10C (no linear inputs); a layer below ``start`` saves nothing; the head saves ln_f's input, its
    output when the head is trainable, and the V log-probabilities."""
    cfg, B, T = w.cfg, *w.x.shape
    C, V = cfg.d_model, cfg.vocab_size
    size = 4  # fp32 master weights and moments (bf16 autocast keeps fp32 parameters)
    held = sum(p.numel() for p in v.model.parameters())
    train = sum(p.numel() for p in v.params)
    layers = range(v.start, cfg.n_layer)
    trainable_layers = {int(n.split(".")[1]) for n in v.trainable if n.startswith("h.")}
    per_tok = sum(17 * C if i in trainable_layers else 10 * C for i in layers)
    head_tr = ("wte.weight" if cfg.tied else "lm_head.weight") in v.trainable
    per_tok += C + (C if head_tr else 0) + V
    act_size = 2 if w.args.precision == "bf16" else 4
    return {"weights": held * size, "grads": train * size, "optim": 2 * train * size,
            "activations": B * T * per_tok * act_size}


def measure(w: Workload, v) -> dict:
    if isinstance(v, Remote):  # CUDA: this very function, run in a process of its own on the configuration there
        return v.in_child(measure)
    v.step(timed=False)  # a first step, so the optimizer state exists (as in every step but the first)
    peak = v.peak()
    an = analytic(w, v)
    return {"name": v.name, "layers": list(v.layers), "trainable_params": sum(p.numel() for p in v.params),
            "ufp": sum(p.numel() for p in v.params) / w.n_params, "peak_bytes": peak["peak_bytes"],
            "bytes": peak["bytes"], "saved_activation_bytes": v.saved_bytes(), "analytic": an,
            "analytic_state_bytes": an["weights"] + an["grads"] + an["optim"],
            "analytic_total_bytes": sum(an.values())}


def run(prof: dict, device, out: Path, **_) -> dict:
    c = prof["compute"]
    w = Workload(c, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bytes do not depend on threads; one thread never stalls on a busy machine
    try:
        res = measure_all(w, c)
    finally:
        torch.set_num_threads(threads)
    if 3 in c["memory_blocks"]:  # timed: the machine's threads, like every timing
        res["what_if_checkpoint"] = checkpoint_what_if(w, w.plan(3), res["full"])
    res["plots"] = plots(res["rows"], res["_per_m"], res["full"], out)
    res["claims"] = claims(res.pop("_per_m"))
    if "what_if_checkpoint" in res:
        wi = res["what_if_checkpoint"]
        b0 = wi["rows"][0]
        res["claims"].append(report.claim(
            "memory", "worst-block peak / full, 3 blocks, bcd.recompute=on (measured)",
            wi["worst_recompute_peak_ratio"],
            target="≤ 0.50", passed=wi["worst_recompute_peak_ratio"] <= 0.5,
            note=f"(block 0 step ×{b0['time_x']:.2f} time; planner {wi['worst_recompute_planned_ratio']:.2f})"))
        res["claims"].append(report.claim(
            "memory", "mean block peak / full, 3 blocks, bcd.recompute=on (measured)", wi["mean_recompute_peak_ratio"],
            target="≤ 0.42", passed=wi["mean_recompute_peak_ratio"] <= 0.42))
    res["markdown"] = markdown(res, w)
    return res


def planned(w: Workload, plan, block, recompute: bool = False) -> int:
    """The planner's prediction (models/memory.py) for the same step, from the config alone."""
    c = w.c
    shape = StepShape(c["batch_size"], c["seq_len"], c["precision"], w.args.optim, chunk_rows=c.get("chunk_rows"),
                      recompute="on" if recompute else "off")
    return visit_memory(w.cfg, plan, block, shape).peak


def measure_all(w: Workload, c: dict) -> dict:
    full = measure(w, w.full())
    full["planned_peak_bytes"] = planned(w, None, None)
    gc.collect()
    rows, per_m = [dict(full, blocks=1, block=None)], {}
    for M in c["memory_blocks"]:
        plan = w.plan(M)
        block_rows = []
        for blk in plan.visits:
            v = w.visit(f"M={M} block {blk.index}", blk)
            r = measure(w, v)
            del v
            gc.collect()
            r.update(blocks=M, block=blk.index, planned_peak_bytes=planned(w, plan, blk.index))
            for k in ("peak_bytes", "analytic_state_bytes", "analytic_total_bytes", "saved_activation_bytes",
                      "planned_peak_bytes"):
                r[f"{k}_ratio"] = r[k] / full[k] if full[k] else None
            block_rows.append(r)
        rows += block_rows
        worst = max(block_rows, key=lambda r: r["peak_bytes"])
        per_m[M] = {"worst_block": worst["block"], "worst_peak_ratio": worst["peak_bytes_ratio"],
                    "mean_peak_ratio": sum(r["peak_bytes_ratio"] for r in block_rows) / M,
                    "worst_state_ratio": max(r["analytic_state_bytes_ratio"] for r in block_rows),
                    "worst_planned_ratio": (max(r["planned_peak_bytes"] for r in block_rows)
                                            / full["planned_peak_bytes"]),
                    "planned_over_measured": [r["planned_peak_bytes"] / r["peak_bytes"] for r in [full, *block_rows]],
                    "worst_analytic_total_ratio": max(r["analytic_total_bytes_ratio"] for r in block_rows),
                    "max_ufp": max(r["ufp"] for r in block_rows),
                    "paper_adam_ratio": PAPER_ADAM[M] / PAPER_ADAM[1] if M in PAPER_ADAM else (1 + 3 / M) / 4,
                    "plan": [list(b.layers) for b in plan.blocks]}
    return {"config": {**c, "n_params": w.n_params, "cfg": w.cfg.to_dict()}, "full": full, "rows": rows,
            "per_blocks": {str(k): v for k, v in per_m.items()}, "_per_m": per_m}


def checkpoint_what_if(w: Workload, plan, full: dict) -> dict:
    """Peak memory and step time of each block at 3 blocks as the product runs it by default and with
    ``bcd.recompute=on`` (the frozen suffix recomputed in backward), side by side (round-robin timing on the CPU,
    one process per configuration on CUDA; fastest step)."""
    pairs = []
    for blk in plan.visits:
        plain, ck = w.visit(f"b{blk.index}", blk), w.visit(f"b{blk.index} recompute", blk, recompute=True)
        pairs.append((blk, plain, ck))
    c = w.c
    timing = round_robin([v for _, plain, ck in pairs for v in (plain, ck)], c["warmup"], max(2, c["steps"]),
                         c["max_steps"], c["budget_s"] / 2)
    rows = []
    for blk, plain, ck in pairs:
        a, b = plain.peak()["peak_bytes"], ck.peak()["peak_bytes"]
        rows.append({"block": blk.index, "peak_ratio": a / full["peak_bytes"],
                     "recompute_peak_ratio": b / full["peak_bytes"],
                     "recompute_planned_ratio": planned(w, plan, blk.index, True) / full["planned_peak_bytes"],
                     "step_ms": 1e3 * best(plain.times), "recompute_step_ms": 1e3 * best(ck.times),
                     "time_x": best(ck.times) / best(plain.times),
                     "median_time_x": statistics.median(ck.times) / statistics.median(plain.times)})
    return {"rows": rows, "timing": timing, "worst_peak_ratio": max(r["peak_ratio"] for r in rows),
            "worst_recompute_peak_ratio": max(r["recompute_peak_ratio"] for r in rows),
            "mean_recompute_peak_ratio": statistics.fmean(r["recompute_peak_ratio"] for r in rows),
            "worst_recompute_planned_ratio": max(r["recompute_planned_ratio"] for r in rows),
            "full_step_ms": None}


def claims(per_m: dict) -> list[dict]:
    out = []
    if 3 in per_m:
        s = per_m[3]
        out.append(report.claim("memory", "worst-block peak / full AdamW step, 3 blocks (measured)",
                                s["worst_peak_ratio"], paper="0.50 (T11: 1216 / 2433 MB, Adam)",
                                target="≤ 0.50", passed=s["worst_peak_ratio"] <= 0.5))
        out.append(report.claim("memory", "mean block peak / full AdamW step, 3 blocks (measured)",
                                s["mean_peak_ratio"], target="≤ 0.42", passed=s["mean_peak_ratio"] <= 0.42))
        out.append(report.claim("memory", "worst-block peak / full, 3 blocks (planner, from the config alone)",
                                s["worst_planned_ratio"],
                                note="(planned / measured: " + ", ".join(f"{x:.2f}" for x in s["planned_over_measured"])
                                + ")"))
        out.append(report.claim("memory", "worst block, weights+grads+AdamW only, 3 blocks (analytic)",
                                s["worst_state_ratio"], paper="0.50 (Fig. 5: (1 + 3/3) / 4)"))
    for M, s in per_m.items():
        if M != 3:
            out.append(report.claim("memory", f"worst-block peak / full, {M} blocks (measured)",
                                    s["worst_peak_ratio"], paper=f"{s['paper_adam_ratio']:.2f} "
                                    + ("(T11)" if M in PAPER_ADAM else "(Fig. 5)")))
    return out


def markdown(res: dict, w: Workload) -> str:
    c, full = res["config"], res["full"]
    cols = [("name", "config", "s"), ("layers_s", "layers", "s"), ("trainable_m", "trainable M", ".2f"),
            ("ufp", "UFP", ".2f"), ("w", "weights MB", ".1f"), ("g", "grads MB", ".1f"), ("o", "optim MB", ".1f"),
            ("rest", "act+temp MB", ".1f"), ("saved", "saved act MB", ".1f"), ("peak", "peak MB", ".1f"),
            ("ratio", "× full", ".2f"), ("an_state", "analytic W+G+O × full", ".2f"),
            ("an_act", "analytic act MB", ".1f"), ("an_ratio", "analytic total × full", ".2f")]
    rows = []
    for r in res["rows"]:
        b = r["bytes"]
        rows.append({"name": r["name"], "layers_s": "%d-%d" % tuple(r["layers"]),
                     "trainable_m": r["trainable_params"] / 1e6, "ufp": r["ufp"], "w": b["weights"] / MB,
                     "g": b["grads"] / MB, "o": b["optim"] / MB, "rest": b["rest"] / MB,
                     "saved": r["saved_activation_bytes"] / MB, "peak": r["peak_bytes"] / MB,
                     "ratio": r["peak_bytes"] / full["peak_bytes"],
                     "an_state": r["analytic_state_bytes"] / full["analytic_state_bytes"],
                     "an_act": r["analytic"]["activations"] / MB,
                     "an_ratio": r["analytic_total_bytes"] / full["analytic_total_bytes"]})
    per = [{"M": int(M), "ufp": 1 / int(M), **s, "plan": str(s["plan"])} for M, s in res["per_blocks"].items()]
    limit = ""
    if "3" in res["per_blocks"]:
        s3 = res["per_blocks"]["3"]
        wr = next(r for r in res["rows"] if r.get("blocks") == 3 and r["block"] == s3["worst_block"])
        limit = (f"**What limits it.** The worst block at 3 blocks is block {s3['worst_block']} (layers "
                 f"{wr['layers'][0]}-{wr['layers'][1]} held): it trains {wr['ufp']:.0%} of the parameters"
                 + (" (block 0 owns the embeddings, and the tied head with them: with a whole layer beside them no "
                    "split gets it down to 1/3)" if wr["block"] == 0 and wr["ufp"] > 0.34 else "")
                 + " and keeps every later layer on the gradient path, whose activations are "
                 f"saved for the input gradients ({wr['saved_activation_bytes'] / MB:.1f} MB saved vs "
                 f"{full['saved_activation_bytes'] / MB:.1f} MB in the full step). Its weights + gradients + AdamW "
                 f"alone are {wr['analytic_state_bytes'] / full['analytic_state_bytes']:.2f} × the full step's; the "
                 "paper's 0.5 counts only these three, with exactly a third trainable.")
    return "\n".join([
        "## memory: peak per visit vs a full AdamW step (Tables 9, 11; Figure 5)", "",
        f"{c['model']} {w.cfg.n_layer} layers, d={w.cfg.d_model}, vocab={w.cfg.vocab_size} "
        f"({c['n_params'] / 1e6:.2f}M parameters), batch {c['batch_size']}×{c['seq_len']}, {c['precision']}, AdamW, "
        "pre-inference on, blocks from the product's plan (`RunConfig.plan`). Measured peak = state before "
        "the step + the most the step adds (CUDA allocator peak, or a dispatch-mode tracker of tensor storages on "
        "CPU); 'act+temp' = activations and temporaries at the peak; 'saved act' = what autograd saves in one "
        "forward. Analytic: fp32 weights, gradients and two AdamW moments from parameter counts (the paper's "
        "Figure 5 counts only these), activations from the layer structure.", "",
        md_table_per(per), "", limit, "", report.md_table(rows, cols), "", what_if_md(res)])


def what_if_md(res: dict) -> str:
    if "what_if_checkpoint" not in res:
        return ""
    wi = res["what_if_checkpoint"]
    return "\n".join([
        "`bcd.recompute=on` (the product): at 3 blocks, each visit with the frozen layers after its block run under "
        "`torch.utils.checkpoint` (activations recomputed in backward instead of kept), and the planner's ratio:", "",
        report.md_table(wi["rows"], [("block", "block", "d"), ("peak_ratio", "peak × full", ".2f"),
                                     ("recompute_peak_ratio", "recompute: peak × full", ".2f"),
                                     ("recompute_planned_ratio", "recompute: planner × full", ".2f"),
                                     ("step_ms", "step ms", ".1f"), ("recompute_step_ms", "recompute: step ms", ".1f"),
                                     ("time_x", "time ×", ".2f"), ("median_time_x", "time × (medians)", ".2f")])])


def md_table_per(per: list[dict]) -> str:
    return report.md_table(per, [("M", "blocks", "d"), ("ufp", "1/M", ".2f"), ("max_ufp", "largest block UFP", ".2f"),
                                 ("worst_block", "worst block", "d"), ("worst_peak_ratio", "worst peak × full", ".2f"),
                                 ("mean_peak_ratio", "mean peak × full", ".2f"),
                                 ("worst_state_ratio", "worst W+G+O × full (analytic)", ".2f"),
                                 ("worst_analytic_total_ratio", "worst analytic total × full", ".2f"),
                                 ("paper_adam_ratio", "paper (Adam)", ".2f"), ("plan", "layers per block", "s")])


def plots(rows: list[dict], per_m: dict, full: dict, out: Path) -> list[str]:
    files = []
    Ms = sorted(per_m)
    fig, axes = report.figure(1, len(Ms) + 0, figsize=(3.2 * max(1, len(Ms)), 3.6), squeeze=False)
    kinds = [("weights", "weights"), ("grads", "grads"), ("optim", "optimizer"), ("input", "input"),
             ("rest", "activations + temporaries")]
    for ax, M in zip(axes[0], Ms):
        sel = [full] + [r for r in rows if r.get("blocks") == M]
        labels = ["full"] + [f"b{r['block']}" for r in sel[1:]]
        bottom = [0.0] * len(sel)
        for key, label in kinds:
            vals = [max(r["bytes"][key], 0) / MB for r in sel]
            ax.bar(labels, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.axhline(0.5 * full["peak_bytes"] / MB, color="k", ls="--", lw=1, label="0.5 × full")
        ax.set_title(f"{M} blocks")
        ax.set_ylabel("MB")
    axes[0][0].legend(fontsize=7)
    files.append(report.save(fig, out, "memory_breakdown.png"))

    fig, ax = report.figure(figsize=(5, 3.6))
    ufp = [1 / M for M in Ms]
    ax.plot(ufp, [per_m[M]["worst_peak_ratio"] for M in Ms], "o-", label="worst block, measured peak")
    ax.plot(ufp, [per_m[M]["mean_peak_ratio"] for M in Ms], "s-", label="mean block, measured peak")
    ax.plot(ufp, [per_m[M]["worst_state_ratio"] for M in Ms], "^--", label="worst block, W+G+O analytic")
    ax.plot([1 / k for k in (2, 3, 4)], [PAPER_ADAM[k] / PAPER_ADAM[1] for k in (2, 3, 4)], "kx:",
            label="paper Table 11 (Adam)")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set_xlabel("unfrozen part 1/M")
    ax.set_ylabel("memory / full AdamW step")
    ax.legend(fontsize=7)
    files.append(report.save(fig, out, "memory_ratio.png"))
    return files
