"""What every benchmark shares: a CPU tensor-memory tracker, one training step as the product runs it,
a visit configuration (part of the model + optimizer + batch), analytic FLOPs, round-robin timing and the
machine description.

A step is ``models.trainer.run_steps`` for one step (zero_grad, the visit's loss as ``tasks.engine.run_visit``
takes it, backward, clip, optimizer step), with the model prepared by the engine's ``prepare_model``, so a
benchmark times the product's visit, not a copy of it.
"""
from __future__ import annotations

import gc
import itertools
import os
import platform
import statistics
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.isolate import Remote, time_each
from bcdflow.core.config import RunConfig
from bcdflow.core.context import block_plan, model_config
from bcdflow.models import build_model, get_config
from bcdflow.models import flops
from bcdflow.models.build import frozen_in, param_sizes
from bcdflow.models.expand import SuffixAdapters
from bcdflow.models.gpt import GPT
from bcdflow.models.llama import LLaMA
from bcdflow.models.stream import LayerStream
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.models.visit_compute import autocast

MB = 2**20


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created while active (CPU has no allocator stats to read).

    Every op's outputs are checked: a storage that is not one of the op's inputs (in-place ops, views) and
    not already counted is new; a weakref finalizer takes it off when the storage is freed. Allocations
    inside a kernel that never surface as a tensor (workspaces) are not seen. Cross-checked against the
    RSS high-water mark under MALLOC_MMAP_THRESHOLD_=65536: a gpt2-124m step agrees within 0.1%.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n and key not in inputs and key not in self.sizes:
                self.sizes[key] = n
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)


