"""Visit vs full step: per-iteration time and peak memory of one training step in each block's visit
(pre-inference on, paper §3.2.2) against a full-parameter step, side by side in one run.

Configurations, from one set of weights: ``full`` (whole model, all parameters trainable); ``block 0``
(embeddings + all layers + head, block 0 trainable, as ``tasks/train.py`` visits it); ``block b > 0``
(layers of blocks >= b + head, fed the frozen prefix's (B, T, C) hidden states, computed once off the clock).

Each step is ``models.trainer.run_steps`` for one step (zero_grad, forward+loss as in ``train_visit``,
backward, clip, optimizer step). Time: median over ``--steps`` after ``--warmup``, the configurations taking
turns step by step so a busy spell on a shared machine hits them alike. Peak memory: the state alive before
a step (weights, optimizer state, batch; grads are None then) plus the most the step holds on top of it,
from ``max_memory_allocated`` on CUDA (less what was allocated before: the other configurations' tensors
sit still), from a dispatch-mode tracker on CPU (no allocator stats there), checked on an analytic case.
All configurations are held at once (about 2.5x the full step's state). "flops x" is the analytic matmul
FLOP ratio, the step ratio's floor when the matmuls dominate.

Targets (issue): mean block step time <= 0.55 x full; worst block's peak memory <= 0.5 x full.
A miss prints MISS; the exit status stays 0 (CONVENTIONS 10).

    python benchmarks/visit_vs_full.py                      # CPU: gpt2-124m at half width, about a minute
    python benchmarks/visit_vs_full.py --model tiny         # any registry size; --n-layer etc. override
    python benchmarks/visit_vs_full.py --device cuda        # GPU: gpt2-124m, batch 8 x 1024, bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script (python benchmarks/visit_vs_full.py): the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MB, Visit, check_tracker, machine, prefix_batch, round_robin  # noqa: E402
from models import build_model, get_config, make_plan  # noqa: E402
from tasks.weights import resolve_device  # noqa: E402

# Defaults for arguments not given. CPU: one thread (two stall whenever the box is busy, skewing the ratios)
# and, without --model, gpt2-124m at half width and vocabulary: the same 12 layers (4-layer blocks) and the
# same layers : tied-head ratio (144 d^2 : V d = 2.2 : 1), at a quarter of the FLOPs (about a minute).
DEFAULTS = {"cpu": dict(batch_size=2, seq_len=128, precision="fp32", steps=5, warmup=2, threads=1),
            "cuda": dict(batch_size=8, seq_len=1024, precision="bf16", steps=20, warmup=5)}
CPU_MODEL = dict(model="gpt2-124m", d_model=384, n_head=6, vocab_size=25152)


def summarize(rows: list[dict]) -> dict:
    """Ratios to the full step on every row; the issue's two targets over the blocks."""
    full, blocks = rows[0], rows[1:]
    for r in rows:
        r["ratios"] = {k: r[k] / full[k] for k in ("step_ms_median", "peak_bytes", "matmul_flops_per_token")}
    mean = {k: statistics.fmean(r[k] for r in blocks) for k in ("step_ms_median", "peak_bytes")}
    s = {"mean_step_ratio": mean["step_ms_median"] / full["step_ms_median"], "step_target": 0.55,
         "worst_peak_ratio": max(r["peak_bytes"] for r in blocks) / full["peak_bytes"], "peak_target": 0.5,
         "mean_peak_ratio": mean["peak_bytes"] / full["peak_bytes"],
         "mean_flops_ratio": statistics.fmean(r["ratios"]["matmul_flops_per_token"] for r in blocks),
         "mean_block_step_ms": mean["step_ms_median"], "mean_block_peak_bytes": mean["peak_bytes"]}
    return {**s, "step_pass": s["mean_step_ratio"] <= 0.55, "peak_pass": s["worst_peak_ratio"] <= 0.5}


