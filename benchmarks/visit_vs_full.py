"""Visit vs full step: per-iteration time and peak memory of one training step in each block's visit
(pre-inference on, paper §3.2.2) against a full-parameter step, side by side in one run.

For one model and one batch, at ``--blocks`` blocks (default 3):

* ``full``: the whole model, every parameter trainable, one optimizer over all of them;
* ``block 0``: embeddings + all layers + head, only block 0 trainable (as ``tasks/train.py`` visits it);
* ``block b > 0``: layers of blocks >= b + head only, fed the (B, T, C) hidden states of the frozen prefix,
  which are computed once up front, off the clock (the pre-inference stage does that in a run).

Every configuration takes the same step: ``models.trainer.run_steps`` for one step (zero_grad, forward+loss
as in ``train_visit``, backward, clip, optimizer step). Time = median over ``--steps`` steps after
``--warmup``, the configurations taking turns step by step (so a busy spell on a shared machine hits them
alike). Peak memory of a step = the state alive before it (weights, optimizer state, batch; grads are None
at a step's start) plus the most tensor bytes the step holds on top of that: on CUDA read from
``max_memory_allocated`` minus what was allocated before the step (the other configurations' tensors sit
still meanwhile, so they cancel); on CPU, which has no allocator statistics, a dispatch-mode tracker that
counts every storage an op creates until it is freed, checked against an analytic case before the run.
All configurations are held at once: about 2.5x the full step's state.

Targets (issue): mean block step time <= 0.55 x full; worst block's peak memory <= 0.5 x full.
A miss prints MISS; the exit status stays 0 (CONVENTIONS 10).

    python benchmarks/visit_vs_full.py                      # CPU: a few minutes or less on 2 cores
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
# per device: batch, seq_len, precision, steps, warmup
DEFAULTS = {"cpu": (2, 128, "fp32", 5, 2), "cuda": (8, 1024, "bf16", 20, 5)}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created while active (CPU has no allocator stats to read).

    Every op's outputs are checked: a storage that is not one of the op's inputs (in-place ops, views) and
    not already counted is new; a weakref finalizer takes it off when the storage is freed. Allocations
    inside a kernel that never surface as a tensor (workspaces) are not seen.
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


def one_step(loss_fn, params, batch, opt, spec):
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
    print(f"tracker check (Linear 512x512, AdamW): peak {measured / MB:.3f} MB, analytic 5W + input "
          f"{expected / MB:.3f} MB -> {'ok' if ok else 'MISMATCH'}")
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
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="registry name (models/config.py)")
    ap.add_argument("--n-layer", type=int, help="override the model's layer count")
    ap.add_argument("--d-model", type=int, help="override the model's width")
    ap.add_argument("--n-head", type=int, help="override the model's head count")
    ap.add_argument("--vocab-size", type=int, help="override the model's vocabulary")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--blocks", type=int, default=3, help="bcd.blocks")
    ap.add_argument("--steps", type=int, help="timed steps per configuration, after warmup")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--precision", choices=("fp32", "bf16"))
    ap.add_argument("--optim", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/out/visit_vs_full.json")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    for key, value in zip(("batch_size", "seq_len", "precision", "steps", "warmup"), DEFAULTS[device.type]):
        if getattr(args, key) is None:
            setattr(args, key, value)

    cfg = get_config(args.model, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                     vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    whole = build_model(cfg)
    master = whole.state_dict()  # one set of weights for every configuration, kept on the CPU
    names = [n for n, _ in whole.named_parameters()]
    plan = make_plan(names, cfg.n_layer, args.blocks)
    del whole
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

    full, blocks = rows[0], rows[1:]
    mean_ms = statistics.fmean(r["step_ms_median"] for r in blocks)
    worst = max(r["peak_bytes"] for r in blocks)
    summary = {
        "mean_block_step_ms": mean_ms, "full_step_ms": full["step_ms_median"],
        "mean_step_ratio": mean_ms / full["step_ms_median"], "step_target": 0.55,
        "worst_block_peak_bytes": worst, "full_peak_bytes": full["peak_bytes"],
        "worst_peak_ratio": worst / full["peak_bytes"], "peak_target": 0.5,
        "mean_flops_ratio": statistics.fmean(r["matmul_flops_per_token"] for r in blocks)
        / full["matmul_flops_per_token"],
    }
    summary["step_pass"] = summary["mean_step_ratio"] <= summary["step_target"]
    summary["peak_pass"] = summary["worst_peak_ratio"] <= summary["peak_target"]

    head = (f"{'config':<12}{'layers':>8}{'trainable':>12}{'step ms':>10}{'mean ms':>10}{'x full':>8}"
            f"{'flops x':>9}{'peak MB':>10}{'x full':>8}   weights/grads/optim/input/rest MB")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        parts = "/".join(f"{v / MB:.0f}" for v in r["bytes"].values())
        print(f"{r['name']:<12}{'%d-%d' % tuple(r['layers']):>8}{r['trainable_params'] / 1e6:>11.2f}M"
              f"{r['step_ms_median']:>10.1f}{r['step_ms_mean']:>10.1f}"
              f"{r['step_ms_median'] / full['step_ms_median']:>8.2f}"
              f"{r['matmul_flops_per_token'] / full['matmul_flops_per_token']:>9.2f}"
              f"{r['peak_bytes'] / MB:>10.1f}{r['peak_bytes'] / full['peak_bytes']:>8.2f}   {parts}")
    mean_peak = statistics.fmean(r["peak_bytes"] for r in blocks)
    print(f"{'blocks mean':<12}{'':>8}{'':>12}{mean_ms:>10.1f}{'':>10}{summary['mean_step_ratio']:>8.2f}"
          f"{summary['mean_flops_ratio']:>9.2f}{mean_peak / MB:>10.1f}{mean_peak / full['peak_bytes']:>8.2f}")
    print(f"mean block step / full step = {summary['mean_step_ratio']:.2f} (target <= 0.55): "
          f"{'PASS' if summary['step_pass'] else 'MISS'}")
    print(f"worst block peak / full peak = {summary['worst_peak_ratio']:.2f} (target <= 0.50): "
          f"{'PASS' if summary['peak_pass'] else 'MISS'}")

    result = {"machine": info, "args": vars(args), "model": cfg.to_dict(), "plan": plan.to_dict(),
              "tracker_check": check, "configs": rows, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
