"""GPT-2 family (nanoGPT-shaped): learned positions, pre-LayerNorm, GELU MLP, head tied to wte."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from bcdflow.models.base import Decoder
from bcdflow.models.errors import ConfigError
from bcdflow.models.hf_names import HFFormat, get_flag, get_float, get_int, get_text, refuse_if
from bcdflow.models.model_config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hd)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, extra=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# -- Hugging Face checkpoints (models/hf_names.py): GPT2LMHeadModel ---------------------------------------------
HF_NAMES: dict[str, str] = {
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
# HF stores the four projection weights as Conv1D ([in, out]); ours are nn.Linear ([out, in])
_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _read_hf_config(d: dict, arch: str) -> dict:
    act = get_text(d, "activation_function", "gelu_new")
    refuse_if(act not in ("gelu_new", "gelu_pytorch_tanh"), f"GPT-2 activation_function {act!r}")
    refuse_if(not get_flag(d, "scale_attn_weights", True), "GPT-2 scale_attn_weights=false")
    refuse_if(get_flag(d, "scale_attn_by_inverse_layer_idx", False), "GPT-2 scale_attn_by_inverse_layer_idx")
    refuse_if(get_flag(d, "add_cross_attention", False), "GPT-2 add_cross_attention")
    return dict(n_layer=get_int(d, "n_layer", limit="n_layer"), d_model=get_int(d, "n_embd", limit="d_model"),
                n_head=get_int(d, "n_head", limit="n_head"), d_ff=get_int(d, "n_inner", None, limit="d_ff"),
                n_ctx=get_int(d, "n_positions" if "n_positions" in d else "n_ctx", limit="n_ctx"),
                vocab_size=get_int(d, "vocab_size", limit="vocab_size"),
                norm_eps=get_float(d, "layer_norm_epsilon", 1e-5),
                tie_embeddings=get_flag(d, "tie_word_embeddings", True), bias=True)


def _write_hf_config(cfg: ModelConfig, arch: str) -> dict:
    if not cfg.bias:
        raise ConfigError("--format hf: GPT2LMHeadModel always has biases; this run has model.bias=false")
    return {"n_layer": cfg.n_layer, "n_embd": cfg.d_model, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
            "n_positions": cfg.n_ctx, "n_ctx": cfg.n_ctx, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0}  # our model has no dropout


HF_FORMAT = HFFormat(HF_NAMES, "transformer.", {"GPT2LMHeadModel": "gpt2"}, _read_hf_config, _write_hf_config,
                     default_architecture=lambda cfg: "GPT2LMHeadModel",
                     transposed=lambda name: bool(_CONV1D.match(name)))


class GPT(Decoder):
    residual_projections = ("c_proj.weight",)  # attention's and the MLP's output projections
    hf = HF_FORMAT

    def _make_embed(self, positions: bool) -> None:
        self.wte = nn.Embedding(self.cfg.vocab_size, self.cfg.d_model)
        if positions:
            self.wpe = nn.Embedding(self.cfg.n_ctx, self.cfg.d_model)

    def _make_layer(self) -> nn.Module:
        return Layer(self.cfg)

    def _make_head(self) -> None:
        self.ln_f = nn.LayerNorm(self.cfg.d_model, eps=self.cfg.norm_eps, bias=self.cfg.bias)
        if not self.cfg.tied:
            self.lm_head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=False)

    def _embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.wte(idx).float() + self.wpe(pos).float()  # (B, T, C) fp32, whatever the tables are stored in

    # -- planner hooks (models/base.Decoder) --------------------------------------------------------------------
    @staticmethod
    def saved_bytes(cfg: ModelConfig, s: int, kind: str) -> int:
        """Two fp32 residuals, the matrices' inputs and the attention/MLP intermediates in the compute dtype, two
        LayerNorms' statistics (8 B each) and the attention log-sum-exp (4 B per head)."""
        C, F = cfg.d_model, cfg.ffn_dim
        mats = 7 * C + 2 * F if kind == "trainable" else 4 * C + F
        return 2 * 4 * C + s * mats + 16 + 4 * cfg.n_head

    @staticmethod
    def adapter_input_bytes(cfg: ModelConfig, s: int) -> int:
        """ln_1's and ln_2's outputs, the attention output, the GELU output: s(3C + F)."""
        return s * (3 * cfg.d_model + cfg.ffn_dim)

    @staticmethod
    def infer_bytes(cfg: ModelConfig, s: int) -> int:
        """The fp32 residual in and out and the norm's fp32 output (12 C), its cast for the projections, and
        c_fc's output and its gelu (2 F) in the compute dtype."""
        return 12 * cfg.d_model + s * (cfg.d_model + 2 * cfg.ffn_dim)
