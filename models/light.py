"""A lighter state for the active block (issue 33, item 3): AdamW with 8-bit moments, and bf16 master weights with
stochastic rounding, so a larger block fits the same memory (models/optimizers.py's ``adamw8bit`` and
``adamw8bit-bf16``; the planner counts their bytes, models/memory.py).

    adamw8bit       bitsandbytes' AdamW8bit (0.50.2): both moments blockwise-quantized to 8 bits (one fp32 scale
                    per 256 elements; tensors under 4096 elements keep fp32 moments), fp32 master weights and
                    gradients: 10 bytes a trained parameter where fp32 AdamW takes 16
    adamw8bit-bf16  the same moments, and the block's weight matrices trained in bf16 (their gradients too): each
                    update computed in fp32 and rounded stochastically to bf16 (an update smaller than half a bf16
                    step still moves the weight in expectation; rounding to nearest would drop it): 6 bytes

bitsandbytes runs on the CPU and on CUDA (its CPU kernel dequantizes in torch ops, its CUDA kernel is fused). Its
update is applied here a chunk of :data:`CHUNK` elements at a time (a multiple of its 256-element blocks), so the
fp32 copies a bf16 weight's update needs, and the CPU kernel's temporaries, are a chunk's, never a 128k-row
embedding's; and without bitsandbytes' device synchronization after every parameter. The rounding's noise comes
from a generator seeded by (the run's seed, the step, the parameter's index, the chunk), so a loop resumed from a
checkpoint (whose state carries the step) draws what an uninterrupted one drew: bitwise the same.

The package is the ``light`` extra (a run checks it: models/optimizers.Optimizer.check); the state is plain tensors
(uint8 moments, fp32 scales), which mid-visit checkpoints and ``bcd.moments=keep`` store as they store AdamW's.
"""
from __future__ import annotations

import torch

from bcdflow.models.optimizers import LIGHT_CHUNK as CHUNK, QBLOCK



def seeded(generators: dict[torch.device, torch.Generator], device: torch.device, key: tuple) -> torch.Generator:
    """A generator on ``device`` (one kept per device in ``generators``) seeded from ``key``, a tuple of ints: the
    same draws in every process and every attempt, so a resumed loop rounds as an uninterrupted one did."""
    g = generators.get(device)
    if g is None:
        g = generators[device] = torch.Generator(device=device)
    g.manual_seed(hash(key) & ((1 << 63) - 1))  # ints only: hash is not salted for them
    return g


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: up with probability equal to the distance from the value below
    (in units of a bf16 step), so the rounding is exact in expectation. Adds 16 random low bits to the fp32 pattern
    and clears them (sign-magnitude: the same for negative values; infinities stay, a value past the largest bf16
    becomes infinite). One int32 temporary and the bf16 result."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    noise.add_(x.view(torch.int32)).bitwise_and_(-65536)
    return noise.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def _optimizer_class():
    import bitsandbytes as bnb  # imported when a light optimizer is built
    from bitsandbytes import functional as F

    class AdamW8bit(bnb.optim.AdamW8bit):
        """bitsandbytes' AdamW8bit, updated a chunk at a time, bf16 parameters rounded stochastically."""

        def __init__(self, params, *, seed: int = 0, **kw):
            super().__init__(params, **kw)
            self.seed = seed
            self._gen: dict[torch.device, torch.Generator] = {}

        @torch.no_grad()
        def step(self, closure=None):  # bitsandbytes' step without its device sync after every parameter
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self.initialized:
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if len(self.state[p]) == 0:
                        self.init_state(group, p, gindex, pindex)
                    self.update_step(group, p, gindex, pindex)
            return loss

        def state_dict(self):  # torch's form: one flat dict of tensors per parameter (bitsandbytes nests its
            return torch.optim.Optimizer.state_dict(self)  # quantization state, which bcd.moments=keep cannot store)

        def load_state_dict(self, state_dict, move_to_device=True):
            # bitsandbytes casts every floating tensor it does not know to the parameter's dtype, the step count
            # included: under bf16 master weights a kept step of 1001 came back as 1000 (bf16 holds integers
            # exactly only to 256), shifting the bias correction and the rounding's seed. The step is an int here.
            steps = {i: int(s["step"]) for i, s in state_dict["state"].items() if "step" in s}
            super().load_state_dict(state_dict, move_to_device)
            params = [p for g in self.param_groups for p in g["params"]]
            for i, step in steps.items():
                if i < len(params) and params[i] in self.state:
                    self.state[params[i]]["step"] = step

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            state = self.state[p]
            config = self.get_config(gindex, pindex, group)
            state["step"] = int(state["step"]) + 1  # a loaded state_dict's step is a tensor
            step = state["step"]
            beta1, beta2 = config["betas"][0], config["betas"][1]
            flat_p = p.data.view(-1) if p.is_contiguous() else None
            if flat_p is None:
                p.data = p.data.contiguous()
                flat_p = p.data.view(-1)
            flat_g = p.grad.contiguous().view(-1)
            s1, s2 = state["state1"].view(-1), state["state2"].view(-1)
            eight = state["state1"].dtype == torch.uint8
            low = p.dtype == torch.bfloat16
            n = flat_p.numel()
            for c, a in enumerate(range(0, n, CHUNK)):
                b = min(n, a + CHUNK)
                w, g = flat_p[a:b], flat_g[a:b]
                if low:  # the update in fp32, rounded stochastically back
                    w, g = w.float(), g.float()
                if eight:
                    qa, qb = a // QBLOCK, -(-b // QBLOCK)
                    F.optimizer_update_8bit_blockwise(
                        self.optimizer_name, g, w, s1[a:b], s2[a:b], beta1, beta2, 0.0, 0.0, config["eps"], step,
                        config["lr"], state["qmap1"], state["qmap2"], state["absmax1"][qa:qb],
                        state["absmax2"][qa:qb], config["weight_decay"], gnorm_scale=1.0, skip_zeros=False)
                else:
                    F.optimizer_update_32bit(
                        self.optimizer_name, g, w, s1[a:b], beta1, config["eps"], step, config["lr"], s2[a:b], beta2,
                        0.0, 0.0, config["weight_decay"], 1.0, None, max_unorm=0.0, skip_zeros=False)
                if low:
                    del g
                    gen = seeded(self._gen, w.device, (self.seed, step, gindex, pindex, c))
                    flat_p[a:b].copy_(stochastic_round(w, gen))

    return AdamW8bit


_CLASS = None


def adamw8bit(params, spec) -> torch.optim.Optimizer:
    """AdamW with 8-bit moments over ``params`` (fp32 or bf16: a bf16 parameter's update is rounded stochastically);
    ``spec``: models/specs.OptimSpec."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _optimizer_class()
    return _CLASS(params, lr=spec.base_lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                  seed=spec.seed)

