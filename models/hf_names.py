"""Hugging Face checkpoints as mapping tables (docs/CONVENTIONS.md 11): parameter names, the one transform, configs.

Pure data and functions, no file access (storage/hf_checkpoint.py reads the files, core/hf_import.py wires the two):

    cfg = config_from_hf(json.load(open("config.json")))         # -> ModelConfig (refuses what we cannot run)
    hf_name(cfg, "h.3.attention.wq.weight")                      # -> "model.layers.3.self_attn.q_proj.weight"
    ours = from_hf(cfg, "h.3.attn.c_attn.weight", hf_tensor)      # GPT-2 Conv1D weights are transposed
    name, t = to_hf(cfg, "h.3.attn.c_attn.weight", our_tensor)
    config_to_hf(cfg, "LlamaForCausalLM", "bfloat16")             # -> config.json dict

Each family's format (:class:`HFFormat`) lives with the family, as its ``Decoder``'s ``hf`` (models/gpt.py,
models/llama.py): its name table (Hugging Face template -> ours), the tensors stored transposed, its base prefix, the
``architectures[0]`` it reads and writes, and the reading and writing of its config.json keys. This module holds
what every format shares (the lookups, the checks of config.json's values) and names no family: a new one is its
module (a ``Decoder`` with ``hf``) and its ``models/families.FAMILIES`` entry.

- ``GPT2LMHeadModel`` -> our ``gpt``. HF stores the four projection weights as ``Conv1D`` ([in, out]); ours are
  ``nn.Linear`` ([out, in]), so those are transposed (its own inverse). The fused ``c_attn`` keeps HF's
  [q | k | v] order, heads contiguous, which is what ``models/gpt.py`` splits.
- ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` -> our ``llama``. Same tensor names;
  Qwen2 adds q/k/v biases (``qkv_bias``). models/llama.py uses HF's rotate-half RoPE, so no q/k
  permutation: the mapping is renaming only. Mistral's sliding window and Qwen2's optional one are not
  modelled: a run is refused when its sequences are longer than the window (``attention_window``).

Tied embeddings: a tied head has no ``lm_head.weight`` of its own in either format.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from bcdflow.models.errors import ConfigError
from bcdflow.models.families import FAMILIES, decoder_class
from bcdflow.models.model_config import MAX_VOCAB, SIZE_LIMITS, ModelConfig, RopeScaling

KEY = "model.from_hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFFormat:
    """How one family's checkpoints are stored by Hugging Face ``transformers`` (a ``Decoder``'s ``hf``)."""
    from_hf: dict[str, str]
    """HF tensor name -> ours, ``{i}`` for a layer's index."""
    base_prefix: str
    """The base model's prefix; older GPT-2 files (openai-community/gpt2) store names without it."""
    architectures: dict[str, str]
    """``architectures[0]`` of a config.json this family reads and writes -> its ``model_type``."""
    read_config: Callable[[dict, str], dict]
    """``(config.json, architecture) ->`` the ``ModelConfig`` fields (all but ``family``), refusing (ConfigError naming
    the key) what the family's forward pass would compute differently."""
    write_config: Callable[[ModelConfig, str], dict]
    """``(cfg, architecture) -> `` the family's keys of a config.json (the shared ones are :func:`config_to_hf`'s)."""
    default_architecture: Callable[[ModelConfig], str]
    """The architecture a run that did not start from a checkpoint exports as."""
    transposed: Callable[[str], bool] = lambda our_name: False
    """Whether HF stores this parameter of ours transposed (GPT-2's Conv1D): the one transform, its own inverse."""
    attention_window: Callable[[dict, str], int | None] = lambda d, arch: None
    """The sliding attention window a config.json of this architecture uses, else None."""
    to_hf: dict[str, str] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "to_hf", {ours: hf for hf, ours in self.from_hf.items()})


def hf_format(family: str) -> HFFormat:
    """The Hugging Face format of a family (its ``Decoder``'s ``hf``)."""
    fmt = decoder_class(family).hf
    if fmt is None:
        raise ConfigError(f"--format hf: the {family} family reads and writes no Hugging Face checkpoints")
    return fmt


