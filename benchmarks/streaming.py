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
plans for; a holding that does not fit reports "out of memory" instead of a figure. ``--alloc-headroom-gb H`` caps
the allocator instead at the card less the device memory measured outside it (CUDA context, kernel modules, NCCL:
``mem_get_info``'s used bytes less the allocator's reserved) plus H GB, so a reserved figure past the plan and its
reserve shows as a number instead of being refused by a cap that equals it (``make gpu-check`` judges it so).
The allocator's counters (retries, out-of-memory events, device mallocs and frees, cache flushes) are recorded for the
build, the warm-up step and the timed steps apart, with each phase's peaks.

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
from dataclasses import replace
import gc
import itertools
import json
import statistics
import time

import torch

from bcdflow.core.config import load_config
from bcdflow.core.context import block_plan, cap_fraction, model_config, resolve_device
from bcdflow.core.rules import VisitSpec
from bcdflow.models import build_model
from bcdflow.models.build import materialize
from bcdflow.models.expand import SuffixAdapters
from bcdflow.models.holding import choose_holding
from bcdflow.models.memory import GB, device_budget, visit_memory
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.specs import StepShape
from bcdflow.models.stream import LayerStream, host_buffer
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.tasks.engine import VisitLayout, prepare_model, visit_step_loss
from bcdflow.tasks.expand import adapter_group, suffix_layers


def build_visit(run, mcfg, plan, block: int, device: torch.device, streamed: tuple[int, ...], recompute: bool):
    """Block ``block``'s visit part with random weights (frozen matrices in bf16 under bf16 precision), held as
    ``RunContext.load_part`` holds it: built on the meta device, its ``streamed`` layers' weights in their flat host
    buffers, the rest on the device, never the whole part on the host; with ``bcd.expand`` (the default) the
    suffix's adapters attached as a visit attaches them. Returns (model, spec, named trained parameters, stream or
    None, adapters or None)."""
    blk, pre = plan.visits[block], run.bcd.preinfer
    lo, hi = blk.layers
    expand = run.bcd.expand_rank if run.bcd.expand != "off" and hi < mcfg.n_layer and blk.mechanism.expands else 0
    vs = VisitLayout(run_id="benchmark", spec=VisitSpec(0, block, 0), lo=lo, hi=hi,
                     n_layer=mcfg.n_layer, from_acts=blk.reads_activations(pre),
                     active=frozenset(blk.trainable(run.bcd.freeze, mcfg.tied)),
                     recompute=recompute, recompute_active=run.bcd.recompute == "all", streamed=streamed, exact=False,
                     expand=expand, target=blk)
    low = torch.bfloat16 if run.train.precision == "bf16" else None
    master = OPTIMIZERS[run.optim.name].master  # 2: bf16 master weights (optim.name=adamw8bit-bf16)
    active = vs.kind.model_trainable(vs.active)  # as the engine's Resident holds a visit
    model = build_model(mcfg, layers=vs.layers, embed=vs.embed, head=True, device="meta", init=False,
                        frozen_dtype=low, trainable=active if master == 4 else ())
    model.stream = None
    if streamed:
        for i in streamed:
            model.h[str(i)].requires_grad_(False)
        model.stream = LayerStream(model, streamed, device, run.train.stream_window, grad_from=vs.lo)
    materialize(model, device)
    g = torch.Generator().manual_seed(block)
    drawn: dict[tuple, torch.Tensor] = {}  # one N(0, 0.02) draw per shape, reused: an 8B part drawn tensor by tensor
    with torch.no_grad():  # on the host takes minutes; finite losses and gradients are all the timing needs
        for name, p in model.named_parameters():
            dst = model.stream.host_tensor(name) if model.stream is not None else None
            dst = p if dst is None else dst
            if tuple(dst.shape) not in drawn:
                drawn[tuple(dst.shape)] = torch.empty(dst.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
            dst.copy_(drawn[tuple(dst.shape)])
    del drawn
    named = prepare_model(model, active, run.train.loss_chunk_rows, False)  # gradients on the block only
    named = vs.kind.attach(blk, model, named, torch.bfloat16 if master == 2 else torch.float32,
                           lambda name: model.get_parameter(name).detach())  # a row visit: its slice
    adapters = None
    if expand:
        adapters = SuffixAdapters(model, suffix_layers(vs), expand, seed=block, device=device).attach(model)
    return model, vs, named, model.stream, adapters


def pinned_allocator_bytes() -> int:
    """Bytes torch's pinned (caching host) allocator holds (the stream's buffers are not among them; 0 on the CPU).
    The key moved between torch releases ("allocated_bytes.current" in 2.13): a release with none of the known ones
    raises, so the figure is never a silent 0."""
    if not torch.cuda.is_available():
        return 0
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    raise KeyError(f"torch.cuda.host_memory_stats() has none of the pinned-bytes keys: {sorted(stats)[:12]}")


def overlap_from_trace(path: str) -> dict:
    """Copy/compute overlap of a profiled step (a Chrome trace): the host-to-device copies' time, the part of it
    under a running kernel, and whether the layer copies (over 100 us) read page-locked memory."""
    ev = json.load(open(path))["traceEvents"]
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in ev
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    busy: list[list[float]] = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel"):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    total = hidden = 0.0
    for a, b, _ in copies:
        total += b - a
        hidden += sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a)
    big = [c for c in copies if c[1] - c[0] > 100]
    return {"h2d_copies": len(copies), "h2d_us": round(total), "h2d_under_kernels_us": round(hidden),
            "overlap": hidden / total if total else None, "kernel_busy_us": round(sum(b - a for a, b in busy)),
            "layer_copies_pageable": sum("Pageable" in c[2] for c in big),
            "layer_copies_pinned": sum("Pinned" in c[2] for c in big)}


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                      "allocation.all.allocated", "allocation.all.freed")
"""The caching allocator's cumulative counters (``torch.cuda.memory_stats``) a phase's difference is taken of:
``num_alloc_retries`` counts only the full cache flushes, so the device frees and all-stream syncs (a release of cached
blocks to make room, partial ones included) are kept beside it."""


