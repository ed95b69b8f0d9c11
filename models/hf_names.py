"""Hugging Face checkpoints as mapping tables (docs/CONVENTIONS.md 11): parameter names, the one transform, configs.

Pure data and functions, no file access (storage/hf_checkpoint.py reads the files, core/hf_import.py wires the two):

    cfg = config_from_hf(json.load(open("config.json")))         # -> ModelConfig (refuses what we cannot run)
    hf_name(cfg, "h.3.attention.wq.weight")                      # -> "model.layers.3.self_attn.q_proj.weight"
    ours = from_hf(cfg, "h.3.attn.c_attn.weight", hf_tensor)      # GPT-2 Conv1D weights are transposed
    name, t = to_hf(cfg, "h.3.attn.c_attn.weight", our_tensor)
    config_to_hf(cfg, "LlamaForCausalLM", "bfloat16")             # -> config.json dict

Families, by ``architectures[0]`` of config.json:

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

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from bcdflow.models.model_config import MAX_VOCAB, SIZE_LIMITS, ModelConfig, RopeScaling
from bcdflow.models.errors import ConfigError

KEY = "model.from_hf"

# -- GPT-2 ---------------------------------------------------------------------------------------------
GPT2_FROM_HF: dict[str, str] = {
    "transformer.wte.weight": "wte.weight",
    "transformer.wpe.weight": "wpe.weight",
    "transformer.h.{i}.ln_1.weight": "h.{i}.ln_1.weight",
    "transformer.h.{i}.ln_1.bias": "h.{i}.ln_1.bias",
    "transformer.h.{i}.attn.c_attn.weight": "h.{i}.attn.c_attn.weight",  # Conv1D: transposed
    "transformer.h.{i}.attn.c_attn.bias": "h.{i}.attn.c_attn.bias",
    "transformer.h.{i}.attn.c_proj.weight": "h.{i}.attn.c_proj.weight",  # Conv1D: transposed
    "transformer.h.{i}.attn.c_proj.bias": "h.{i}.attn.c_proj.bias",
    "transformer.h.{i}.ln_2.weight": "h.{i}.ln_2.weight",
    "transformer.h.{i}.ln_2.bias": "h.{i}.ln_2.bias",
    "transformer.h.{i}.mlp.c_fc.weight": "h.{i}.mlp.c_fc.weight",  # Conv1D: transposed
    "transformer.h.{i}.mlp.c_fc.bias": "h.{i}.mlp.c_fc.bias",
    "transformer.h.{i}.mlp.c_proj.weight": "h.{i}.mlp.c_proj.weight",  # Conv1D: transposed
    "transformer.h.{i}.mlp.c_proj.bias": "h.{i}.mlp.c_proj.bias",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",  # untied only
}
GPT2_TO_HF: dict[str, str] = {ours: hf for hf, ours in GPT2_FROM_HF.items()}
_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def gpt2_tensor(our_name: str, t: torch.Tensor) -> torch.Tensor:
    """HF -> ours and ours -> HF alike: Conv1D weights [in, out] <-> Linear weights [out, in]."""
    return t.t().contiguous() if _CONV1D.match(our_name) else t


# -- LLaMA, Mistral, Qwen2 -------------------------------------------------------------------------------
LLAMA_FROM_HF: dict[str, str] = {
    "model.embed_tokens.weight": "wte.weight",
    "model.layers.{i}.input_layernorm.weight": "h.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "h.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "h.{i}.attention.wq.bias",  # Qwen2
    "model.layers.{i}.self_attn.k_proj.weight": "h.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "h.{i}.attention.wk.bias",  # Qwen2
    "model.layers.{i}.self_attn.v_proj.weight": "h.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "h.{i}.attention.wv.bias",  # Qwen2
    "model.layers.{i}.self_attn.o_proj.weight": "h.{i}.attention.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "h.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "h.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "h.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "h.{i}.feed_forward.w2.weight",
    "model.norm.weight": "ln_f.weight",
    "lm_head.weight": "lm_head.weight",  # untied only
}
LLAMA_TO_HF: dict[str, str] = {ours: hf for hf, ours in LLAMA_FROM_HF.items()}


def llama_tensor(our_name: str, t: torch.Tensor) -> torch.Tensor:
    """Identity both ways: models/llama.py rotates halves like HF, so q/k rows need no permutation."""
    return t


@dataclass(frozen=True)
class FamilyMap:
    from_hf: dict[str, str]
    to_hf: dict[str, str]
    transform: Callable[[str, torch.Tensor], torch.Tensor]
    """Applied to a tensor under our name, in either direction (each transform is its own inverse)."""
    base_prefix: str
    """The base model's prefix; older GPT-2 files (openai-community/gpt2) store names without it."""


FAMILY_MAPS: dict[str, FamilyMap] = {
    "gpt": FamilyMap(GPT2_FROM_HF, GPT2_TO_HF, gpt2_tensor, "transformer."),
    "llama": FamilyMap(LLAMA_FROM_HF, LLAMA_TO_HF, llama_tensor, "model."),
}

