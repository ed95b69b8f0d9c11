"""What both families share: a decoder that can run "embed", "layers i..j" and "head" separately,
and be built with only some of its parts (a visit to block b holds layers of blocks >= b only).

Parameter names are the same in a partial model as in the whole one (layers live in a ModuleDict
keyed by their global index), so checkpoints and block plans never need renaming:
``wte.*`` ``wpe.*`` (embeddings), ``h.{i}.*`` (layer i), ``ln_f.*`` ``lm_head.*`` (head).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig

EMBED_PREFIXES = ("wte.", "wpe.")
HEAD_PREFIXES = ("ln_f.", "lm_head.")


class Decoder(nn.Module):
    """Base class; a family supplies ``_make_embed``, ``_make_layer``, ``_make_head`` and ``_embed_tokens``."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, int] | None = None,
                 embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        lo, hi = layers if layers is not None else (0, cfg.n_layer)
        assert 0 <= lo <= hi <= cfg.n_layer, (lo, hi)
        self.layer_range = (lo, hi)
        self.has_embed, self.has_head = embed, head
        # the tied head reads the token embedding, so a model with a head keeps wte too
        if embed or (head and cfg.tied):
            self._make_embed(positions=embed)
        self.h = nn.ModuleDict({str(i): self._make_layer() for i in range(lo, hi)})
        if head:
            self._make_head()

    # -- family hooks ---------------------------------------------------------------------
    def _make_embed(self, positions: bool) -> None:
        raise NotImplementedError

    def _make_layer(self) -> nn.Module:
        raise NotImplementedError

    def _make_head(self) -> None:
        raise NotImplementedError

    def _embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _layer_extra(self, T: int, device) -> object:
        """Per-forward data every layer needs (RoPE tables for llama)."""
        return None

    # -- running parts ----------------------------------------------------------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) hidden states."""
        if idx.size(1) > self.cfg.n_ctx:
            raise ValueError(f"sequence length {idx.size(1)} exceeds n_ctx={self.cfg.n_ctx}")
        return self._embed_tokens(idx)

    def run_layers(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Run layers [lo, hi) on (B, T, C) hidden states."""
        extra = self._layer_extra(x.size(1), x.device)
        for i in range(lo, hi):
            x = self.h[str(i)](x, extra)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, vocab) logits."""
        x = self.ln_f(x)
        weight = self.wte.weight if self.cfg.tied else self.lm_head.weight
        return F.linear(x, weight)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of hidden states (B, T, C) against targets (B, T)."""
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.run_layers(self.embed(idx), *self.layer_range)
        return self.head(x) if targets is None else self.loss(x, targets)

    # -- initialisation -----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)  # norm gains
            elif name.endswith(("c_proj.weight", "wo.weight", "w2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)
        self._init_buffers()

    def _init_buffers(self) -> None:
        """Recompute non-persistent buffers (after a meta-device build)."""
