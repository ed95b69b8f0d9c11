"""LLaMA family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, untied head.

Also runs the close relatives that differ by a flag: q/k/v biases (``qkv_bias``, Qwen2), a tied head
(LLaMA 3.2 1B/3B), LLaMA 3.1's scaled RoPE frequencies (``rope_scaling``).

RoPE convention: the rotation pairs dimension ``j`` with ``j + head_dim/2`` ("rotate half", GPT-NeoX and
Hugging Face ``transformers``), not the interleaved pairs ``(2j, 2j+1)`` of Meta's original code. The two
are the same model up to a fixed permutation of the q/k output rows; we pick the one the checkpoints
people fine-tune are stored in, so loading and exporting them is pure renaming (models/hf_names.py), q/k biases
need no permutation either, and our forward is the very computation ``transformers`` runs (logits agree
to float rounding). A Meta-format checkpoint would need the permutation instead; none is read here.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bcdflow.models.base import Decoder
from bcdflow.models.errors import ConfigError
from bcdflow.models.hf_names import (HFFormat, get_flag, get_float, get_int, get_object, get_text, refuse_if,
                                     rope_settings)
from bcdflow.models.model_config import ModelConfig, RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device=None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) of the rotary embedding; with ``scaling``, LLaMA 3.1's rule:
    low frequencies (wavelength above original_ctx/low_freq_factor) divided by ``factor``, high ones
    (below original_ctx/high_freq_factor) kept, a linear blend in between."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv
    ctx = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    smooth = (ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > ctx / scaling.low_freq_factor, inv / scaling.factor, inv)
    medium = (wavelen >= ctx / scaling.high_freq_factor) & (wavelen <= ctx / scaling.low_freq_factor)
    return torch.where(medium, blended, out)


def rope_tables(head_dim: int, n_ctx: int, theta: float, scaling: RopeScaling | None = None,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (n_ctx, head_dim/2) for rotary embeddings."""
    inv = rope_frequencies(head_dim, theta, scaling, device)
    ang = torch.outer(torch.arange(n_ctx, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves (x[..., :hd/2], x[..., hd/2:]) of (B, nh, T, hd) by the position angle:
    dimension j pairs with j + hd/2, both turned by angle pos * inv_freq[j]."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_head * self.hd, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)    # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv != self.n_head
        if gqa and q.dtype == torch.float32:
            # on CUDA flash attention needs bf16/fp16 and the memory-efficient kernel takes no GQA: fp32 with
            # enable_gqa would fall to the math kernel and its (B, nh, T, T) scores. Repeating K/V (what GQA means)
            # keeps it on the efficient kernel, at (B, nh, T, hd) per layer instead (models/memory.py counts it); the
            # CPU takes the same path, so the planner's CPU checks see what a GPU holds
            k, v = (t.repeat_interleave(self.n_head // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


# -- Hugging Face checkpoints (models/hf_names.py): LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM ----------
HF_NAMES: dict[str, str] = {
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
QWEN2 = "Qwen2ForCausalLM"  # q/k/v biases (model.qkv_bias)


def _read_hf_config(d: dict, arch: str) -> dict:
    act = get_text(d, "hidden_act", "silu")
    refuse_if(act != "silu", f"hidden_act {act!r}")
    refuse_if(get_flag(d, "attention_bias", False), "attention_bias=true (biases on all four attention projections)")
    refuse_if(get_flag(d, "mlp_bias", False), "mlp_bias=true")
    d_model, n_head = get_int(d, "hidden_size", limit="d_model"), get_int(d, "num_attention_heads", limit="n_head")
    head_dim = get_int(d, "head_dim", None)
    refuse_if(head_dim not in (None, d_model // n_head) or d_model % n_head != 0,
              f"head_dim={head_dim} other than hidden_size/num_attention_heads")
    theta, rope_scaling = rope_settings(d)
    prf = get_float(get_object(d, "rope_parameters") or {}, "partial_rotary_factor",
                    get_float(d, "partial_rotary_factor", 1.0), "rope_parameters.")
    refuse_if(prf != 1.0, f"partial_rotary_factor={prf}")
    return dict(n_layer=get_int(d, "num_hidden_layers", limit="n_layer"), d_model=d_model, n_head=n_head,
                n_kv_head=get_int(d, "num_key_value_heads", n_head, limit="n_kv_head"),
                d_ff=get_int(d, "intermediate_size", limit="d_ff"),
                n_ctx=get_int(d, "max_position_embeddings", limit="n_ctx"),
                vocab_size=get_int(d, "vocab_size", limit="vocab_size"), norm_eps=get_float(d, "rms_norm_eps", 1e-6),
                rope_theta=theta, tie_embeddings=get_flag(d, "tie_word_embeddings", False), bias=False,
                qkv_bias=arch == QWEN2, rope_scaling=rope_scaling)


def _write_hf_config(cfg: ModelConfig, arch: str) -> dict:
    if cfg.qkv_bias != (arch == QWEN2):
        raise ConfigError(f"--format hf: {arch} {'has no' if cfg.qkv_bias else 'needs'} q/k/v biases "
                          f"(model.qkv_bias={str(cfg.qkv_bias).lower()})")
    out = {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
           "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
           "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
           "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
           "rope_theta": cfg.rope_theta, "rope_scaling": None}
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position_embeddings}
    if arch == "LlamaForCausalLM":
        out.update({"attention_bias": False, "mlp_bias": False})
    else:  # Mistral, Qwen2: full attention (we train without a window)
        out.update({"sliding_window": None})
        if arch == QWEN2:
            out.update({"use_sliding_window": False})
    return out


def _attention_window(d: dict, arch: str) -> int | None:
    """Mistral's sliding window, and Qwen2's where ``use_sliding_window`` says so."""
    if arch == "MistralForCausalLM" or (arch == QWEN2 and get_flag(d, "use_sliding_window", False)):
        return get_int(d, "sliding_window", None)
    return None


HF_FORMAT = HFFormat(HF_NAMES, "model.", {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                                          QWEN2: "qwen2"}, _read_hf_config, _write_hf_config,
                     default_architecture=lambda cfg: QWEN2 if cfg.qkv_bias else "LlamaForCausalLM",
                     attention_window=_attention_window)


class LLaMA(Decoder):
    residual_projections = ("wo.weight", "w2.weight")  # attention's and the MLP's output projections
    hf = HF_FORMAT

    def _make_embed(self, positions: bool) -> None:
        self.wte = nn.Embedding(self.cfg.vocab_size, self.cfg.d_model)

    def _make_layer(self) -> nn.Module:
        return Layer(self.cfg)

    def _make_head(self) -> None:
        self.ln_f = nn.RMSNorm(self.cfg.d_model, eps=self.cfg.norm_eps)
        if not self.cfg.tied:
            self.lm_head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=False)

    def _init_buffers(self) -> None:
        # RoPE tables are derived, never stored in checkpoints, and built for the longest sequence seen, not the
        # model's context (n_ctx 131072 at head_dim 128: 33 MB of tables for 1k-token rows). Row p of a table is
        # cos/sin(p * inv_freq) whatever its length, so they are bitwise the rows an n_ctx table would have had
        # (tests/test_models.py). A plain attribute, not a buffer: DDP/FSDP and .to() leave it alone; it is built on
        # the parameters' device, as the n_ctx table was, and moved to the input's.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self._init_buffers()

    def _embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)  # (B, T, C)

    # -- planner hooks (models/base.Decoder) --------------------------------------------------------------------
    @staticmethod
    def saved_bytes(cfg: ModelConfig, s: int, kind: str) -> int:
        """Residuals, the projections' inputs and the attention/SwiGLU intermediates, two RMSNorms' statistics
        (4 B each) and the attention log-sum-exp (4 B per head). fp32 attention repeats grouped K/V to the query
        heads (:class:`Attention`), so there K and V are C wide. A trainable layer: autocast casts the norm
        output once per projection that reads it (wq, wk, wv; w1, w3) and each cast is kept; a trainable RMSNorm
        gain keeps the normalized input for its own gradient (2 rC)."""
        C, F, r = cfg.d_model, cfg.ffn_dim, 4
        K = C if s == 4 else cfg.kv_heads * cfg.head_dim
        stats = 8 + 4 * cfg.n_head
        if kind == "frozen":
            return 2 * r * C + s * (2 * C + 2 * K + 3 * F) + stats
        reads = 5 * C if s == 2 else 2 * C
        return 4 * r * C + s * (3 * C + reads + 2 * K + 4 * F) + stats

    @staticmethod
    def adapter_input_bytes(cfg: ModelConfig, s: int) -> int:
        """In fp32 the two norm outputs (each shared by the maps that read it), the attention output and the SwiGLU
        product, 4(3C + F); under bf16 autocast each map casts its fp32 norm input apart (wq, wk, wv; w1, w3),
        2(6C + F)."""
        C, F = cfg.d_model, cfg.ffn_dim
        return 4 * (3 * C + F) if s == 4 else 2 * (6 * C + F)

    @staticmethod
    def infer_bytes(cfg: ModelConfig, s: int) -> int:
        """The fp32 residual in and out and the norm's fp32 output (12 C), its cast for the projections, and
        silu(w1 x), w3 x and their product (3 F) in the compute dtype."""
        return 12 * cfg.d_model + s * (cfg.d_model + 3 * cfg.ffn_dim)

    @staticmethod
    def buffer_bytes(cfg: ModelConfig) -> int:
        """The RoPE cos/sin tables, counted at n_ctx rows (built for the longest sequence seen: at most this)."""
        return 2 * 4 * cfg.n_ctx * cfg.head_dim // 2

    def _layer_extra(self, T: int, device):
        if self._rope is None or self._rope[0].size(0) < T:
            if T > self.cfg.n_ctx:
                raise ValueError(f"sequence length {T} exceeds n_ctx={self.cfg.n_ctx}")
            home = next((p.device for p in self.parameters()), torch.device("cpu"))
            self._rope = rope_tables(self.cfg.head_dim, T, self.cfg.rope_theta, self.cfg.rope_scaling, device=home)
        cos, sin = self._rope
        return cos[:T].to(device), sin[:T].to(device)
