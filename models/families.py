"""Model families: one entry per decoder architecture, the one place a family's name is spelled.

An entry says what the config needs to know without importing torch (positions, default tying, the MLP's default
width) and where the family's ``Decoder`` lives; the decoder class itself carries what depends on its layers: its
modules, and the planner's per-token byte counts (``saved_bytes``, ``adapter_input_bytes``, ``infer_bytes``,
``buffer_bytes``; models/memory.py asks them), the projections its init scales (``residual_projections``) and, to read
and write Hugging Face checkpoints, its format (``hf``: names, transform, config.json keys; models/hf_names.py). Adding
a family is its module (a ``Decoder`` subclass with those) plus one entry here: no other module names a family
(``tests/test_models.py``).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    decoder: str
    """``module:Class`` of its Decoder, imported when a model is built or planned (the config stays torch-free)."""
    rotary: bool
    """Rotary positions (RoPE): ``model.rope_*`` and q/k/v biases apply and the head dim must be even; otherwise
    learned positions."""
    tied: bool
    """Whether the head shares the token embedding when ``model.tie_embeddings`` is unset."""
    ffn: Callable[[int], int]
    """The MLP's hidden width from ``d_model`` when ``model.d_ff`` is unset."""


def _swiglu_width(d_model: int) -> int:
    return 64 * ((int(8 * d_model / 3) + 63) // 64)  # 8/3 d_model rounded up to 64 (LLaMA)


FAMILIES: dict[str, Family] = {
    "gpt": Family("bcdflow.models.gpt:GPT", rotary=False, tied=True, ffn=lambda d_model: 4 * d_model),
    "llama": Family("bcdflow.models.llama:LLaMA", rotary=True, tied=False, ffn=_swiglu_width),
}


@functools.lru_cache(maxsize=None)
def decoder_class(family: str) -> type:
    """The ``Decoder`` subclass of a family (its module imported on first use)."""
    module, name = FAMILIES[family].decoder.split(":")
    return getattr(importlib.import_module(module), name)
