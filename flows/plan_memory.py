"""``bcdflow plan-memory -c run.yaml --gpu-gb 24``: the predicted peak memory of every visit of a run and of full
training, from the model config alone (models/memory.py: a meta-device model, no weights, no store), and the
smallest ``bcd.blocks`` (with ``bcd.recompute`` and ``train.offload``) whose every visit fits the GPU. With the frozen
layers streamed from host memory it also says the pinned host memory, the bytes copied per step and their time at a
stated PCIe bandwidth against the step's matmul time at a stated throughput (how much of the copy compute hides).

    bcdflow plan-memory --set model.name=L-6B --set train.batch_size=2 --set data.seq_len=1024 \\
        --set train.precision=bf16 --gpu-gb 24
    bcdflow plan-memory --set model.from_hf=./llama-3-8b-config/ ...   # a directory with config.json alone will do
"""
from __future__ import annotations

import json

from bcdflow.errors import BadInput

COLS = ("weights", "grads_total", "optim", "activations", "logits")
NAMES = {"grads_total": "grads"}


def add_parser(sub, common) -> None:
    sp = sub.add_parser("plan-memory", parents=[common],
                        help="predicted peak memory per visit and for full training; the bcd.blocks that fits")
    sp.add_argument("-c", "--config", help="YAML config file (as for train)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    sp.add_argument("--gpu-gb", type=float, default=24.0, help="GPU memory to fit, GB (1e9 bytes; default 24)")
    sp.add_argument("--pcie-gbs", type=float, default=25.0,
                    help="host-to-device bandwidth for streamed layers, GB/s (default 25: PCIe 4.0 x16 in practice)")
    sp.add_argument("--tflops", type=float, default=80.0,
                    help="matmul throughput a step reaches, TFLOP/s (default 80: half an RTX 4090's bf16 peak)")
    sp.add_argument("--json", action="store_true", help="the table and the recommendation as JSON")
    sp.set_defaults(fn=cmd_plan_memory)


def plan(cfg, gpu_gb: float, pcie_gbs: float = 25.0, tflops: float = 80.0) -> dict:
    """Every visit of ``cfg``'s plan with and without recompute, resident and streamed, full training, and the
    recommendation."""
    from bcdflow.core.context import model_config  # torch: not for `bcdflow --help` (flows/cli.py)
    from bcdflow.models import model_plan
    from bcdflow.models.memory import GB, plan_visits, recommend, step_flops, visit_memory

    mcfg = model_config(cfg)
    t = cfg.train
    B, T, p, opt = t.batch_size, cfg.data.seq_len, t.precision, cfg.optim.name
    kw = {"chunk_rows": t.loss_chunk_rows, "weight_decay": cfg.optim.weight_decay}
    freeze = tuple(cfg.bcd.freeze)
    common = dict(split=cfg.bcd.split, preinfer=cfg.bcd.preinfer, freeze=freeze, **kw)
    visits = plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, False, **common)
    redo = plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, True, **common)
    window = t.stream_window
    stream = plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, False, stream=True, window=window, **common)
    plan_ = model_plan(mcfg, cfg.bcd.blocks, split=cfg.bcd.split, freeze=freeze)
    full = visit_memory(mcfg, None, None, B, T, p, opt, **kw)
    rec = recommend(mcfg, B, T, p, gpu_gb * GB, opt, cfg.bcd.split, cfg.bcd.preinfer, window=window, freeze=freeze,
                    **kw)

    def streamed(e, b: int) -> dict:
        copy_s = e.copy_bytes / (pcie_gbs * 1e9)
        compute_s = step_flops(mcfg, plan_, b, B, T, cfg.bcd.preinfer, freeze) / (tflops * 1e12)
        return {"stream_peak": e.peak, "host_bytes": e.host_bytes, "copy_bytes": e.copy_bytes, "copy_s": copy_s,
                "compute_s": compute_s, "hidden": min(1.0, compute_s / copy_s) if copy_s else 1.0}

    if rec.blocks is None and not freeze:  # what freezing the big-vocabulary parts would make fit (a trade-off)
        alt = recommend(mcfg, B, T, p, gpu_gb * GB, opt, cfg.bcd.split, cfg.bcd.preinfer, window=window,
                        freeze=("embeddings", "head"), **kw)
        if alt.blocks is not None:
            rec.hint = (f"with bcd.freeze=[embeddings,head] (no longer full-parameter): bcd.blocks={alt.blocks} "
                        f"bcd.recompute={'on' if alt.recompute else 'off'}"
                        f"{' train.offload=stream' if alt.stream else ''} fits (worst visit {alt.worst_peak / GB:.1f} GB)")
    out = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "optim": opt, "gpu_gb": gpu_gb,
           "blocks": cfg.bcd.blocks, "full": full.to_dict(),
           "pcie_gbs": pcie_gbs, "tflops": tflops, "stream_window": window,
           "visits": [dict(v.to_dict(), recompute_peak=r.peak, **streamed(s, b))
                      for b, (v, r, s) in enumerate(zip(visits, redo, stream))],
           "recommendation": {"blocks": rec.blocks, "recompute": rec.recompute, "offload": "stream" if rec.stream
                              else "off", "host_bytes": rec.host_bytes, "worst_peak": rec.worst_peak,
                              "line": rec.line(gpu_gb * GB) + (f"; {rec.hint}" if rec.hint else "")}}
    if t.gpus > 1:  # per process, the batch split over the GPUs
        out["per_gpu"] = {mode: max(e.peak for e in plan_visits(mcfg, cfg.bcd.blocks, B, T, p, opt, False,
                                                                 gpus=t.gpus, parallel=mode, **common))
                          for mode in ("ddp", "fsdp")}
    return out


