"""``bcdflow plan-memory -c run.yaml --gpu-gb 24``: the predicted peak memory of every visit of a run and of full
training, from the model config alone (models/memory.py: a meta-device model, no weights, no store), and the
smallest ``bcd.blocks`` (with ``bcd.recompute``) whose every visit fits the GPU.

    bcdflow plan-memory --set model.name=L-6B --set train.batch_size=2 --set data.seq_len=1024 \\
        --set train.precision=bf16 --gpu-gb 24
"""
from __future__ import annotations

import json

from bcdflow.core.context import model_config
from bcdflow.errors import BadInput

COLS = ("weights", "grads_total", "optim", "activations", "logits")
NAMES = {"grads_total": "grads"}


def add_parser(sub, common) -> None:
    sp = sub.add_parser("plan-memory", parents=[common],
                        help="predicted peak memory per visit and for full training; the bcd.blocks that fits")
    sp.add_argument("-c", "--config", help="YAML config file (as for train)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    sp.add_argument("--gpu-gb", type=float, default=24.0, help="GPU memory to fit, GB (1e9 bytes; default 24)")
    sp.add_argument("--json", action="store_true", help="the table and the recommendation as JSON")
    sp.set_defaults(fn=cmd_plan_memory)


def plan(cfg, gpu_gb: float) -> dict:
    """Every visit of ``cfg``'s plan with and without recompute, full training, and the recommendation."""
    from bcdflow.models.memory import GB, plan_visits, recommend, visit_memory

    mcfg = model_config(cfg)
    t = cfg.train
    B, T, p, opt = t.batch_size, cfg.data.seq_len, t.precision, cfg.optim.name
    kw = {"chunk_rows": t.loss_chunk_rows, "weight_decay": cfg.optim.weight_decay}
    common = dict(split=cfg.bcd.split, preinfer=cfg.bcd.preinfer, **kw)
    visits = plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, False, **common)
    redo = plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, True, **common)
    full = visit_memory(mcfg, None, None, B, T, p, opt, **kw)
    rec = recommend(mcfg, B, T, p, gpu_gb * GB, opt, cfg.bcd.split, cfg.bcd.preinfer, **kw)
    out = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "optim": opt, "gpu_gb": gpu_gb,
           "blocks": cfg.bcd.blocks, "full": full.to_dict(),
           "visits": [dict(v.to_dict(), recompute_peak=r.peak) for v, r in zip(visits, redo)],
           "recommendation": {"blocks": rec.blocks, "recompute": rec.recompute, "worst_peak": rec.worst_peak,
                              "line": rec.line(gpu_gb * GB)}}
    if t.gpus > 1:  # per process, the batch split over the GPUs
        out["per_gpu"] = {mode: max(e.peak for e in plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, False,
                                                                 gpus=t.gpus, parallel=mode, **common))
                          for mode in ("ddp", "fsdp")}
    return out


def table(res: dict) -> str:
    gb = 1e9
    head = (f"{'visit':<9}{'layers':>8}{'trainable':>11}" + "".join(f"{NAMES.get(c, c):>12}" for c in COLS)
            + f"{'peak':>9}{'recompute':>11}  fits {res['gpu_gb']:g} GB")
    lines = [f"{res['model']['family']} {res['model']['n_layer']} layers, d={res['model']['d_model']}, "
             f"vocab={res['model']['vocab_size']}; batch {res['batch']}x{res['seq_len']}, {res['precision']}, "
             f"{res['optim']}, bcd.blocks={res['blocks']}. Predicted GB of one training step: weights, gradients and "
             "optimizer state of the visit; activations and logits alive at its peak; the peak itself", head,
             "-" * len(head)]
    cap = res["gpu_gb"] * gb
    for r in [res["full"], *res["visits"]]:
        lo, hi = r["layers"]
        redo = r.get("recompute_peak")
        fits = "yes" if r["peak"] <= cap else ("with recompute" if redo and redo <= cap else "no")
        lines.append(f"{r['name']:<9}{f'{lo}-{hi}':>8}{r['trainable_params'] / 1e6:>10.0f}M"
                     + "".join(f"{r[c] / gb:>12.2f}" for c in COLS) + f"{r['peak'] / gb:>9.2f}"
                     + (f"{redo / gb:>11.2f}" if redo is not None else f"{'-':>11}") + f"  {fits}")
    if "per_gpu" in res:
        lines.append("per GPU, worst visit: " + ", ".join(f"{m} {v / gb:.2f}" for m, v in res["per_gpu"].items()))
    lines.append(res["recommendation"]["line"])
    return "\n".join(lines)


def cmd_plan_memory(args) -> int:
    from bcdflow.core.config import load_config

    if not args.gpu_gb > 0:
        raise BadInput(f"--gpu-gb: must be a positive number of GB, got {args.gpu_gb:g}")
    res = plan(load_config(args.config, args.set), args.gpu_gb)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0