def allocator_counters(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def outside_allocator_bytes(device: torch.device) -> int:
    """Device bytes in use that the caching allocator does not hold: the CUDA context, the kernel modules loaded so
    far, cuBLAS's handles, NCCL's buffers (``mem_get_info``'s used bytes less the reserved ones; the whole device's, so
    another process's memory would count too)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def measure(run, mcfg, plan, block: int, device: torch.device, holding: str, steps: int, streamed: tuple[int, ...],
            recompute: bool, profile: bool = False) -> dict:
    """One holding of one visit: warm-up step, then ``steps`` timed steps; the device's peaks over each; the
    allocator's counters over the build, the warm-up and the timed steps apart; with ``profile`` one more step under
    the profiler, its copy/compute overlap (CUDA)."""
    B, T = run.train.batch_size, run.data.seq_len
    cuda = device.type == "cuda"
    pinned0 = pinned_allocator_bytes()
    counts = [allocator_counters(device)] if cuda else []
    model, vs, named, stream, adapters = build_visit(run, mcfg, plan, block, device, streamed, recompute)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(mcfg.vocab_size, (B, T), generator=g).to(device)
    x = (torch.randn(B, T, mcfg.d_model, generator=g).to(device) if vs.from_acts
         else torch.randint(mcfg.vocab_size, (B, T), generator=g).to(device))
    params = [p for _, p in named]
    spec = OptimSpec(run.optim.name, lr=1e-5)
    opt = make_optimizer(params, spec)
    if adapters is not None:  # as run_visit does: their own group, stepped with the block
        opt.add_param_group(adapter_group(run, spec, adapters))
    loss = visit_step_loss(model, vs, device, run.train.precision)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        run_steps(loss, params, itertools.repeat((x, y)), opt, spec, StopRule(max_steps=1),
                  extra=None if adapters is None else [p for _, p in adapters.named()])
        sync()
        return time.perf_counter() - t0

    if cuda:
        counts.append(allocator_counters(device))
        torch.cuda.reset_peak_memory_stats(device)
    step()  # warm-up: the optimizer state is made, kernels chosen, the slots filled
    if cuda:
        counts.append(allocator_counters(device))
        warm_peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    copied0 = stream.bytes_copied if stream else 0
    times = [step() for _ in range(steps)]
    if cuda:
        counts.append(allocator_counters(device))
        phases = {name: {k: b[k] - a[k] for k in ALLOCATOR_COUNTERS}
                  for name, a, b in zip(("build", "warmup", "timed"), counts, counts[1:])}
    frozen = (vs.layers[1] - vs.layers[0]) - (vs.hi - vs.lo)  # held layers the visit does not train
    out = {"holding": holding, "recompute": recompute, "streamed_layers": len(streamed), "streamed": list(streamed),
           "expand_rank": vs.expand,
           "resident_layers": frozen - len(streamed),
           "step_s": statistics.median(times), "tokens_per_s": B * T / statistics.median(times),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
           "warmup_peak_allocated_bytes": warm_peaks[0] if cuda else None,
           "warmup_peak_reserved_bytes": warm_peaks[1] if cuda else None,
           # over the build, the warm-up and the timed steps (a retry in the first step is the card's too)
           "alloc_retries": sum(p["num_alloc_retries"] for p in phases.values()) if cuda else None,
           "allocator": phases if cuda else None,
           "outside_allocator_bytes": outside_allocator_bytes(device) if cuda else None,
           "copied_bytes_per_step": (stream.bytes_copied - copied0) / steps if stream else 0,
           "host_bytes": stream.host_bytes if stream else 0,
           "pinned_allocator_bytes": pinned_allocator_bytes() - pinned0,
           "slot_bytes": stream.device_bytes if stream else 0,
           "device_buffers": len(stream.storages) if stream else 0}
    if profile and cuda:
        import os
        import tempfile

        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            out["trace"] = overlap_from_trace(os.path.join(tmp, "trace.json"))
    if adapters is not None:
        adapters.detach()
    if stream:
        stream.close()
    return out  # the caller frees the visit's memory before the next one


def h2d_gbs(device: torch.device, mb: int = 256) -> float | None:
    """Pinned host-to-device copy bandwidth, GB/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    src = host_buffer(mb * 2**20, pin=True, device=device)  # registered exactly, as the stream's buffers
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    gbs = 5 * src.numel() / (time.perf_counter() - t0) / 1e9
    del src, dst
    torch.cuda.empty_cache()  # the visits' reserved peaks start from an empty cache, not this buffer's segment
    return gbs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run config overrides")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cap-gb", type=float, default=None,
                    help="the card to emulate and plan for (GB, 1e9 bytes): caps this process's device memory")
    ap.add_argument("--alloc-headroom-gb", type=float, default=None,
                    help="with --cap-gb: cap the allocator at the card less the device memory measured outside it, "
                         "plus this much (the plan's figures are then judged, not enforced by the cap)")
    ap.add_argument("--blocks-to-run", default="worst", help="'worst' (the planner's worst visit), 'all', or 0,2,...")
    ap.add_argument("--holdings", nargs="+", default=["resident", "stream", "auto"],
                    choices=["resident", "stream", "auto"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile one more step: copy/compute overlap (CUDA)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)  # as a run resolves it: cuda -> cuda:N
    run = load_config(sets=["tracking_uri=none", *args.set])
    mcfg = model_config(run)
    plan = block_plan(run, mcfg)
    B, T, p = run.train.batch_size, run.data.seq_len, run.train.precision
    budget = device_budget(args.cap_gb * GB) if args.cap_gb else None

    def held(b: int, holding: str):
        """The planner's holding for this way: (recompute, streamed layers, estimate)."""
        offload = {"resident": "off", "stream": "stream", "auto": "auto"}[holding]
        return choose_holding(mcfg, plan, b, replace(run.step_shape(), offload=offload),
                              budget.usable if budget else None)

    if args.blocks_to_run == "worst":
        every = StepShape(B, T, p, preinfer=run.bcd.preinfer, offload="stream")  # every frozen layer streamed
        blocks = [max(range(len(plan.visits)), key=lambda b: visit_memory(mcfg, plan, b, every).peak)]
    elif args.blocks_to_run == "all":
        blocks = list(range(len(plan.visits)))
    else:
        blocks = [int(b) for b in args.blocks_to_run.split(",")]
    cap = {}
    if args.cap_gb and device.type == "cuda":  # put back at the end: the caller (a test) may run uncapped next
        total = torch.cuda.get_device_properties(device).total_memory  # the card less its context, as a run caps
        frac = cap_fraction(args.cap_gb, total)
        if args.alloc_headroom_gb is not None:  # the card less what is measured outside the allocator, plus headroom
            outside = outside_allocator_bytes(device)  # creates the context first
            frac = min(1.0, (args.cap_gb * GB - outside + args.alloc_headroom_gb * GB) / total)
            cap["outside_allocator_bytes_at_start"] = outside
        cap["alloc_cap_bytes"] = int(frac * total)
        torch.cuda.set_per_process_memory_fraction(frac, device)
    try:
        return _run(args, run, mcfg, plan, blocks, device, budget, held, cap)
    finally:
        if args.cap_gb and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _run(args, run, mcfg, plan, blocks, device, budget, held, cap: dict) -> dict:
    B, T, p = run.train.batch_size, run.data.seq_len, run.train.precision
    res = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "blocks": len(plan.visits),
           "device": str(device), "cap_gb": args.cap_gb, **cap, "h2d_gbs": h2d_gbs(device),
           "budget": None if budget is None else {"usable": budget.usable, "reserve": budget.reserve,
                                                  "line": budget.line()},
           "visits": []}
    for b in blocks:
        row = {"block": b, "layers": list(plan.visits[b].layers)}
        for holding in args.holdings:
            h = held(b, holding)
            try:
                got = measure(run, mcfg, plan, b, device, holding, args.steps, h.streamed, h.recompute,
                              profile=args.profile and holding != "resident")
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