@functools.lru_cache(maxsize=None)
def architectures() -> dict[str, str]:
    """Every ``architectures[0]`` a checkpoint may name -> our family, in the families' order."""
    return {arch: fam for fam in FAMILIES if decoder_class(fam).hf is not None
            for arch in decoder_class(fam).hf.architectures}

_OUR_LAYER = re.compile(r"^h\.(\d+)\.")
_HF_LAYER = re.compile(r"\.(\d+)\.")


def _template(name: str, pattern: re.Pattern) -> tuple[str, str | None]:
    m = pattern.search(name)
    if not m:
        return name, None
    return name[:m.start(1)] + "{i}" + name[m.end(1):], m.group(1)


def hf_name(cfg: ModelConfig, our_name: str) -> str:
    """The HF tensor name of one of our parameters."""
    tpl, i = _template(our_name, _OUR_LAYER)
    out = hf_format(cfg.family).to_hf[tpl]
    return out if i is None else out.replace("{i}", i)


def our_name(cfg: ModelConfig, name: str) -> str | None:
    """Our parameter name of an HF tensor name (with or without the base prefix); None if we have no such
    parameter (buffers such as GPT-2's ``attn.bias`` or ``rotary_emb.inv_freq``)."""
    fam = hf_format(cfg.family)
    for candidate in (name, fam.base_prefix + name):
        tpl, i = _template(candidate, _HF_LAYER)
        if tpl in fam.from_hf:
            out = fam.from_hf[tpl]
            return out if i is None else out.replace("{i}", i)
    return None


def _layout(cfg: ModelConfig, our: str, t: torch.Tensor) -> torch.Tensor:
    """HF's layout <-> ours, either way: the family's transposed tensors transposed, the rest as they are."""
    return t.t().contiguous() if hf_format(cfg.family).transposed(our) else t


def from_hf(cfg: ModelConfig, our: str, t: torch.Tensor) -> torch.Tensor:
    """An HF tensor in our layout (same dtype)."""
    return _layout(cfg, our, t)


