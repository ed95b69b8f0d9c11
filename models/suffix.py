"""The frozen suffix kept moving, state-free (``bcd.expand=sign``; issue 41; FRUGAL, Zmushko et al. 2024): while a
visit trains its block with its optimizer, every weight after the block (its suffix) takes a sign-descent step,
``w -= lr * sign(g)``, on the gradient the visit's backward produces for it, applied in the weight's own gradient
hook the moment backward has it, so no gradient of the suffix is kept past its layer and no optimizer state exists.

    rule = SignSuffix(model, names, lr=lambda: opt.param_groups[0]["lr"] * ratio, seed=1234)
    rule.attach()        # suffix weights get gradients; each one's hook steps it and drops its gradient
    ... the block's training loop: each backward moves the suffix one step ...
    rule.tensors()       # {"suffix/h.5.attn.c_attn.weight": ..., "suffix/steps": ...} (a mid-visit checkpoint's)
    rule.detach()

The prefix (every layer before the block) is never touched, so the visit's stored activations stay exact; the suffix
weights are updated where the visit holds them: fp32 as they are, and under ``train.precision=bf16`` the matrices
held in bf16 (models/light.py's rule): each update computed in fp32 a chunk at a time and rounded stochastically back
(an update of a fraction of a bf16 step still moves the weight in expectation), the draws seeded by (the visit's seed,
the step, the parameter, the chunk), so a resumed visit draws what an uninterrupted one drew. What the gradient costs:
the weight-gradient matmul of every suffix linear (backward already computed the input gradients through it) and one
suffix weight's gradient at a time; sign descent is scale-free, so gradient clipping does not change it.

A weight written in place inside backward is sound because a weight's gradient is accumulated after the one node that
used it has run (each suffix weight is used once per forward; a weight used twice, a tied embedding, is the prefix's,
never the suffix's), and a recomputed layer's forward runs before its backward.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bcdflow.models.rounding import seeded, stochastic_round
from bcdflow.models.optimizers import LIGHT_CHUNK as CHUNK


class SignSuffix:
    """Sign descent (``rule="sign"``) or normalized SGD (``rule="normalized"``: the gradient scaled to an RMS of the
    rate, ``w -= lr * sqrt(n) * g / ||g||``, sign's step size in the gradient's direction) on the named parameters of
    ``model`` (the visit's suffix), each stepped in its gradient hook. ``lr()``: the rate of the step being taken
    (the block's schedule, read when backward reaches the weight)."""

    def __init__(self, model: nn.Module, names: list[str], lr: Callable[[], float], seed: int, rule: str = "sign"):
        if rule not in ("sign", "normalized"):
            raise ValueError(f"unknown suffix rule {rule!r}")
        params = dict(model.named_parameters())
        self.named_params = [(n, params[n]) for n in names]
        self.lr, self.seed, self.rule = lr, seed, rule
        self.steps = [0] * len(self.named_params)  # each weight's steps taken (its hook runs once a backward)
        self._hooks: list = []
        self._gen: dict[torch.device, torch.Generator] = {}
        self._index = {id(p): i for i, (_, p) in enumerate(self.named_params)}

    def attach(self) -> "SignSuffix":
        """Give the suffix weights gradients and hook each: its step, then its gradient dropped."""
        self.detach()
        for _, p in self.named_params:
            p.requires_grad_(True)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for _, p in self.named_params:
            p.grad = None
            p.requires_grad_(False)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self.steps[i] += 1
        g, p.grad = p.grad, None
        lr = float(self.lr())
        flat_p, flat_g = p.view(-1), g.reshape(-1)
        scale = None  # normalized: lr * sqrt(n) / ||g|| as a 0-d tensor (no host sync), the norm over the whole weight
        if self.rule == "normalized":  # the norm summed a chunk at a time: a bf16 gradient never copied whole to fp32
            sq = sum(torch.linalg.vector_norm(flat_g[a:a + CHUNK], dtype=torch.float32).square()
                     for a in range(0, flat_g.numel(), CHUNK))
            scale = (lr * flat_g.numel() ** 0.5) / sq.sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        for c, a in enumerate(range(0, flat_p.numel(), CHUNK)):  # a chunk's temporaries, never a head's
            b = min(flat_p.numel(), a + CHUNK)
            if scale is None:
                step = torch.sign(flat_g[a:b]).float() if p.dtype == torch.bfloat16 else torch.sign(flat_g[a:b])
                alpha = lr
            else:  # in place on an fp32 gradient's chunk: the gradient is dropped after this step
                step = flat_g[a:b].float().mul_(scale)
                alpha = 1.0
            if p.dtype != torch.bfloat16:
                flat_p[a:b].sub_(step.to(p.dtype), alpha=alpha)
                continue
            w = flat_p[a:b].float().sub_(step, alpha=alpha)
            del step
            gen = seeded(self._gen, w.device, (self.seed, self.steps[i], i, c))
            flat_p[a:b].copy_(stochastic_round(w, gen))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The suffix weights as they stand and their step counts (a mid-visit checkpoint's keys ``suffix/...``)."""
        out = {f"suffix/{n}": p.detach() for n, p in self.named_params}
        out["suffix/steps"] = torch.tensor(self.steps, dtype=torch.int64)
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the suffix weights and their step counts from ``tensors`` (keys as :meth:`tensors`)."""
        with torch.no_grad():
            for n, p in self.named_params:
                p.copy_(tensors[f"suffix/{n}"])
        self.steps = [int(v) for v in tensors["suffix/steps"].tolist()]

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """The suffix weights on the host, by parameter name, in the dtype the visit held them."""
        return {n: p.detach().cpu() for n, p in self.named_params}