def tensor_bytes(*trees) -> int:
    """Bytes of the distinct storages among the tensors in ``trees`` (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tree_flatten(trees)[0]:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def one_step(loss_fn, params, batch, opt, spec, extra=None) -> None:
    run_steps(loss_fn, params, itertools.repeat(batch), opt, spec, StopRule(max_steps=1), extra=extra)


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def step_flops(model, trainable: set[str], cfg, seq_len: int, grad_from: int | None = None,
               lo: int = 0) -> int:
    """FLOPs per token of one training step of ``model``'s layers >= ``lo`` (``models/flops.step``: layers below
    ``grad_from`` forward only), attention counted whole (PaLM's MFU convention); ``model`` may be the whole model on
    the meta device."""
    return flops.step(_shapes(model), cfg, seq_len, trainable, grad_from, lo, causal=False)


def forward_flops(model, cfg, seq_len: int, lo: int, hi: int, head: bool = False) -> int:
    """FLOPs per token of a forward pass over layers [lo, hi) (pre-inference, evaluation with ``head``;
    ``models/flops.forward``), attention counted whole."""
    return flops.forward(_shapes(model), cfg, seq_len, lo, hi, head, causal=False)


def meta_model(cfg):
    """The whole model on the meta device: shapes and names, no memory (for analytic counts)."""
    with torch.device("meta"):
        return {"gpt": GPT, "llama": LLaMA}[cfg.family](cfg)


class Visit:
    """One configuration: its part of the model (from the master weights), optimizer, batch and step.

    ``layers`` is the part held; ``start`` the first layer on the gradient path (default ``layers[0]``).
    ``start > layers[0]`` is a visit with pre-inference off: layers [layers[0], start) run every step
    under no_grad, as ``tasks/train.py`` runs the frozen prefix then. ``hi`` ends the active block (its frozen
    suffix is recomputed in backward with ``recompute``). ``args`` needs ``optim`` and ``precision``; with bf16
    the frozen weight matrices are stored in bf16 as the product stores them (``args.frozen_fp32`` keeps the old
    fp32 storage for a side-by-side). The loss is the product's: ``models.visit_compute.visit_loss``. ``stream``: the frozen
    layers held stream from host memory as ``train.offload=stream`` streams them (models/stream.py). ``expand``:
    ``bcd.expand=lora`` adapters of that rank on the layers after ``hi`` (models/expand.py), trained beside the block.
    ``sign``: ``bcd.expand=sign``, every weight after the block stepped by sign descent in its hook (models/suffix.py).
    """

    def __init__(self, name, cfg, master, device, args, layers, embed, trainable, batch, start=None, hi=None,
                 recompute=False, stream=False, expand=0, rows=None, sign=False):
        self.name, self.layers, self.embed, self.device, self.batch = name, layers, embed, device, batch
        self.start = layers[0] if start is None else start
        self.hi, self.recompute = hi, recompute
        if rows:  # a row block (bcd.vocab_blocks): the matrix frozen, its rows a slice, as the engine holds it
            trainable = set()
        low = torch.bfloat16 if args.precision == "bf16" and not getattr(args, "frozen_fp32", False) else None
        fp32 = trainable if OPTIMIZERS[args.optim].master == 4 else ()  # bf16 master weights: adamw8bit-bf16
        if master is None:  # random weights, made on the device (an isolated configuration: benchmarks/isolate.py)
            model = build_model(cfg, layers=layers, embed=embed, head=True, device=device)
            if low is not None:
                frozen_in(model, low, fp32)
        else:
            model = build_model(cfg, layers=layers, embed=embed, head=True, device=device, init=False,
                                frozen_dtype=low, trainable=fp32)
            model.load_state_dict({k: master[k] for k in model.state_dict()}, strict=True)
        # the product's preparation and loss (tasks/engine.py): gradients, chunking, compile, autocast, streaming.
        # Imported here: the engine imports Prefect (tasks/data.py), which the command line configures after
        # importing this module (cli.setup_env)
        from bcdflow.core.rules import VisitSpec
        from bcdflow.tasks.engine import VisitLayout, prepare_model, visit_step_loss

        named = prepare_model(model, trainable, getattr(args, "chunk_rows", None), getattr(args, "compile", False))
        if rows:
            from bcdflow.models.rows import attach_rows
            master = torch.bfloat16 if OPTIMIZERS[args.optim].master == 2 else torch.float32  # as the engine's
            named = [(rows[0], attach_rows(model, *rows, master))]
        frozen = [i for i in range(*layers) if not any(n.startswith(f"h.{i}.") for n in trainable)]
        self.stream = (LayerStream(model, frozen, device, getattr(args, "stream_window", 2), grad_from=self.start)
                       if stream else None)
        model.stream = self.stream
        self.model = model
        self.trainable = set(trainable)
        self.params = [p for _, p in named]
        self.spec = OptimSpec(args.optim)
        self.opt = make_optimizer(self.params, self.spec)
        self.adapters = None
        if expand and hi is not None and hi < layers[1]:  # the engine's adapters and optimizer group
            self.adapters = SuffixAdapters(model, range(hi, layers[1]), expand, 0, device).attach(model)
            self.opt.add_param_group({"params": [p for _, p in self.adapters.named()], "weight_decay": 0.0})
        self.suffix = None
        if sign and hi is not None and hi < layers[1]:  # the engine's sign rule on the suffix (tasks/expand.py)
            from bcdflow.models.memory import layer_of
            from bcdflow.models.suffix import SignSuffix

            moving = [n for n, _ in model.named_parameters() if n not in trainable and (
                (layer_of(n) or -1) >= hi or n.startswith(("ln_f.", "lm_head.")))]
            self.suffix = SignSuffix(model, moving, lambda: 1e-3, 0).attach()
        self.vs = VisitLayout(run_id="benchmark", spec=VisitSpec(0, 0, 0), lo=self.start, hi=hi, n_layer=layers[1],
                              from_acts=not embed, active=frozenset(trainable), recompute=recompute,
                              recompute_active=False, streamed=tuple(frozen) if stream else (), exact=False)
        self.loss_fn = visit_step_loss(model, self.vs, device, args.precision)
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        one_step(self.loss_fn, self.params, self.batch, self.opt, self.spec,
                 extra=None if self.adapters is None else list(self.adapters.parameters()))
        sync()
        if timed:
            self.times.append(time.perf_counter() - t0)

    def peak(self) -> dict:
        """Peak tensor bytes of one step: the state alive before it (grads are set to None first, as
        run_steps does) plus the most the step itself holds on top of that at any moment."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        slots = self.stream.slots if self.stream else []  # streamed weights: the stream's slots, made before the step
        adapters = [] if self.adapters is None else list(self.adapters.parameters())
        state = {"weights": tensor_bytes(list(self.model.parameters()), list(self.model.buffers()), slots, adapters),
                 "grads": sum(p.numel() * p.element_size() for p in self.params),
                 "optim": tensor_bytes(self.opt.state), "input": tensor_bytes(self.batch)}
        base = state["weights"] + state["optim"] + state["input"]
        if self.device.type == "cuda":  # the other configurations' tensors stay put during the step
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step(timed=False)
            peak = base + torch.cuda.max_memory_allocated(self.device) - before
        else:
            with LiveBytes() as tracker:
                self.step(timed=False)
            peak = base + tracker.peak
        return {"peak_bytes": peak, "bytes": {**state, "rest": peak - sum(state.values())}}

    def saved_bytes(self) -> int:
        """Bytes of the activations autograd saves for backward in one forward (parameters and the
        batch not counted; views of one storage counted once)."""
        skip = {t.untyped_storage().data_ptr() for t in [*self.model.parameters(), *tree_flatten(self.batch)[0]]
                if isinstance(t, torch.Tensor)}
        seen: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in skip and st.device.type != "meta":
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss_fn(self.batch)
        del loss
        return sum(seen.values())

class Timed:
    """Anything timed in a round-robin: ``fn()`` runs once; ``times`` holds the timed seconds."""

    def __init__(self, name: str, fn, device: torch.device, **info):
        self.name, self.fn, self.device, self.info, self.times = name, fn, device, info, []

    def step(self, timed: bool) -> None:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.fn()
        sync()
        if timed:
            self.times.append(time.perf_counter() - t0)

    @property
    def best_s(self) -> float:
        return best(self.times)


def best(times: list[float]) -> float:
    """The figure of a timed configuration: its fastest timed step. Interference on a shared machine
    (other processes, a stalled OpenMP thread) only ever adds time, so the fastest of a few round-robin
    steps is the steadiest estimate of what the step costs; the medians go to the JSON as well."""
    return min(times)


def round_robin(items, warmup: int, steps: int, max_steps: int | None = None, budget_s: float = 0.0,
                tol: float = 0.1) -> dict:
    """Time every item ``steps`` times after ``warmup``, taking turns step by step: a slow spell on a
    shared machine hits every configuration alike, not one of them.

    Then, up to ``max_steps`` rounds and ``budget_s`` seconds, keep taking turns while some item's two
    fastest steps still differ by more than ``tol``: on a busy machine a configuration whose every step
    was disturbed gets more chances to show what it costs. Returns how many rounds ran and the worst
    remaining spread (fastest two) and median/fastest ratio, which the reports print as timing quality."""
    remote = [it for it in items if isinstance(it, Remote)]
    if remote:  # CUDA: configurations in their own processes, one after the other; local probes take turns
        local = [it for it in items if not isinstance(it, Remote)]
        res = time_each(remote, warmup, max(steps, 3))
        if local:
            round_robin(local, warmup, steps, max_steps, budget_s, tol)
        return res
    for _ in range(warmup):
        for it in items:
            it.step(timed=False)
    t0, rounds = time.perf_counter(), 0
    while True:
        for it in items:
            it.step(timed=True)
        rounds += 1
        if rounds < steps:
            continue
        spread = max(_spread(it.times) for it in items)
        if spread <= tol or rounds >= (max_steps or steps) or time.perf_counter() - t0 >= budget_s:
            break
    return {"rounds": rounds, "spread": max(_spread(it.times) for it in items),
            "median_over_fastest": max(statistics.median(it.times) / min(it.times) for it in items)}


def _spread(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    a, b = sorted(times)[:2]
    return b / a - 1


def prefix_batch(cfg, master, device, precision, x, lo):
    """Paper §3.2.2 pre-inference: the frozen prefix [0, lo) runs once, off the clock.

    no_grad, not inference_mode: the visit saves this tensor for backward (as it does what it reads)."""
    prefix = build_model(cfg, layers=(0, lo), head=False, device=device, init=False)
    prefix.load_state_dict({k: master[k] for k in prefix.state_dict()}, strict=True)
    with torch.no_grad(), autocast(device, precision):
        return prefix.run_layers(prefix.embed(x), 0, lo).float()  # (B, T, C)


def machine(device: torch.device) -> dict:
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
            "cpu_count": os.cpu_count(), "load_avg_1m": load}


def ns(**kw) -> SimpleNamespace:
    """The ``args`` a Visit reads (``optim``, ``precision``)."""
    return SimpleNamespace(**kw)


class Workload:
    """One model, one set of master weights and one batch, from which every configuration is built.

    Block plans come from the product (``RunConfig.plan``: the split ``bcd.split`` picks, by
    parameter count by default), so the benchmark measures the blocks a run would train.

    On CUDA (``isolated``) ``full``/``visit``/``prefix`` return ``benchmarks.isolate.Remote`` configurations, each
    measured in its own process; there (``random_weights``) parts are initialised on the device, with no master copy."""

    def __init__(self, c: dict, device: torch.device, optim: str = "adamw", seed: int = 0,
                 random_weights: bool = False):
        self.c, self.device, self.seed = c, device, seed
        self.cfg = get_config(c["model"], **c["overrides"])
        sizes = param_sizes(self.cfg)  # from a meta-device model
        self.names, self.n_params = list(sizes), sum(sizes.values())
        self.random_weights = random_weights
        # BCDFLOW_BENCH_ISOLATE=1: the CUDA way on any device (the tests run it on the CPU)
        self.isolated = (device.type == "cuda" or os.environ.get("BCDFLOW_BENCH_ISOLATE") == "1") and not random_weights
        self._master: dict | None = None
        B, T = c["batch_size"], c["seq_len"]
        g = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(self.cfg.vocab_size, (B, T + 1), generator=g).to(device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]  # (B, T)
        self.args = ns(optim=optim, precision=c["precision"], chunk_rows=c.get("chunk_rows"),
                       compile=c.get("compile", False))
        self._prefix: dict[int, torch.Tensor] = {}

    @property
    def master(self) -> dict | None:
        """The whole model's weights, on the CPU (made on first use); None with ``random_weights``."""
        if self._master is None and not self.random_weights:
            torch.manual_seed(self.seed)
            self._master = build_model(self.cfg).state_dict()  # each configuration copies its part
        return self._master

    @property
    def tokens(self) -> int:
        return self.x.numel()

    def plan(self, blocks: int, vocab_blocks: int = 1):
        over = {k: v for k, v in self.c["overrides"].items() if k != "vocab_size"}
        run = RunConfig(model={"name": self.c["model"], **over},
                        data={"vocab_size": max(self.cfg.vocab_size, 260), "seq_len": self.c["seq_len"]},
                        bcd={"blocks": blocks, "vocab_blocks": vocab_blocks})
        return block_plan(run, model_config(run, self.cfg.vocab_size))

    def full(self) -> Visit:
        if self.isolated:
            return Remote(self, "full", "full")
        return Visit("full", self.cfg, self.master, self.device, self.args, (0, self.cfg.n_layer), True,
                     set(self.names), (self.x, self.y))

    def hidden(self, lo: int) -> torch.Tensor:
        if lo not in self._prefix:
            if self.random_weights:  # what the prefix computes does not change a step's memory or time
                self._prefix[lo] = torch.randn(*self.x.shape, self.cfg.d_model, device=self.device)
            else:
                self._prefix[lo] = prefix_batch(self.cfg, self.master, self.device, self.args.precision, self.x, lo)
        return self._prefix[lo]

    def visit(self, name: str, blk, preinfer: bool = True, recompute: bool = False, stream: bool = False,
              expand: int = 0, sign: bool = False) -> Visit:
        """Block ``blk``'s visit as tasks/train.py runs it: with pre-inference, layers >= lo fed the prefix's
        hidden states; without, the whole model with the prefix under no_grad every step. ``expand``: the rank of
        ``bcd.expand=lora`` adapters on the layers after it; ``sign``: ``bcd.expand=sign`` on them."""
        (lo, hi), n = blk.layers, self.cfg.n_layer
        rows = (blk.params[0], *blk.rows) if blk.rows is not None else None
        if self.isolated:
            blocks = len(self.plan_of(blk).blocks)  # bcd.blocks: the stored blocks
            return Remote(self, name, "visit", blocks=blocks, block=blk.index, preinfer=preinfer,
                          recompute=recompute, stream=stream, expand=expand)
        if blk.reads_activations(preinfer):
            return Visit(name, self.cfg, self.master, self.device, self.args, (lo, n), False, set(blk.params),
                         (self.hidden(lo), self.y), hi=hi, recompute=recompute, stream=stream, expand=expand,
                         rows=rows, sign=sign)
        return Visit(name, self.cfg, self.master, self.device, self.args, (0, n), True, set(blk.params),
                     (self.x, self.y), start=lo, hi=hi, recompute=recompute, stream=stream, expand=expand, rows=rows,
                     sign=sign)

    def prefix(self, lo: int) -> Timed:
        """The pre-inference forward of the frozen prefix, layers [0, lo), over one batch (``tasks/preinfer.py``)."""
        if self.isolated:  # CUDA: timed in a process of its own (benchmarks/isolate.py)
            meta = build_model(self.cfg, layers=(0, lo), head=False, device="meta", init=False)
            return Remote(self, f"pre-infer layers 0-{lo}", "prefix", lo=lo,
                          info={"lo": lo, "flops_per_token": forward_flops(meta, self.cfg, self.x.size(1), 0, lo)})
        if self.random_weights:
            prefix = build_model(self.cfg, layers=(0, lo), head=False, device=self.device)
        else:
            prefix = build_model(self.cfg, layers=(0, lo), head=False, device=self.device, init=False)
            prefix.load_state_dict({k: self.master[k] for k in prefix.state_dict()}, strict=True)
        prefix.eval().requires_grad_(False)
        if self.args.precision == "bf16":
            frozen_in(prefix, torch.bfloat16)  # as the product's pre-inference holds it

        def fn():  # tasks/preinfer.py::preinfer_shard, one batch
            with torch.inference_mode(), autocast(self.device, self.args.precision):
                return prefix.run_layers(prefix.embed(self.x), 0, lo).float().cpu()

        return Timed(f"pre-infer layers 0-{lo}", fn, self.device, lo=lo,
                     flops_per_token=forward_flops(prefix, self.cfg, self.x.size(1), 0, lo))

    def plan_of(self, blk):
        """The plan ``blk`` comes from (the block count whose plan holds this very block)."""
        for m in range(1, self.cfg.n_layer + 1):
            plan = self.plan(m)
            if blk.index < len(plan.visits) and plan.visits[blk.index] == blk:
                return plan
        raise ValueError(f"block {blk} is in no plan of {self.cfg.n_layer} layers")