def print_table(rows: list[dict], s: dict) -> None:
    head = (f"{'config':<12}{'layers':>7}{'trainable':>11}{'step ms':>10}{'mean ms':>10}{'x full':>8}"
            f"{'flops x':>9}{'peak MB':>10}{'x full':>8}   weights/grads/optim/input/rest MB")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        q = r["ratios"]
        print(f"{r['name']:<12}{'%d-%d' % tuple(r['layers']):>7}{r['trainable_params'] / 1e6:>10.2f}M"
              f"{r['step_ms_median']:>10.1f}{r['step_ms_mean']:>10.1f}{q['step_ms_median']:>8.2f}"
              f"{q['matmul_flops_per_token']:>9.2f}{r['peak_bytes'] / MB:>10.1f}{q['peak_bytes']:>8.2f}   "
              + "/".join(f"{v / MB:.0f}" for v in r["bytes"].values()))
    print(f"{'blocks mean':<30}{s['mean_block_step_ms']:>10.1f}{'':>10}{s['mean_step_ratio']:>8.2f}"
          f"{s['mean_flops_ratio']:>9.2f}{s['mean_block_peak_bytes'] / MB:>10.1f}{s['mean_peak_ratio']:>8.2f}")
    print(f"mean block step / full step = {s['mean_step_ratio']:.2f} (target <= 0.55): "
          f"{'PASS' if s['step_pass'] else 'MISS'}")
    print(f"worst block peak / full peak = {s['worst_peak_ratio']:.2f} (target <= 0.50): "
          f"{'PASS' if s['peak_pass'] else 'MISS'}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="registry name (models/config.py); default gpt2-124m, scaled down on CPU")
    for field in ("n-layer", "d-model", "n-head", "vocab-size", "batch-size", "seq-len"):
        ap.add_argument(f"--{field}", type=int)
    ap.add_argument("--split", choices=("params", "layers"), default="params", help="bcd.split")
    ap.add_argument("--blocks", type=int, default=3, help="bcd.blocks")
    ap.add_argument("--steps", type=int, help="timed steps per configuration, after warmup")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--precision", choices=("fp32", "bf16"))
    ap.add_argument("--optim", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--threads", type=int, help="torch CPU threads (CPU default 1, see DEFAULTS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/out/visit_vs_full.json")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    defaults = {**DEFAULTS[device.type], **(CPU_MODEL if device.type == "cpu" and not args.model else {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model = args.model or "gpt2-124m"
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = get_config(args.model, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                     vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    whole = build_model(cfg)
    master = whole.state_dict()  # one set of weights for every configuration, kept on the CPU
    sizes = {n: p.numel() for n, p in whole.named_parameters()}
    # the product's default plan (bcd.split=params) balances parameter counts; layers = even layer split
    plan = make_plan(sizes if args.split == "params" else list(sizes), cfg.n_layer, args.blocks)
    B, T = args.batch_size, args.seq_len
    tokens = torch.randint(cfg.vocab_size, (B, T + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T)
    info = machine(device)
    print(f"{args.model} ({cfg.n_layer} layers, d={cfg.d_model}, vocab={cfg.vocab_size}), batch {B}x{T}, "
          f"{args.precision}, {args.optim}, {args.blocks} blocks {[list(b.layers) for b in plan.blocks]}, "
          f"{info['device']} ({info['gpu'] or info['cpu']}, {info['threads']} threads)")
    check = check_tracker() if device.type == "cpu" else None

    visits = [Visit("full", cfg, master, device, args, (0, cfg.n_layer), True, set(sizes), (x, y))]
    for blk in plan.blocks:
        lo = blk.layers[0]
        # paper §3.2.2 pre-inference: the frozen prefix runs once, before the visit, off the clock
        batch = (x, y) if lo == 0 else (prefix_batch(cfg, master, device, args.precision, x, lo), y)
        visits.append(Visit(f"block {blk.index}", cfg, master, device, args, (lo, cfg.n_layer), lo == 0,
                            set(blk.params), batch))
    round_robin(visits, args.warmup, args.steps)
    rows = [v.report() for v in visits]

    summary = summarize(rows)
    print_table(rows, summary)
    result = {"machine": info, "args": vars(args), "model": cfg.to_dict(), "plan": plan.to_dict(),
              "tracker_check": check, "configs": rows, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
