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
import gc
import itertools
import json
import platform
import statistics
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models import build_model, get_config, make_plan
from models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from tasks.weights import autocast, resolve_device

MB = 2**20
# Defaults for arguments not given. CPU: one thread (two stall whenever the box is busy, skewing the ratios)
# and, without --model, gpt2-124m at half width and vocabulary: the same 12 layers (4-layer blocks) and the
# same layers : tied-head ratio (144 d^2 : V d = 2.2 : 1), at a quarter of the FLOPs (about a minute).
DEFAULTS = {"cpu": dict(batch_size=2, seq_len=128, precision="fp32", steps=5, warmup=2, threads=1),
            "cuda": dict(batch_size=8, seq_len=1024, precision="bf16", steps=20, warmup=5)}
CPU_MODEL = dict(model="gpt2-124m", d_model=384, n_head=6, vocab_size=25152)


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


def one_step(loss_fn, params, batch, opt, spec) -> None:
    run_steps(loss_fn, params, itertools.repeat(batch), opt, spec, StopRule(max_steps=1))


def check_tracker() -> dict:
    """Analytic case: an nn.Linear AdamW step (foreach) after a first step, so the moments exist.

    Alive at the optimizer step: weights W, two moments 2W, grads W and the one W-sized temporary of
    foreach AdamW (sqrt of the second moment); activations (B x out) are gone by then. Peak = 5W + input.
    """
    lin = torch.nn.Linear(512, 512)
    x, W = torch.randn(4, 512), tensor_bytes(list(lin.parameters()))
    params, spec = list(lin.parameters()), OptimSpec("adamw", grad_clip=1.0)
    opt = make_optimizer(params, spec)
    loss_fn = lambda b: lin(b).square().mean()  # noqa: E731
    one_step(loss_fn, params, x, opt, spec)
    opt.zero_grad(set_to_none=True)
    base = tensor_bytes(params, opt.state, x)
    with LiveBytes() as tr:
        one_step(loss_fn, params, x, opt, spec)
    measured, expected = base + tr.peak, 5 * W + x.nbytes
    ok = abs(measured - expected) <= 0.01 * expected
    print(f"tracker check, Linear AdamW step: {measured / MB:.3f} MB, analytic 5W + input {expected / MB:.3f} MB"
          f" -> {'ok' if ok else 'MISMATCH'}")
    return {"measured_bytes": measured, "expected_bytes": expected, "ok": ok}


def matmul_flops(model, trainable: set[str], cfg) -> int:
    """Matmul FLOPs per token of a step: forward 2P and input-grad 2P over every weight the step runs,
    weight-grad 2P over the trainable ones (attention scores, norms and the optimizer not counted)."""
    run = sum(p.numel() for n, p in model.named_parameters() if n.startswith("h.") and p.dim() == 2)
    train = sum(p.numel() for n, p in model.named_parameters()
                if n.startswith("h.") and p.dim() == 2 and n in trainable)
    head = cfg.vocab_size * cfg.d_model
    head_trainable = ("wte.weight" if cfg.tied else "lm_head.weight") in trainable
    return 4 * (run + head) + 2 * (train + (head if head_trainable else 0))


class Visit:
    """One configuration: its part of the model (from the master weights), optimizer, batch and step."""

    def __init__(self, name, cfg, master, device, args, layers, embed, trainable, batch):
        self.name, self.layers, self.embed, self.device, self.batch = name, layers, embed, device, batch
        model = build_model(cfg, layers=layers, embed=embed, head=True, device=device, init=False)
        model.load_state_dict({k: master[k] for k in model.state_dict()}, strict=True)
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
        self.model = model.train()
        self.params = [p for n, p in model.named_parameters() if n in trainable]
        self.spec = OptimSpec(args.optim)
        self.opt = make_optimizer(self.params, self.spec)
        self.flops = matmul_flops(model, trainable, cfg)
        lo, precision = layers[0], args.precision

        def loss_fn(b):  # the loss path of tasks/train.py::train_visit
            x, y = b
            with autocast(device, precision):
                h = model.embed(x) if embed else x  # (B, T, C)
                return model.loss(model.run_layers(h, lo, cfg.n_layer), y)

        self.loss_fn = loss_fn
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        one_step(self.loss_fn, self.params, self.batch, self.opt, self.spec)
        sync()
        if timed:
            self.times.append(time.perf_counter() - t0)

    def peak(self) -> dict:
        """Peak tensor bytes of one step: the state alive before it (grads are set to None first, as
        run_steps does) plus the most the step itself holds on top of that at any moment."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        state = {"weights": tensor_bytes(list(self.model.parameters()), list(self.model.buffers())),
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

    def report(self) -> dict:
        ms = [1e3 * t for t in self.times]
        return {"name": self.name, "layers": list(self.layers), "embed": self.embed,
                "trainable_params": sum(p.numel() for p in self.params),
                "step_ms_median": statistics.median(ms), "step_ms_mean": statistics.fmean(ms), "step_ms_all": ms,
                **self.peak(), "matmul_flops_per_token": self.flops}


def machine(device: torch.device) -> dict:
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device)}


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
    names = [n for n, _ in whole.named_parameters()]
    plan = make_plan(names, cfg.n_layer, args.blocks)
    B, T = args.batch_size, args.seq_len
    tokens = torch.randint(cfg.vocab_size, (B, T + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T)
    info = machine(device)
    print(f"{args.model} ({cfg.n_layer} layers, d={cfg.d_model}, vocab={cfg.vocab_size}), batch {B}x{T}, "
          f"{args.precision}, {args.optim}, {args.blocks} blocks {[list(b.layers) for b in plan.blocks]}, "
          f"{info['device']} ({info['gpu'] or info['cpu']}, {info['threads']} threads)")
    check = check_tracker() if device.type == "cpu" else None

    visits = [Visit("full", cfg, master, device, args, (0, cfg.n_layer), True, set(names), (x, y))]
    for blk in plan.blocks:
        lo = blk.layers[0]
        if lo == 0:
            batch = (x, y)
        else:  # paper §3.2.2 pre-inference: the frozen prefix runs once, before the visit, off the clock
            prefix = build_model(cfg, layers=(0, lo), head=False, device=device, init=False)
            prefix.load_state_dict({k: master[k] for k in prefix.state_dict()}, strict=True)
            # no_grad, not inference_mode: the visit saves this tensor for backward (as it does what it reads)
            with torch.no_grad(), autocast(device, args.precision):
                batch = (prefix.run_layers(prefix.embed(x), 0, lo).float(), y)  # (B, T, C), (B, T)
            del prefix
        visits.append(Visit(f"block {blk.index}", cfg, master, device, args, (lo, cfg.n_layer), lo == 0,
                            set(blk.params), batch))
    # round-robin: a slow spell on a shared machine hits every configuration alike, not one of them
    for i in range(args.warmup + args.steps):
        for v in visits:
            v.step(timed=i >= args.warmup)
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
