"""Build a model or a part of it, of either family; its parameter sizes and block plan without building it.

    model = build_model(cfg)                                   # fresh weights from the current torch RNG
    part = build_model(cfg, layers=(4, 12), embed=False, init=False)   # storage for weights about to load
    plan = model_plan(cfg, blocks=3)                           # from a meta-device model: no memory, no init
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import types
from typing import Collection, Iterable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from bcdflow.models.base import Decoder
from bcdflow.models.families import decoder_class
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import VOCAB_MATRICES, Plan, frozen_names, make_plan, split_rows


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
    if torch.device(device).type == "meta":  # placed later (materialize), where each part lives
        return model
    # not model.to_empty(): on meta tensors it runs torch's Python reference ops, seconds of imports (sympy) the
    # first time in every process that loads a model
    return materialize(model, device)


def materialize(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """Give every parameter and buffer of ``model`` still on the meta device uninitialised storage on ``device``, in
    place (each ``Parameter`` stays the same object, so what holds it, a layer stream's layout, still does), and
    rebuild the derived tables; what is already elsewhere (a streamed layer's placeholders) is left alone."""
    for mod in model.modules():  # torch.empty, not empty_like: that one of a meta tensor runs torch's Python
        for name, p in mod._parameters.items():  # reference ops (seconds of imports, the first time in a process)
            if p is not None and p.is_meta:
                place(p, torch.empty(p.shape, dtype=p.dtype, device=device))
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if hasattr(model, "_init_buffers"):
        model._init_buffers()
    return model


def place(p: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Point parameter ``p`` at ``data`` in place, also from the meta device (where ``p.data = data`` is refused
    as an incompatible tensor type): the Python object stays the same, so whoever holds it keeps holding it."""
    if p.is_meta and not data.is_meta:
        torch.utils.swap_tensors(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
    else:
        p.data = data


class _NoMetaInit(TorchFunctionMode):
    """Skips ``normal_`` on meta tensors (the modules' own init in their constructors): it draws nothing there, and
    the first one in a process costs seconds (torch loads its Python decompositions for it), which every process
    that plans or loads a model paid. Other ops run as they are; a mode is per thread, so nothing else is touched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in ("normal_", "uniform_"):  # nn.Linear's kaiming_uniform_ too
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


@functools.lru_cache(maxsize=16)
def param_shapes(cfg: ModelConfig) -> Mapping[str, tuple[int, ...]]:
    """Parameter name -> shape, from a meta-device model (no memory, no init); built once per config (the planner
    asks for every block count of a model, the recommendation hundreds of times): the one cache of them, read-only."""
    with _meta():
        model = decoder_class(cfg.family)(cfg)
    return types.MappingProxyType({n: tuple(p.shape) for n, p in model.named_parameters()})


def param_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Parameter name -> element count, from a meta-device model (no memory, no init)."""
    return {n: math.prod(s) for n, s in param_shapes(cfg).items()}


def param_count(cfg: ModelConfig, names: Iterable[str] | None = None) -> int:
    """Elements of the parameters ``names`` (None: every one; a tied embedding/head once), from a one-layer
    meta-device model: every layer has the same tensors, so a layer's names map onto layer 0's (quick at any depth,
    where a meta model of every layer takes seconds per thousand)."""
    sizes = param_sizes(cfg.replace(n_layer=1))
    if names is None:
        layer = sum(k for n, k in sizes.items() if n.startswith("h."))
        return sum(sizes.values()) - layer + cfg.n_layer * layer
    return sum(sizes[_FIRST_LAYER.sub("h.0.", n)] for n in names)


_FIRST_LAYER = re.compile(r"^h\.\d+\.")


def model_plan(cfg: ModelConfig, blocks: int | None = None, boundaries: Sequence[int] | None = None,
               split: str = "params", freeze: Sequence[str] = (), vocab_blocks: int = 1) -> Plan:
    """The block plan of a model: ``split="params"`` balances parameter counts (embeddings and head
    included, the paper's "one third of the parameters", §4.1; parameters ``freeze`` keeps frozen count
    nothing, nor do vocabulary matrices trained in row blocks), ``"layers"`` balances layer counts.
    ``vocab_blocks`` > 1: the token embedding and an untied head each split into that many row blocks
    (``models/plan.split_rows``)."""
    shapes = param_shapes(cfg)
    sizes = param_sizes(cfg)
    frozen = frozen_names(sizes, freeze, cfg.tied)
    split_off = {n for n in VOCAB_MATRICES if n in sizes and n not in frozen} if vocab_blocks > 1 else set()
    sizes = {n: 0 if n in frozen or n in split_off else k for n, k in sizes.items()}
    plan = make_plan(sizes if split == "params" else list(sizes), cfg.n_layer, blocks, boundaries)
    return split_rows(plan, shapes, vocab_blocks, frozen)
