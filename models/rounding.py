"""Stochastic rounding to bf16 from seeded draws: the rule a bf16 weight's update is stored by (models/bnb_adamw.py's
8-bit AdamW, models/suffix.py's state-free suffix rules), so an update smaller than half a bf16 step still moves the
weight in expectation, and a loop resumed from a checkpoint draws what an uninterrupted one drew."""
from __future__ import annotations

import torch


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