def to_hf(cfg: ModelConfig, our: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our tensors under its HF name, in HF's layout (same dtype)."""
    return hf_name(cfg, our), _layout(cfg, our, t)


def hf_shape(cfg: ModelConfig, our: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape an HF file stores for one of our parameters of ``shape``."""
    return tuple(reversed(shape)) if hf_format(cfg.family).transposed(our) else tuple(shape)


# -- config.json -> ModelConfig ------------------------------------------------------------------------------
# config.json is input like any other: every field read from it is checked for its type and range before a model
# config exists (a null, a string where a number belongs, a size past any real model), each refusal one ConfigError
# naming the key. Sizes are held to the bounds of the run config's model.* (models/model_config.SIZE_LIMITS).
_ABSENT = object()


def _bad(key: str, want: str, v) -> ConfigError:
    return ConfigError(f"{KEY}: config.json {key} must be {want}, got {v!r}"[:300])


def get_int(d: dict, key: str, default=_ABSENT, limit: str | None = None, within: str = "") -> int | None:
    """A positive integer (``default`` when absent or null, if one is given), at most ``SIZE_LIMITS[limit]``;
    ``within``: the object holding ``key`` (``rope_parameters.``), for the message."""
    v = d.get(key)
    if v is None and default is not _ABSENT:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _bad(within + key, "a positive integer", v)
    top = MAX_VOCAB if limit == "vocab_size" else SIZE_LIMITS.get(limit or "")
    if top is not None and v > top:
        raise ConfigError(f"{KEY}: config.json {within}{key}={v} is beyond any model this trains (at most {top})")
    return v


def get_float(d: dict, key: str, default=_ABSENT, within: str = "") -> float:
    """A finite positive number (``default`` when absent or null, if one is given)."""
    v = d.get(key)
    if v is None and default is not _ABSENT:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise _bad(within + key, "a positive number", v)
    return float(v)


def get_flag(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, "true or false", v)
    return v


def get_text(d: dict, key: str, default: str) -> str:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(key, "a string", v)
    return v


def get_object(d: dict, key: str) -> dict | None:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise _bad(key, "an object", v)
    return v


def refuse_if(cond: bool, what: str) -> None:
    if cond:
        raise ConfigError(f"{KEY}: {what} is not supported")


def rope_settings(d: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
    (earlier files); the scaling is ``default`` (none) or ``llama3``, whose four numbers must all be there."""
    params = get_object(d, "rope_parameters")
    theta = get_float(d, "rope_theta", 10000.0)
    if params is not None:
        theta, scaling, within = get_float(params, "rope_theta", theta, "rope_parameters."), params, "rope_parameters."
    else:
        scaling, within = get_object(d, "rope_scaling") or {}, "rope_scaling."
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{KEY}: rope scaling type {kind!r} is not supported (supported: default, llama3)"[:300])
    missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(scaling)
    if missing:
        raise ConfigError(f"{KEY}: llama3 rope scaling lacks {', '.join(sorted(missing))}")
    low, high = (get_float(scaling, k, within=within) for k in ("low_freq_factor", "high_freq_factor"))
    if low >= high:
        raise ConfigError(f"{KEY}: config.json {within}low_freq_factor must be below high_freq_factor, got {low} and "
                          f"{high}")
    return theta, RopeScaling(get_float(scaling, "factor", within=within), low, high,
                              get_int(scaling, "original_max_position_embeddings", limit="n_ctx", within=within))


def architecture(d: dict) -> str:
    """``architectures[0]`` of a config.json, refused unless supported (the message lists what is)."""
    archs = d.get("architectures") or [None]
    arch = archs[0] if isinstance(archs, list) else archs
    if not isinstance(arch, str) or arch not in architectures():
        raise ConfigError(f"{KEY}: architecture {arch!r} is not supported (supported: {', '.join(architectures())})"
                          [:300])
    return arch


def config_from_hf(d: dict) -> ModelConfig:
    """Our model config of a config.json; anything the family's forward pass would compute differently is
    refused with a ConfigError that names the key, as is any field of the wrong type or out of range."""
    arch = architecture(d)
    family = architectures()[arch]
    return ModelConfig(family=family, **hf_format(family).read_config(d, arch))


def attention_window(d: dict) -> int | None:
    """The sliding attention window a checkpoint uses (Mistral; Qwen2 with use_sliding_window), else None.
    Sequences no longer than the window see plain causal attention, which is what we run."""
    arch = architecture(d)
    return hf_format(architectures()[arch]).attention_window(d, arch)


# -- ModelConfig -> config.json -----------------------------------------------------------------------------
def with_defaults_stated(d: dict, cfg: ModelConfig, dtype: str) -> dict:
    """A checkpoint's own config.json for the model trained from it (``cfg``, what ``config_from_hf`` read): each field
    it holds as null, which this reader took as its default, written as that value, so a reader with other defaults
    (transformers reads a null ``tie_word_embeddings`` as untied, a null epsilon as no number at all) loads the model
    that was trained. Every other field stays as the checkpoint has it."""
    stated = config_to_hf(cfg, architecture(d), dtype)
    out = {k: (stated[k] if v is None and stated.get(k) is not None else v) for k, v in d.items()}
    params = out.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None:
        out["rope_parameters"] = {**params, "rope_theta": cfg.rope_theta}
    return out


def default_architecture(cfg: ModelConfig) -> str:
    """The HF architecture a run that did not start from a checkpoint exports as."""
    return hf_format(cfg.family).default_architecture(cfg)


def config_to_hf(cfg: ModelConfig, arch: str, dtype: str) -> dict:
    """A config.json for ``cfg`` as ``arch``: the keys that decide the weights and the forward pass, written
    so that transformers 4.x and 5.x both read them (``rope_theta``/``rope_scaling``, ``dtype`` and
    ``torch_dtype``). Token ids (bos/eos/pad) are the caller's to add."""
    if architectures().get(arch) != cfg.family:
        raise ConfigError(f"--format hf: a {cfg.family} model cannot be written as {arch!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    fmt = hf_format(cfg.family)
    out = {"architectures": [arch], "model_type": fmt.architectures[arch], "vocab_size": cfg.vocab_size,
           "tie_word_embeddings": cfg.tied, "dtype": dtype, "torch_dtype": dtype}
    return {**out, **fmt.write_config(cfg, arch)}
