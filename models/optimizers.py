"""The optimizers a visit can train its block with: one entry each, which every reader takes from (docs/DESIGN.md §2.3).

    OPTIMIZERS["adamw"].build(params, spec)   # the torch optimizer over the active block (models/trainer.make_optimizer)
    OPTIMIZERS["adamw"].paper_lr              # the learning rate when optim.lr is unset (paper §4.2.1)
    OPTIMIZERS["adamw"].state                 # fp32 tensors of state per trainable parameter (the planner, models/memory.py)

A new optimizer is one entry here: ``core/config.OptimSection.name`` accepts the names of this registry, the trainer
builds it, and the planner counts its state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Optimizer:
    build: Callable[..., torch.optim.Optimizer]
    """``build(params, spec)``: the optimizer over ``params`` with ``spec``'s settings (``models/trainer.OptimSpec``)."""
    paper_lr: float
    """The learning rate of the paper's §4.2.1 when ``optim.lr`` is unset."""
    state: int
    """fp32 tensors of optimizer state per trainable parameter (AdamW's two moments, SGD's momentum buffer)."""
    decay_temporary: bool = False
    """Whether a step with weight decay allocates a gradient-sized temporary (foreach SGD adds the decay to a copy)."""


def _adamw(params, spec):
    # fused: one kernel per parameter group, no foreach temporaries (3.5x faster on CPU here)
    return torch.optim.AdamW(params, lr=spec.base_lr, betas=spec.betas, eps=spec.eps,
                             weight_decay=spec.weight_decay, fused=True)


def _sgd(params, spec):
    return torch.optim.SGD(params, lr=spec.base_lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
                           foreach=True)


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(_adamw, paper_lr=1e-4, state=2),
    "sgd": Optimizer(_sgd, paper_lr=0.1, state=1, decay_temporary=True),
}
