"""Build a model or a part of it, of either family; its parameter sizes and block plan without building it.

    model = build_model(cfg)                                   # fresh weights from the current torch RNG
    part = build_model(cfg, layers=(4, 12), embed=False, init=False)   # storage for weights about to load
    plan = model_plan(cfg, blocks=3)                           # from a meta-device model: no memory, no init
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Collection, Sequence

import torch
from torch.overrides import TorchFunctionMode

from bcdflow.models.base import Decoder
from bcdflow.models.families import decoder_class
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import Plan, frozen_names, make_plan


def build_model(cfg: ModelConfig, layers: tuple[int, int] | None = None, embed: bool = True,
                head: bool = True, device: str | torch.device = "cpu", init: bool = True,
                frozen_dtype: torch.dtype | None = None, trainable: Collection[str] = ()) -> Decoder:
    """Build the whole model or a part of it.

    ``init=True`` draws fresh weights from the current torch RNG (seed it first); ``init=False``
    allocates uninitialised storage for weights that are about to be loaded (no wasted init work).
    ``frozen_dtype`` (with ``init=False``): every weight matrix and embedding not named in ``trainable`` is
    allocated in that dtype (bf16 frozen weights, docs/DESIGN.md I6); see :func:`frozen_in`.
    """
    cls = decoder_class(cfg.family)
    if init:
        model = cls(cfg, layers, embed, head).to(device)
        model.init_weights()
        return model
    with _meta():
        model = cls(cfg, layers, embed, head)
        if frozen_dtype is not None:
            frozen_in(model, frozen_dtype, trainable)
    model = model.to_empty(device=device)
    model._init_buffers()
    return model


class _NoMetaInit(TorchFunctionMode):
    """Skips ``normal_`` on meta tensors (the modules' own init in their constructors): it draws nothing there, and
    the first one in a process costs seconds (torch loads its Python decompositions for it), which every process
    that plans or loads a model paid. Other ops run as they are; a mode is per thread, so nothing else is touched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "normal_":
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def _meta():
    """A meta-device build (shapes and dtypes, no storage) without the constructors' init."""
    with torch.device("meta"), _NoMetaInit():
        yield


def frozen_in(model: Decoder, dtype: torch.dtype, trainable: Collection[str] = ()) -> Decoder:
    """Store the frozen weights of ``model`` in ``dtype`` (in place): every parameter with two or more dimensions
    (matrices, embedding tables; more than 99.9% of the bytes) not named in ``trainable``. Norm gains and biases
    stay fp32, so the per-channel ops that autocast runs in fp32 see exactly the weights they see today, and a
    matmul under bf16 autocast multiplies the same bf16 values it would cast the fp32 weight to (the cast rounds
    to nearest, as ``.to`` does): frozen layers compute what they computed with fp32 storage, without the copy.
    Only a frozen embedding lookup differs: it reads bf16-rounded rows (upcast to the fp32 residual stream)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name not in trainable and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, from a meta-device model (no memory, no init); built once per config (the
    planner asks for every block count of a model)."""
    return dict(_shapes(cfg))


@functools.lru_cache(maxsize=16)
def _shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with _meta():
        model = decoder_class(cfg.family)(cfg)
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def param_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Parameter name -> element count, from a meta-device model (no memory, no init)."""
    return {n: math.prod(s) for n, s in param_shapes(cfg).items()}


def model_plan(cfg: ModelConfig, blocks: int | None = None, boundaries: Sequence[int] | None = None,
               split: str = "params", freeze: Sequence[str] = ()) -> Plan:
    """The block plan of a model: ``split="params"`` balances parameter counts (embeddings and head
    included, the paper's "one third of the parameters", §4.1; parameters ``freeze`` keeps frozen count
    nothing), ``"layers"`` balances layer counts."""
    sizes = param_sizes(cfg)
    frozen = frozen_names(sizes, freeze, cfg.tied)
    sizes = {n: 0 if n in frozen else k for n, k in sizes.items()}
    return make_plan(sizes if split == "params" else list(sizes), cfg.n_layer, blocks, boundaries)
