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

from bcdflow.models.optimizers import LIGHT_CHUNK as CHUNK, QBLOCK  # noqa: F401 (the chunk the docstring names)
from bcdflow.models.rounding import seeded, stochastic_round  # noqa: F401 (the rule's parts, used where it is)


def adamw8bit(params, spec) -> torch.optim.Optimizer:
    """AdamW with 8-bit moments over ``params`` (fp32 or bf16: a bf16 parameter's update is rounded stochastically);
    ``spec``: models/specs.OptimSpec."""
    from bcdflow.models.bnb_adamw import AdamW8bit  # bitsandbytes: only when a light optimizer is built

    return AdamW8bit(params, lr=spec.base_lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                     seed=spec.seed)