def table(res: dict) -> str:
    gb = 1e9
    head = (f"{'visit':<9}{'layers':>8}{'trainable':>11}" + "".join(f"{NAMES.get(c, c):>12}" for c in COLS)
            + f"{'peak':>9}{'recompute':>11}{'streamed':>10}{'host':>7}{'copy':>7}{'hidden':>8}  fits {res['gpu_gb']:g} GB")
    lines = [f"{res['model']['family']} {res['model']['n_layer']} layers, d={res['model']['d_model']}, "
             f"vocab={res['model']['vocab_size']}; batch {res['batch']}x{res['seq_len']}, {res['precision']}, "
             f"{res['optim']}, bcd.blocks={res['blocks']}. Predicted GB of one training step: weights, gradients and "
             "optimizer state of the visit; activations and logits alive at its peak; the peak itself, with the "
             f"frozen suffix recomputed, and with the frozen layers streamed from host memory (window "
             f"{res['stream_window']}; pinned host GB, GB copied per step, and the share of the copy time at "
             f"{res['pcie_gbs']:g} GB/s hidden behind the step's matmuls at {res['tflops']:g} TFLOP/s)", head,
             "-" * len(head)]
    cap = res["gpu_gb"] * gb
    for r in [res["full"], *res["visits"]]:
        lo, hi = r["layers"]
        redo, st = r.get("recompute_peak"), r.get("stream_peak")
        fits = ("yes" if r["peak"] <= cap else "with recompute" if redo and redo <= cap else
                "streamed" if st and st <= cap else "no")
        tail = (f"{st / gb:>10.2f}{r['host_bytes'] / gb:>7.1f}{r['copy_bytes'] / gb:>7.1f}{r['hidden']:>8.0%}"
                if st is not None else f"{'-':>10}{'-':>7}{'-':>7}{'-':>8}")
        lines.append(f"{r['name']:<9}{f'{lo}-{hi}':>8}{r['trainable_params'] / 1e6:>10.0f}M"
                     + "".join(f"{r[c] / gb:>12.2f}" for c in COLS) + f"{r['peak'] / gb:>9.2f}"
                     + (f"{redo / gb:>11.2f}" if redo is not None else f"{'-':>11}") + tail + f"  {fits}")
    if "per_gpu" in res:
        lines.append("per GPU, worst visit: " + ", ".join(f"{m} {v / gb:.2f}" for m, v in res["per_gpu"].items()))
    lines.append(res["recommendation"]["line"])
    return "\n".join(lines)


def cmd_plan_memory(args) -> int:
    from bcdflow.core.config import load_config

    if not args.gpu_gb > 0:
        raise BadInput(f"--gpu-gb: must be a positive number of GB, got {args.gpu_gb:g}")
    if not args.pcie_gbs > 0 or not args.tflops > 0:
        raise BadInput(f"--pcie-gbs/--tflops: must be positive, got {args.pcie_gbs:g} and {args.tflops:g}")
    res = plan(load_config(args.config, args.set), args.gpu_gb, args.pcie_gbs, args.tflops)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0
