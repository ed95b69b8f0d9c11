"""GPT-2 family (nanoGPT-shaped): learned positions, pre-LayerNorm, GELU MLP, head tied to wte."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bcdflow.models.base import Decoder
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


class GPT(Decoder):
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
