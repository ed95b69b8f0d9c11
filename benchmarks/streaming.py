"""Frozen layers streamed from host memory against resident ones, at a model's real shape with random weights: for
each chosen visit of the run's block plan and each way of holding its frozen layers (``resident``; ``stream``: every
one streamed; ``auto``: the planner's partial residency for the card, ``--cap-gb``), one training step's device peak
allocated and reserved, allocator retries, the distinct device buffers the streamed weights lived in, the host bytes
they took as allocated (and the pinned allocator's own), bytes copied per step and tokens/s; the planner's
prediction beside each (peak, host bytes, copies, step time), and how much of the copy time the step hid.

The visit's model is prepared and its loss taken by the visit engine's own functions (``tasks/engine.py``:
``prepare_model``, ``visit_step_loss``), streamed layers by ``models/stream.LayerStream`` as a visit streams them,
the step by ``models.trainer.run_steps``. The run config comes from ``--set`` as for ``bcdflow plan-memory``
(``model.from_hf=DIR`` reads DIR/config.json alone: no weights are needed). ``--cap-gb`` caps the process's device
memory (``torch.cuda.set_per_process_memory_fraction``) as a card of that size would, and is the card the planner
plans for; a holding that does not fit reports "out of memory" instead of a figure.

On a GPU (the figures the card issue asks for):

    S="--set train.precision=bf16 --set data.seq_len=1024 --set train.batch_size=2"
    python benchmarks/streaming.py --device cuda --cap-gb 24 $S --set model.from_hf=benchmarks/shapes/llama-3-8b \\
        --set bcd.blocks=8 --holdings auto stream        # the planner's holding and the fully streamed one
    python benchmarks/streaming.py --device cuda --cap-gb 24 $S --set model.name=G-1.6B --set bcd.blocks=3

On the CPU it is a smoke run of the same slots and counts (a CPU copy is synchronous, so its times say nothing
about CUDA streaming):

    python benchmarks/streaming.py --set model.name=tiny-llama --set bcd.blocks=3 --set data.seq_len=32 --steps 2
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
from bcdflow.models.holding import choose_holding
from bcdflow.models.memory import GB, device_budget, visit_memory
from bcdflow.models.stream import LayerStream
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.tasks.engine import VisitSpec, prepare_model, visit_step_loss


def build_visit(run, mcfg, plan, block: int, device: torch.device, streamed: tuple[int, ...], recompute: bool):
    """Block ``block``'s visit part with random weights (frozen matrices in bf16 under bf16 precision), its
    ``streamed`` layers in host memory; returns (model, spec, named trained parameters, stream or None)."""
    blk, pre = plan[block], run.bcd.preinfer
    vs = VisitSpec(run_id="benchmark", cycle=0, block=block, version=0, lo=blk.layers[0], hi=blk.layers[1],
                   n_layer=mcfg.n_layer, from_acts=blk.reads_activations(pre),
                   active=frozenset(blk.trainable(run.bcd.freeze, mcfg.tied)),
                   recompute=recompute, recompute_active=run.bcd.recompute == "all", streamed=streamed, exact=False)
    low = torch.bfloat16 if run.train.precision == "bf16" else None
    model = build_model(mcfg, layers=vs.layers, embed=vs.embed, head=True, device="meta", init=False,
                        frozen_dtype=low, trainable=vs.active)
    model.to_empty(device="cpu" if streamed else device)  # streamed layers are built on the host
    g = torch.Generator(device="cpu" if streamed else device).manual_seed(block)
    with torch.no_grad():
        for p in model.parameters():  # N(0, 0.02): finite losses and gradients; the values do not change the time
            p.normal_(0.0, 0.02, generator=g)
    model._init_buffers()
    named = prepare_model(model, vs.active, run.train.loss_chunk_rows, False)  # gradients on the block only
    model.stream = None
    if streamed:
        model.stream = LayerStream(model, streamed, device, run.train.stream_window, grad_from=vs.lo)
        model.to(device)
    return model, vs, named, model.stream


def _pinned_allocator_bytes() -> int:
    """Bytes torch's pinned (caching host) allocator holds: the stream's buffers are not among them."""
    return int(torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)) if torch.cuda.is_available() else 0


def measure(run, mcfg, plan, block: int, device: torch.device, holding: str, steps: int, streamed: tuple[int, ...],
            recompute: bool) -> dict:
    """One holding of one visit: warm-up step, then ``steps`` timed steps; the device's peaks over them."""
    B, T = run.train.batch_size, run.data.seq_len
    cuda = device.type == "cuda"
    pinned0 = _pinned_allocator_bytes()
    model, vs, named, stream = build_visit(run, mcfg, plan, block, device, streamed, recompute)
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

    step()  # warm-up: the optimizer state is made, kernels chosen, the slots filled
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    copied0 = stream.bytes_copied if stream else 0
    times = [step() for _ in range(steps)]
    frozen = (vs.layers[1] - vs.layers[0]) - (vs.hi - vs.lo)  # held layers the visit does not train
    out = {"holding": holding, "recompute": recompute, "streamed_layers": len(streamed),
           "resident_layers": frozen - len(streamed),
           "step_s": statistics.median(times), "tokens_per_s": B * T / statistics.median(times),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
           "alloc_retries": int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if cuda else None,
           "copied_bytes_per_step": (stream.bytes_copied - copied0) / steps if stream else 0,
           "host_bytes": stream.host_bytes if stream else 0,
           "pinned_allocator_bytes": _pinned_allocator_bytes() - pinned0,
           "slot_bytes": stream.device_bytes if stream else 0,
           "device_buffers": len(stream.storages) if stream else 0}
    if stream:
        stream.close()
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
    ap.add_argument("--cap-gb", type=float, default=None,
                    help="the card to emulate and plan for (GB, 1e9 bytes): caps this process's device memory")
    ap.add_argument("--blocks-to-run", default="worst", help="'worst' (the planner's worst visit), 'all', or 0,2,...")
    ap.add_argument("--holdings", nargs="+", default=["resident", "stream", "auto"],
                    choices=["resident", "stream", "auto"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    run = load_config(sets=["tracking_uri=none", *args.set])
    mcfg = model_config(run)
    plan = block_plan(run, mcfg)
    B, T, p = run.train.batch_size, run.data.seq_len, run.train.precision
    budget = device_budget(args.cap_gb * GB) if args.cap_gb else None
    kw = dict(preinfer=run.bcd.preinfer, freeze=run.bcd.freeze, chunk_rows=run.train.loss_chunk_rows,
              weight_decay=run.optim.weight_decay)

    def held(b: int, holding: str):
        """The planner's holding for this way: (recompute, streamed layers, estimate)."""
        offload = {"resident": "off", "stream": "stream", "auto": "auto"}[holding]
        h = choose_holding(mcfg, plan, b, B, T, p, budget.usable if budget else None, run.optim.name,
                           recompute=run.bcd.recompute, offload=offload, window=run.train.stream_window,
                           pcie_gbs=run.train.pcie_gbs, tflops=run.train.tflops, **kw)
        return h

    if args.blocks_to_run == "worst":
        blocks = [max(range(len(plan)), key=lambda b: visit_memory(mcfg, plan, b, B, T, p, stream=True,
                                                                    preinfer=run.bcd.preinfer).peak)]
    elif args.blocks_to_run == "all":
        blocks = list(range(len(plan)))
    else:
        blocks = [int(b) for b in args.blocks_to_run.split(",")]
    if args.cap_gb and device.type == "cuda":  # put back at the end: the caller (a test) may run uncapped next
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GB / total), device)
    try:
        return _run(args, run, mcfg, plan, blocks, device, budget, held)
    finally:
        if args.cap_gb and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _run(args, run, mcfg, plan, blocks, device, budget, held) -> dict:
    B, T, p = run.train.batch_size, run.data.seq_len, run.train.precision
    res = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "blocks": len(plan),
           "device": str(device), "cap_gb": args.cap_gb, "h2d_gbs": h2d_gbs(device),
           "budget": None if budget is None else {"usable": budget.usable, "reserve": budget.reserve,
                                                  "line": budget.line()},
           "visits": []}
    for b in blocks:
        row = {"block": b, "layers": list(plan[b].layers)}
        for holding in args.holdings:
            h = held(b, holding)
            try:
                got = measure(run, mcfg, plan, b, device, holding, args.steps, h.streamed, h.recompute)
            except torch.OutOfMemoryError:
                got = {"holding": holding, "error": "out of memory"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            got.update(planned_peak_bytes=h.estimate.peak, planned_host_bytes=h.estimate.host_bytes,
                       planned_copy_bytes=h.estimate.copy_bytes, planned_step_s=h.time.streamed_s if h.time else None,
                       planned_resident_step_s=h.time.resident_s if h.time else None, fits_plan=h.fits)
            row[holding] = got
        r = row.get("resident", {})
        for holding in ("stream", "auto"):
            s = row.get(holding, {})
            if "step_s" in r and "step_s" in s and s["recompute"] == r["recompute"]:
                s["over_resident_tokens_per_s"] = s["tokens_per_s"] / r["tokens_per_s"]
                if res["h2d_gbs"] and s["copied_bytes_per_step"]:  # the copy time alone, and the part the step hid
                    copy_s = s["copied_bytes_per_step"] / (res["h2d_gbs"] * 1e9)
                    s["copy_s"] = copy_s
                    s["hidden"] = max(0.0, 1.0 - (s["step_s"] - r["step_s"]) / copy_s)
        res["visits"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
