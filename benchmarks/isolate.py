"""Each configuration of the step benchmarks in its own process on a GPU, so ``--device cuda`` completes on one card.

On the CPU the step benchmarks build every configuration in one process and time them round-robin (a busy
machine then slows them all alike). On a GPU that holds every configuration's weights, optimizer state and batch
at once, which overflows even an 80 GB card for a 1.6B model; and one configuration's allocations would blur the
next one's peak. So on CUDA, ``Workload.full``/``visit``/``prefix`` return a :class:`Remote`: the configuration's
description plus a meta-device model (for FLOP counts, no memory), and each measurement (peak, saved activations,
timed steps) runs in a fresh process (forked from a server that imported torch once) that builds just that configuration with random weights on the GPU
(memory and time do not depend on the weights' values), measures it and exits: every configuration starts from an
empty card. GPU timings are steady, so no round-robin is needed there.

This module imports none of the other benchmark modules (``common`` imports it): the child gets the workload's
class and the measurement to run as arguments, which the process pool pickles by reference.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics

import torch

from bcdflow.models import build_model


class Remote:
    """A configuration measured in a child process. ``kind``: ``full``, ``visit`` (block ``block`` of the
    ``blocks``-block plan, ``preinfer``, ``recompute``) or ``prefix`` (the pre-inference forward of layers [0, lo))."""

    def __init__(self, w, name: str, kind: str, **spec):
        self.w, self.name, self.kind, self.spec = w, name, kind, spec
        self.device = w.device
        self.times: list[float] = []
        cfg = w.cfg
        if kind == "prefix":
            self.info = spec["info"]
            return
        if kind == "full":
            layers, embed, trainable, start = (0, cfg.n_layer), True, set(w.names), 0
        else:
            blk = w.plan(spec["blocks"]).visits[spec["block"]]
            lo = blk.layers[0]
            from_acts = blk.reads_activations(spec["preinfer"])
            layers, embed, trainable, start = (lo if from_acts else 0, cfg.n_layer), not from_acts, set(blk.params), lo
        self.layers, self.embed, self.trainable, self.start = layers, embed, trainable, start
        self.hi = None if kind == "full" else w.plan(spec["blocks"]).visits[spec["block"]].layers[1]
        self.recompute = spec.get("recompute", False)
        self.model = build_model(cfg, layers=layers, embed=embed, head=True, device="meta", init=False)
        self.params = [p for n, p in self.model.named_parameters() if n in trainable]

    @property
    def best_s(self) -> float:
        return min(self.times)

    def in_child(self, fn, **kw):
        """``fn(w, v, **kw)`` in a fresh process, where ``w`` is this workload rebuilt with random weights on the
        device and ``v`` this configuration built from it; returns what ``fn`` returns. ``fn`` is a module-level
        function (the pool pickles it by reference), e.g. ``memory.measure``."""
        with _context(fn, type(self.w)).Pool(1) as pool:  # a fresh process: the card is empty when it starts and when it ends
            return pool.apply(_child, (type(self.w), self.w.c, str(self.device), self.w.args.optim, self.kind,
                                       self.name, self.spec, fn, kw))

    def peak(self) -> dict:
        return self.in_child(_peak)

    def time(self, warmup: int, steps: int) -> list[float]:
        self.times = self.in_child(_time, warmup=warmup, steps=steps)
        return self.times


def _context(*uses):
    """Children forked from a server process that imported torch, this module and the modules of ``uses`` (the
    measurement, the workload class) once and never touched the GPU, instead of each spawned child importing them
    again (seconds each). The server starts with the first call; what it preloaded then stays."""
    ctx = mp.get_context("forkserver")
    # the engine a Visit builds from and the compiler module an optimizer's first construction imports: no threads
    ctx.set_forkserver_preload([__name__, *{u.__module__ for u in uses}, "bcdflow.tasks.engine", "torch._dynamo"])
    return ctx


def time_each(items, warmup: int, steps: int) -> dict:
    """``round_robin``'s answer for remote configurations: each timed in its own process, one after the other."""
    for it in items:
        it.time(warmup, steps)
    spreads = [sorted(it.times)[1] / min(it.times) - 1 if len(it.times) > 1 else 0.0 for it in items]
    return {"rounds": steps, "spread": max(spreads),
            "median_over_fastest": max(statistics.median(it.times) / min(it.times) for it in items),
            "isolated": True}


def _child(workload: type, c: dict, device: str, optim: str, kind: str, name: str, spec: dict, fn, kw: dict):
    """In the child process: build the one configuration with random weights on the device and measure it.
    ``workload`` is the parent's workload class (``common.Workload``)."""
    dev = torch.device(device)
    torch.cuda.set_device(dev) if dev.type == "cuda" else None
    w = workload(c, dev, optim=optim, random_weights=True)
    if kind == "prefix":
        v = w.prefix(spec["lo"])
    elif kind == "full":
        v = w.full()
    else:
        v = w.visit(name, w.plan(spec["blocks"]).visits[spec["block"]], preinfer=spec["preinfer"],
                    recompute=spec.get("recompute", False), stream=spec.get("stream", False),
                    expand=spec.get("expand", 0))
    return fn(w, v, **kw)


def _peak(w, v) -> dict:
    v.step(timed=False)
    return v.peak()


def _time(w, v, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        v.step(timed=False)
    for _ in range(steps):
        v.step(timed=True)
    return v.times
