"""FLOPs per token of a decoder's passes: the one count the planner's time model (models/holding.py), the run planner
(core/figures.py) and the benchmarks' utilization figures (benchmarks/common.py) read. Torch-free: from the
parameter shapes (``models/build.param_shapes``), so the planner counts without building a model.

Matmuls: a layer's matrices (``P`` elements) cost 2P per token forward, 2P for the input gradient and, for a trained
matrix, 2P more for its weight gradient. Attention per layer and token: QK^T and AV, ``4 T C`` counted whole
(PaLM's convention for model FLOPs utilization, the benchmarks'), ``2 T C`` counted causal (what a causal kernel
computes: the planner's time model). The head: ``2 V C`` forward, as much again for its input gradient, and for its
weight gradient where it trains.
"""
from __future__ import annotations

import math
from typing import Collection, Mapping, Sequence

from bcdflow.models.plan import layer_of


def matrix_elements(shapes: Mapping[str, Sequence[int]], only: Collection[str] | None = None) -> dict[int, int]:
    """Layer -> elements of its matrices (parameters of two or more dimensions; ``only``: of these names alone)."""
    out: dict[int, int] = {}
    for name, shape in shapes.items():
        if (i := layer_of(name)) is not None and len(shape) >= 2 and (only is None or name in only):
            out[i] = out.get(i, 0) + math.prod(shape)
    return out


def attention(seq: int, d_model: int, causal: bool = True) -> int:
    """Forward FLOPs per token of one layer's attention (QK^T and AV) over ``seq`` positions."""
    return (2 if causal else 4) * seq * d_model


def head(vocab: int, d_model: int) -> int:
    """Forward FLOPs per token of the output projection."""
    return 2 * vocab * d_model


def forward(shapes: Mapping[str, Sequence[int]], cfg, seq: int, lo: int, hi: int, with_head: bool = False,
            causal: bool = True) -> int:
    """FLOPs per token of a forward pass over layers [lo, hi) (pre-inference; evaluation ``with_head``)."""
    mats, attn = matrix_elements(shapes), attention(seq, cfg.d_model, causal)
    return (sum(2 * P + attn for i, P in mats.items() if lo <= i < hi)
            + (head(cfg.vocab_size, cfg.d_model) if with_head else 0))


def step(shapes: Mapping[str, Sequence[int]], cfg, seq: int, trainable: Collection[str], grad_from: int | None = None,
         lo: int = 0, causal: bool = True) -> int:
    """FLOPs per token of one training step over the layers >= ``lo`` that ``shapes`` hold: layers below
    ``grad_from`` forward only (a frozen prefix under no_grad), the others forward, input gradient and, for their
    trained matrices, weight gradient; the head forward and input gradient, and its weight gradient where it
    trains."""
    mats = {i: P for i, P in matrix_elements(shapes).items() if i >= lo}
    train = matrix_elements(shapes, trainable)
    grad_from = min(mats, default=0) if grad_from is None else grad_from
    attn = attention(seq, cfg.d_model, causal)
    total = 0
    for i, P in mats.items():
        total += 2 * P + attn
        if i >= grad_from:
            total += 2 * P + 2 * attn + 2 * train.get(i, 0)
    h = head(cfg.vocab_size, cfg.d_model)
    return total + 2 * h + (h if ("wte.weight" if cfg.tied else "lm_head.weight") in trainable else 0)
