"""Frozen layers streamed from host memory against resident ones, at a model's real shape with random weights: for
each chosen visit of the run's block plan, one training step's device peak and tokens/s for each way of holding the
frozen layers, the planner's prediction beside it, and how much of the copy time the step hides (issue 16).

The visit's model is prepared and its loss taken by the visit engine's own functions (``tasks/engine.py``:
``prepare_model``, ``visit_step_loss``), streamed layers by ``models/stream.LayerStream`` as ``train.offload=stream``
does, the step by ``models.trainer.run_steps``. The run config comes from ``--set`` as for ``bcdflow plan-memory``
(``model.from_hf=DIR`` reads DIR/config.json alone: no weights are needed). ``--cap-gb`` caps the process's device
memory (``torch.cuda.set_per_process_memory_fraction``) as an RTX 4090 would; a holding that does not fit reports
"out of memory" instead of a figure.

On a GPU (the figures the issue asks for):

    S="--set train.precision=bf16 --set data.seq_len=1024"
    python benchmarks/streaming.py --device cuda --cap-gb 24 $S --set model.from_hf=LLAMA3_8B_CONFIG_DIR \\
        --set bcd.blocks=12 --set train.batch_size=2 --set bcd.recompute=on --holdings stream   # worst peak <= 16 GB
    python benchmarks/streaming.py --device cuda --cap-gb 24 $S --set model.name=G-1.6B --set bcd.blocks=3 \\
        --set train.batch_size=4                                       # streamed / resident tokens/s (target >= 0.8)

On the CPU it is a smoke run (a CPU copy is synchronous, so the CPU's times say nothing about CUDA streaming):

    python benchmarks/streaming.py --set model.name=tiny --set bcd.blocks=3 --set data.seq_len=32 --steps 2
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time

import torch

from bcdflow.core.config import load_config
from bcdflow.core.context import block_plan, model_config
from bcdflow.models import build_model
from bcdflow.models.memory import GB, visit_memory
from bcdflow.models.stream import LayerStream
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.tasks.engine import VisitSpec, prepare_model, visit_step_loss


def build_visit(run, mcfg, plan, block: int, device: torch.device, stream: bool):
    """Block ``block``'s visit part with random weights (frozen matrices in bf16 under bf16 precision), its frozen
    layers streamed when asked; returns (model, spec, named trained parameters, stream or None)."""
    blk, pre = plan[block], run.bcd.preinfer
    frozen = blk.frozen_layers(mcfg.n_layer, pre)
    vs = VisitSpec(run_id="benchmark", cycle=0, block=block, version=0, lo=blk.layers[0], hi=blk.layers[1],
                   n_layer=mcfg.n_layer, from_acts=blk.reads_activations(pre),
                   active=frozenset(blk.trainable(run.bcd.freeze, mcfg.tied)),
                   recompute=run.bcd.recompute in ("on", "all"), recompute_active=run.bcd.recompute == "all",
                   streamed=tuple(frozen) if stream else (), exact=False)
    low = torch.bfloat16 if run.train.precision == "bf16" else None
    model = build_model(mcfg, layers=vs.layers, embed=vs.embed, head=True, device="meta", init=False,
                        frozen_dtype=low, trainable=vs.active)
    model.to_empty(device="cpu" if stream else device)  # streamed layers live on the host
    g = torch.Generator(device="cpu" if stream else device).manual_seed(block)
    with torch.no_grad():
        for p in model.parameters():  # N(0, 0.02): finite losses and gradients; the values do not change the time
            p.normal_(0.0, 0.02, generator=g)
    model._init_buffers()
    named = prepare_model(model, vs.active, run.train.loss_chunk_rows, False)  # gradients on the block only
    model.stream = None
    if stream:
        model.stream = LayerStream(model, frozen, device, run.train.stream_window)
        model.to(device)
    return model, vs, named, model.stream


def measure(run, mcfg, plan, block: int, device: torch.device, holding: str, steps: int) -> dict:
    """One holding of one visit: warm-up step, then ``steps`` timed steps; peak device bytes of a step."""
    B, T = run.train.batch_size, run.data.seq_len
    cuda = device.type == "cuda"
    model, vs, named, stream = build_visit(run, mcfg, plan, block, device, holding == "stream")
    g = torch.Generator().manual_seed(0)
    y = torch.randint(mcfg.vocab_size, (B, T), generator=g).to(device)
    x = (torch.randn(B, T, mcfg.d_model, generator=g).to(device) if vs.from_acts
         else torch.randint(mcfg.vocab_size, (B, T), generator=g).to(device))
    params = [p for _, p in named]
    spec = OptimSpec(run.optim.name, lr=1e-5)
    opt = make_optimizer(params, spec)
    loss = visit_step_loss(model, vs, device, run.train.precision)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        run_steps(loss, params, itertools.repeat((x, y)), opt, spec, StopRule(max_steps=1))
        sync()
        return time.perf_counter() - t0

    step()  # warm-up: the optimizer state is made, kernels chosen
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    copied0 = stream.bytes_copied if stream else 0
    times = [step() for _ in range(steps)]
    out = {"holding": holding, "step_s": statistics.median(times), "tokens_per_s": B * T / statistics.median(times),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "copied_bytes_per_step": (stream.bytes_copied - copied0) / steps if stream else 0,
           "host_bytes": stream.host_bytes if stream else 0, "peak_live_layers": stream.peak_live if stream else None}
    if stream:
        stream.release()
    return out  # the caller frees the visit's memory before the next one


def h2d_gbs(device: torch.device, mb: int = 256) -> float | None:
    """Pinned host-to-device copy bandwidth, GB/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(mb * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run config overrides")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cap-gb", type=float, default=None, help="cap this process's device memory (GB, 1e9 bytes)")
    ap.add_argument("--blocks-to-run", default="worst", help="'worst' (the planner's worst visit), 'all', or 0,2,...")
    ap.add_argument("--holdings", nargs="+", default=["resident", "stream"], choices=["resident", "stream"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    run = load_config(sets=["tracking_uri=none", *args.set])
    mcfg = model_config(run)
    plan = block_plan(run, mcfg)
    B, T, p = run.train.batch_size, run.data.seq_len, run.train.precision
    recompute = run.bcd.recompute in ("on", "all")

    def planned(b: int, stream: bool):
        return visit_memory(mcfg, plan, b, B, T, p, run.optim.name, recompute, run.bcd.preinfer,
                            chunk_rows=run.train.loss_chunk_rows, weight_decay=run.optim.weight_decay,
                            stream=stream, window=run.train.stream_window, freeze=run.bcd.freeze,
                            recompute_active=run.bcd.recompute == "all")

    if args.blocks_to_run == "worst":
        blocks = [max(range(len(plan)), key=lambda b: planned(b, True).peak)]
    elif args.blocks_to_run == "all":
        blocks = list(range(len(plan)))
    else:
        blocks = [int(b) for b in args.blocks_to_run.split(",")]
    if args.cap_gb and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GB / total), device)
    res = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "blocks": len(plan),
           "recompute": recompute, "device": str(device), "cap_gb": args.cap_gb, "h2d_gbs": h2d_gbs(device),
           "visits": []}
    for b in blocks:
        row = {"block": b, "layers": list(plan[b].layers)}
        for holding in args.holdings:
            try:
                got = measure(run, mcfg, plan, b, device, holding, args.steps)
            except torch.OutOfMemoryError:
                got = {"holding": holding, "error": "out of memory"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            got["planned_peak_bytes"] = planned(b, holding == "stream").peak
            row[holding] = got
        if "step_s" in row.get("resident", {}) and "step_s" in row.get("stream", {}):
            r, s = row["resident"], row["stream"]
            row["stream_over_resident_tokens_per_s"] = s["tokens_per_s"] / r["tokens_per_s"]
            if res["h2d_gbs"]:  # the copy time alone at the measured bandwidth, and the part the step hid
                copy_s = s["copied_bytes_per_step"] / (res["h2d_gbs"] * 1e9)
                row["copy_s"] = copy_s
                row["hidden"] = max(0.0, 1.0 - (s["step_s"] - r["step_s"]) / copy_s) if copy_s else 1.0
        res["visits"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
