"""Build a model or a part of it, of either family; its parameter sizes and block plan without building it.

    model = build_model(cfg)                                   # fresh weights from the current torch RNG
    part = build_model(cfg, layers=(4, 12), embed=False, init=False)   # storage for weights about to load
    plan = model_plan(cfg, blocks=3)                           # from a meta-device model: no memory, no init
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from models.base import Decoder
from models.config import ModelConfig
from models.gpt import GPT
from models.llama import LLaMA
from models.plan import Plan, make_plan

FAMILIES: dict[str, type[Decoder]] = {"gpt": GPT, "llama": LLaMA}


def build_model(cfg: ModelConfig, layers: tuple[int, int] | None = None, embed: bool = True,
                head: bool = True, device: str | torch.device = "cpu", init: bool = True) -> Decoder:
    """Build the whole model or a part of it.

    ``init=True`` draws fresh weights from the current torch RNG (seed it first); ``init=False``
    allocates uninitialised storage for weights that are about to be loaded (no wasted init work).
    """
    cls = FAMILIES[cfg.family]
    if init:
        model = cls(cfg, layers, embed, head).to(device)
        model.init_weights()
        return model
    with torch.device("meta"):
        model = cls(cfg, layers, embed, head)
    model = model.to_empty(device=device)
    model._init_buffers()
    return model


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, from a meta-device model (no memory, no init)."""
    with torch.device("meta"):
        model = FAMILIES[cfg.family](cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def param_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Parameter name -> element count, from a meta-device model (no memory, no init)."""
    return {n: math.prod(s) for n, s in param_shapes(cfg).items()}


def model_plan(cfg: ModelConfig, blocks: int | None = None, boundaries: Sequence[int] | None = None,
               split: str = "params") -> Plan:
    """The block plan of a model: ``split="params"`` balances parameter counts (embeddings and head
    included, the paper's "one third of the parameters", §4.1), ``"layers"`` balances layer counts."""
    sizes = param_sizes(cfg)
    return make_plan(sizes if split == "params" else list(sizes), cfg.n_layer, blocks, boundaries)