# architectures[0] -> (our family, config.json model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt", "gpt2"),
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("llama", "mistral"),
    "Qwen2ForCausalLM": ("llama", "qwen2"),
}
NATURAL_ARCH = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    out = FAMILY_MAPS[cfg.family].to_hf[tpl]
    return out if i is None else out.replace("{i}", i)


def our_name(cfg: ModelConfig, name: str) -> str | None:
    """Our parameter name of an HF tensor name (with or without the base prefix); None if we have no such
    parameter (buffers such as GPT-2's ``attn.bias`` or ``rotary_emb.inv_freq``)."""
    fam = FAMILY_MAPS[cfg.family]
    for candidate in (name, fam.base_prefix + name):
        tpl, i = _template(candidate, _HF_LAYER)
        if tpl in fam.from_hf:
            out = fam.from_hf[tpl]
            return out if i is None else out.replace("{i}", i)
    return None


def from_hf(cfg: ModelConfig, our: str, t: torch.Tensor) -> torch.Tensor:
    """An HF tensor in our layout (same dtype)."""
    return FAMILY_MAPS[cfg.family].transform(our, t)


def to_hf(cfg: ModelConfig, our: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our tensors under its HF name, in HF's layout (same dtype)."""
    return hf_name(cfg, our), FAMILY_MAPS[cfg.family].transform(our, t)


def hf_shape(cfg: ModelConfig, our: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape an HF file stores for one of our parameters of ``shape``."""
    return tuple(reversed(shape)) if cfg.family == "gpt" and _CONV1D.match(our) else tuple(shape)


# -- config.json -> ModelConfig ------------------------------------------------------------------------------
# config.json is input like any other: every field read from it is checked for its type and range before a model
# config exists (a null, a string where a number belongs, a size past any real model), each refusal one ConfigError
# naming the key. Sizes are held to the bounds of the run config's model.* (models/model_config.SIZE_LIMITS).
_ABSENT = object()


def _bad(key: str, want: str, v) -> ConfigError:
    return ConfigError(f"{KEY}: config.json {key} must be {want}, got {v!r}"[:300])


def _int(d: dict, key: str, default=_ABSENT, limit: str | None = None, within: str = "") -> int | None:
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


def _float(d: dict, key: str, default=_ABSENT, within: str = "") -> float:
    """A finite positive number (``default`` when absent or null, if one is given)."""
    v = d.get(key)
    if v is None and default is not _ABSENT:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise _bad(within + key, "a positive number", v)
    return float(v)


def _flag(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, "true or false", v)
    return v


def _text(d: dict, key: str, default: str) -> str:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(key, "a string", v)
    return v


def _object(d: dict, key: str) -> dict | None:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise _bad(key, "an object", v)
    return v


def architecture(d: dict) -> str:
    """``architectures[0]`` of a config.json, refused unless supported (the message lists what is)."""
    archs = d.get("architectures") or [None]
    arch = archs[0] if isinstance(archs, list) else archs
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ConfigError(f"{KEY}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
                          [:300])
    return arch


def _refuse_if(cond: bool, what: str) -> None:
    if cond:
        raise ConfigError(f"{KEY}: {what} is not supported")


def rope_settings(d: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
    (earlier files); the scaling is ``default`` (none) or ``llama3``, whose four numbers must all be there."""
    params = _object(d, "rope_parameters")
    theta = _float(d, "rope_theta", 10000.0)
    if params is not None:
        theta, scaling, within = _float(params, "rope_theta", theta, "rope_parameters."), params, "rope_parameters."
    else:
        scaling, within = _object(d, "rope_scaling") or {}, "rope_scaling."
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{KEY}: rope scaling type {kind!r} is not supported (supported: default, llama3)"[:300])
    missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(scaling)
    if missing:
        raise ConfigError(f"{KEY}: llama3 rope scaling lacks {', '.join(sorted(missing))}")
    low, high = (_float(scaling, k, within=within) for k in ("low_freq_factor", "high_freq_factor"))
    if low >= high:
        raise ConfigError(f"{KEY}: config.json {within}low_freq_factor must be below high_freq_factor, got {low} and "
                          f"{high}")
    return theta, RopeScaling(_float(scaling, "factor", within=within), low, high,
                              _int(scaling, "original_max_position_embeddings", limit="n_ctx", within=within))


def config_from_hf(d: dict) -> ModelConfig:
    """Our model config of a config.json; anything the family's forward pass would compute differently is
    refused with a ConfigError that names the key, as is any field of the wrong type or out of range."""
    arch = architecture(d)
    family, _ = ARCHITECTURES[arch]
    if family == "gpt":
        act = _text(d, "activation_function", "gelu_new")
        _refuse_if(act not in ("gelu_new", "gelu_pytorch_tanh"), f"GPT-2 activation_function {act!r}")
        _refuse_if(not _flag(d, "scale_attn_weights", True), "GPT-2 scale_attn_weights=false")
        _refuse_if(_flag(d, "scale_attn_by_inverse_layer_idx", False), "GPT-2 scale_attn_by_inverse_layer_idx")
        _refuse_if(_flag(d, "add_cross_attention", False), "GPT-2 add_cross_attention")
        return ModelConfig(
            family="gpt", n_layer=_int(d, "n_layer", limit="n_layer"), d_model=_int(d, "n_embd", limit="d_model"),
            n_head=_int(d, "n_head", limit="n_head"), d_ff=_int(d, "n_inner", None, limit="d_ff"),
            n_ctx=_int(d, "n_positions" if "n_positions" in d else "n_ctx", limit="n_ctx"),
            vocab_size=_int(d, "vocab_size", limit="vocab_size"), norm_eps=_float(d, "layer_norm_epsilon", 1e-5),
            tie_embeddings=_flag(d, "tie_word_embeddings", True), bias=True)

    act = _text(d, "hidden_act", "silu")
    _refuse_if(act != "silu", f"hidden_act {act!r}")
    _refuse_if(_flag(d, "attention_bias", False), "attention_bias=true (biases on all four attention projections)")
    _refuse_if(_flag(d, "mlp_bias", False), "mlp_bias=true")
    d_model, n_head = _int(d, "hidden_size", limit="d_model"), _int(d, "num_attention_heads", limit="n_head")
    head_dim = _int(d, "head_dim", None)
    _refuse_if(head_dim not in (None, d_model // n_head) or d_model % n_head != 0,
               f"head_dim={head_dim} other than hidden_size/num_attention_heads")
    theta, rope_scaling = rope_settings(d)
    prf = _float(_object(d, "rope_parameters") or {}, "partial_rotary_factor",
                 _float(d, "partial_rotary_factor", 1.0), "rope_parameters.")
    _refuse_if(prf != 1.0, f"partial_rotary_factor={prf}")
    return ModelConfig(
        family="llama", n_layer=_int(d, "num_hidden_layers", limit="n_layer"), d_model=d_model, n_head=n_head,
        n_kv_head=_int(d, "num_key_value_heads", n_head, limit="n_kv_head"),
        d_ff=_int(d, "intermediate_size", limit="d_ff"), n_ctx=_int(d, "max_position_embeddings", limit="n_ctx"),
        vocab_size=_int(d, "vocab_size", limit="vocab_size"), norm_eps=_float(d, "rms_norm_eps", 1e-6),
        rope_theta=theta, tie_embeddings=_flag(d, "tie_word_embeddings", False), bias=False,
        qkv_bias=arch == "Qwen2ForCausalLM", rope_scaling=rope_scaling)


def attention_window(d: dict) -> int | None:
    """The sliding attention window a checkpoint uses (Mistral; Qwen2 with use_sliding_window), else None.
    Sequences no longer than the window see plain causal attention, which is what we run."""
    arch = architecture(d)
    if arch == "MistralForCausalLM" or (arch == "Qwen2ForCausalLM" and _flag(d, "use_sliding_window", False)):
        return _int(d, "sliding_window", None)
    return None


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
    return "Qwen2ForCausalLM" if cfg.family == "llama" and cfg.qkv_bias else NATURAL_ARCH[cfg.family]


def config_to_hf(cfg: ModelConfig, arch: str, dtype: str) -> dict:
    """A config.json for ``cfg`` as ``arch``: the keys that decide the weights and the forward pass, written
    so that transformers 4.x and 5.x both read them (``rope_theta``/``rope_scaling``, ``dtype`` and
    ``torch_dtype``). Token ids (bos/eos/pad) are the caller's to add."""
    if arch not in ARCHITECTURES or ARCHITECTURES[arch][0] != cfg.family:
        raise ConfigError(f"--format hf: a {cfg.family} model cannot be written as {arch!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    family, model_type = ARCHITECTURES[arch]
    out = {"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
           "tie_word_embeddings": cfg.tied, "dtype": dtype, "torch_dtype": dtype}
    if family == "gpt":
        if not cfg.bias:
            raise ConfigError("--format hf: GPT2LMHeadModel always has biases; this run has model.bias=false")
        return {**out, "n_layer": cfg.n_layer, "n_embd": cfg.d_model, "n_head": cfg.n_head,
                "n_inner": cfg.d_ff, "n_positions": cfg.n_ctx, "n_ctx": cfg.n_ctx,
                "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # our model has no dropout
    if cfg.qkv_bias != (arch == "Qwen2ForCausalLM"):
        raise ConfigError(f"--format hf: {arch} {'has no' if cfg.qkv_bias else 'needs'} q/k/v biases "
                          f"(model.qkv_bias={str(cfg.qkv_bias).lower()})")
    out.update({"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
                "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
                "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
                "rope_theta": cfg.rope_theta, "rope_scaling": None})
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position_embeddings}
    if arch == "LlamaForCausalLM":
        out.update({"attention_bias": False, "mlp_bias": False})
    else:  # Mistral, Qwen2: full attention (we train without a window)
        out.update({"sliding_window": None})
        if arch == "Qwen2ForCausalLM":
            out.update({"use_sliding_window": False})
    return out
