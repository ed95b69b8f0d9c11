"""Model configs: one dataclass for every family (models/families.py) and a registry of named sizes.

Sizes follow the paper's Table 8 (G-* are GPT-2, L-* are LLaMA; L = layers, H = hidden,
A = heads; FFN 5050 for L-1.5B, 9200 for the other LLaMAs). ``tiny`` runs a visit on a CPU in seconds.
Any field can be overridden: ``get_config("gpt2-124m", n_layer=6)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bcdflow.models.errors import ConfigError
from bcdflow.models.families import FAMILIES

# sizes beyond any model this trains: a value past one of these can only be a mistake (a typo, an extra digit), and
# the largest are already far past a machine (the parameter count against memory is checked before a run:
# core/context.check_model_size). n_layer also bounds the meta-device model the planner builds: 1024 layers
# take seconds, 1e8 would take days. The run config's model.* (core/config.ModelSection) and a Hugging Face
# checkpoint's config.json (models/hf_names.config_from_hf) are held to the same bounds.
SIZE_LIMITS = {"n_layer": 1024, "d_model": 1 << 17, "n_head": 1 << 12, "n_kv_head": 1 << 12, "d_ff": 1 << 20,
               "n_ctx": 1 << 24}
# the byte-level BPE trainer (tokenizers) allocates ~66 bytes per vocabulary entry up front and aborts the process
# (a Rust backtrace) when that fails: 2**31 asks for 141 GB. The largest vocabularies in use are ~256k.
MAX_VOCAB = 1 << 21


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA 3.1's RoPE frequency scaling (``rope_type: llama3``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is interpolated.
    Frozen (not a dict) so ModelConfig stays hashable."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0:
            raise ConfigError(f"model.rope_scaling.factor: must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"model.rope_scaling: need 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor} and {self.high_freq_factor}")
        if int(self.original_max_position_embeddings) < 1:
            raise ConfigError("model.rope_scaling.original_max_position_embeddings: must be >= 1, got "
                              f"{self.original_max_position_embeddings}")


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt"
    """``gpt`` (learned positions, LayerNorm, GELU MLP, tied head) or ``llama`` (RMSNorm, RoPE, SwiGLU)."""
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention (llama); None = n_head (multi-head)."""
    d_ff: int | None = None
    """MLP hidden size; None = 4 * d_model (gpt) or the SwiGLU rule 8/3 * d_model rounded to 64 (llama)."""
    n_ctx: int = 1024
    """Longest sequence the model accepts (learned positions for gpt, RoPE table for llama)."""
    vocab_size: int = 50304
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None
    """None = family default: tied for gpt, untied for llama."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (gpt only; llama has none)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projections only (llama family: Qwen2 has them)."""
    rope_scaling: RopeScaling | None = None
    """llama3 frequency scaling of the rotary embedding (LLaMA 3.1 and later); None = plain RoPE."""

    def __post_init__(self):
        def bad(key: str, msg: str):
            raise ConfigError(f"model.{key}: {msg}")

        if isinstance(self.rope_scaling, dict):  # from to_dict() / a stored config.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.family not in FAMILIES:
            bad("family", f"unknown family {self.family!r} (choose from {', '.join(FAMILIES)})")
        spec = FAMILIES[self.family]
        if not spec.rotary and (self.qkv_bias or self.rope_scaling is not None):
            rotary = ", ".join(k for k, f in FAMILIES.items() if f.rotary)
            bad("qkv_bias" if self.qkv_bias else "rope_scaling",
                f"only for the {rotary} family ({self.family} has learned positions and model.bias)")
        for key in ("n_layer", "d_model", "n_head", "n_ctx", "vocab_size"):
            if int(getattr(self, key)) < 1:
                bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.d_model % self.n_head:
            bad("n_head", f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2 and spec.rotary:
            bad("n_head", f"RoPE needs an even head dim, got {self.head_dim}")
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            bad("n_kv_head", f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or FAMILIES[self.family].ffn(self.d_model)

    @property
    def tied(self) -> bool:
        return FAMILIES[self.family].tied if self.tie_embeddings is None else self.tie_embeddings

    def replace(self, **overrides) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ConfigError(f"model.{key}: unknown model field (choose from {', '.join(sorted(names))})")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of :meth:`to_dict` (a stored ``model_resolved``); fields it lacks keep their defaults."""
        return cls(**d)


def _gpt(n_layer, d_model, n_head, **kw) -> ModelConfig:
    return ModelConfig("gpt", n_layer, d_model, n_head, **kw)


def _llama(n_layer, d_model, n_head, d_ff, **kw) -> ModelConfig:
    kw.setdefault("vocab_size", 32000)
    return ModelConfig("llama", n_layer, d_model, n_head, d_ff=d_ff, bias=False, **kw)


REGISTRY: dict[str, ModelConfig] = {
    # CPU-sized: a visit in seconds on 2 cores
    "tiny": _gpt(6, 128, 4, n_ctx=256, vocab_size=2048),
    "tiny-llama": _llama(6, 128, 4, 352, n_kv_head=2, n_ctx=256, vocab_size=2048),
    "gpt2-124m": _gpt(12, 768, 12, n_ctx=1024, vocab_size=50304),
    # paper Table 8
    "G-1.6B": _gpt(30, 2048, 16),
    "G-5.4B": _gpt(28, 3968, 32),
    "G-10B": _gpt(56, 3968, 32),
    "G-20B": _gpt(110, 3968, 32),
    "L-1.5B": _llama(30, 2048, 16, 5050, n_ctx=2048),
    "L-6B": _llama(32, 4096, 32, 9200, n_ctx=2048),
    "L-11B": _llama(64, 4096, 32, 9200, n_ctx=2048),
    "L-23B": _llama(128, 4096, 32, 9200, n_ctx=2048),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A named config with any field overridden (None values are ignored)."""
    if name not in REGISTRY:
        raise ConfigError(f"model.name: unknown model {name!r} (choose from {', '.join(REGISTRY)})")
    return REGISTRY[name].replace(**{k: v for k, v in overrides.items() if v is not None})
