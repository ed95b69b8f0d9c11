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

from bcdflow.constants import IGNORE_INDEX
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.rows import trained_rows
# the loss over the vocabulary runs in row chunks whose fp32 logits take about this many bytes: never the
# (B*T, V) logits and their gradient at once (gpt2-124m at 8x1024: 1.6 GB of fp32 logits -> 128 MB)
LOSS_CHUNK_BYTES = 128 << 20


def loss_chunk_rows(vocab_size: int, rows: int | None = None) -> int:
    """Rows per chunk of the chunked loss: ``rows`` if given, else as many as fit LOSS_CHUNK_BYTES of fp32 logits."""
    return int(rows) if rows else max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul of ``t`` in (the lower precision when autocast is on)."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of next-token cross-entropies of normed hidden states ``h`` (N, C) under a head ``weight`` (V, C),
    computed ``rows`` rows at a time; targets equal to IGNORE_INDEX count zero.

    Forward computes each chunk's logits (rows, V), its loss and, when asked for, the gradients with respect to
    ``h`` and ``weight`` right away (softmax - one-hot, through the head's two matmuls), then drops the chunk: no
    (N, V) tensor ever exists, and backward only scales the stored gradients. Matmuls run in ``dtype`` (bf16
    under autocast, as F.linear would), softmax and the loss in fp32."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows: int, dtype: torch.dtype, part=None, first: int = 0):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_p = part is not None and ctx.needs_input_grad[5]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
        # a row block's slice (models/rows.py): the gradient of its rows alone, in its own (master) dtype
        grad_p = torch.zeros(part.shape, dtype=part.dtype, device=part.device) if need_p else None
        last = first + part.size(0) if need_p else 0
        w = weight.to(dtype)  # (V, C); a no-op when the weight is already in the compute dtype
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, h.size(0), rows):
                hc, y = h[lo:lo + rows].to(dtype), targets[lo:lo + rows]  # (n, C), (n,)
                logits = (hc @ w.t()).float()  # (n, V) fp32; the dtype copy is freed here
                valid = y != IGNORE_INDEX
                safe = y.masked_fill(~valid, 0).unsqueeze(1)  # (n, 1)
                picked = logits.gather(1, safe).squeeze(1)  # (n,) target logits
                top = logits.amax(dim=1, keepdim=True)  # (n, 1)
                p = logits.sub_(top).exp_()  # in place: exp(logit - max)
                norm = p.sum(dim=1)  # (n,)
                nll = top.squeeze(1) + norm.log() - picked
                total += nll.masked_fill(~valid, 0.0).sum()
                if need_h or need_w or need_p:
                    p.div_(norm.unsqueeze(1))  # softmax
                    p.scatter_add_(1, safe, -valid.unsqueeze(1).to(p.dtype))  # minus the one-hot of the target
                    p.mul_(valid.unsqueeze(1))  # an ignored row has no gradient
                    g = p.to(dtype)  # (n, V) d(sum of losses)/d(logits)
                    if need_h:
                        grad_h[lo:lo + rows] = g @ w
                    if need_w:
                        grad_w += g.t() @ hc  # (V, C), accumulated in the weight's (fp32 master) dtype
                    if need_p:
                        grad_p += g[:, first:last].t() @ hc  # (last - first, C): the slice's rows only
                del logits, p
        ctx.grads = grad_h, grad_w, grad_p
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_p = ctx.grads
        del ctx.grads  # the returned tensors are then the only references: autograd can reuse their memory
        return (grad_h * grad_out if grad_h is not None else None,
                grad_w * grad_out if grad_w is not None else None, None, None, None,
                grad_p * grad_out if grad_p is not None else None, None)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                          reduction: str = "mean", part: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``targets`` (IGNORE_INDEX masked), ``rows`` rows at a time.

    ``h`` (N, C), ``weight`` (V, C), ``targets`` (N,). ``reduction="mean"`` divides by the count of trained
    (non-ignored) targets, as ``F.cross_entropy`` does; ``"sum"`` returns the sum (distributed visits scale it by
    the global count). ``part``: a row block's trained slice ``(rows, lo)`` of a frozen ``weight`` whose rows
    [lo, lo + len(rows)) hold its values: only the slice gets a gradient, computed for its rows alone."""
    dtype = _compute_dtype(h)
    sl, first = part if part is not None else (None, 0)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad or sl is not None):
        total = _ChunkedHeadLoss.apply(h, weight, targets, rows, dtype, sl, first)
    else:
        total = _ChunkedHeadLoss.forward(_NoGradCtx(), h, weight, targets, rows, dtype)
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum()


class _NoGradCtx:
    needs_input_grad = (False, False, False, False, False, False, False)



class Decoder(nn.Module):
    """Base class; a family supplies ``_make_embed``, ``_make_layer``, ``_make_head`` and ``_embed_tokens``, the
    planner hooks below, ``residual_projections`` and, to read and write Hugging Face checkpoints, ``hf``."""

    residual_projections: tuple[str, ...] = ()
    """Name suffixes of the layers' output projections into the residual stream, initialised scaled by
    1/sqrt(2 * n_layer) (GPT-2's init)."""
    hf = None
    """The family's Hugging Face format (``models/hf_names.HFFormat``), or None when it reads no checkpoints."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, int] | None = None,
                 embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        lo, hi = layers if layers is not None else (0, cfg.n_layer)
        assert 0 <= lo <= hi <= cfg.n_layer, (lo, hi)
        self.layer_range = (lo, hi)
        self.loss_chunk_rows: int | None = None
        """Rows per chunk of the loss over the vocabulary; None = LOSS_CHUNK_BYTES of fp32 logits per chunk."""
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

    # -- planner hooks: a family's bytes per token (models/memory.py), C = d_model, F = ffn_dim, s = the compute
    # dtype's bytes (2 under bf16 autocast, else 4), residual stream and norm statistics in fp32 ------------------
    @staticmethod
    def saved_bytes(cfg: ModelConfig, s: int, kind: str) -> int:
        """Bytes per token one layer saves for its backward: ``trainable`` (its weights get gradients) or
        ``frozen`` (on the gradient path, only the input gradient)."""
        raise NotImplementedError

    @staticmethod
    def adapter_input_bytes(cfg: ModelConfig, s: int) -> int:
        """Bytes per token the inputs of one layer's linear maps take when ``bcd.expand`` adapts them (the ``A``
        gradient needs each map's input; maps reading the same tensor share it)."""
        raise NotImplementedError

    @staticmethod
    def infer_bytes(cfg: ModelConfig, s: int) -> int:
        """Bytes per token alive at the peak of one layer's no-grad forward."""
        raise NotImplementedError

    @staticmethod
    def buffer_bytes(cfg: ModelConfig) -> int:
        """Bytes of derived tables the model keeps beside its weights (none unless the family has some)."""
        return 0

    # -- running parts ----------------------------------------------------------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) hidden states (fp32: the residual stream stays fp32 even when frozen
        embeddings are stored in bf16)."""
        if idx.size(1) > self.cfg.n_ctx:
            raise ValueError(f"sequence length {idx.size(1)} exceeds n_ctx={self.cfg.n_ctx}")
        return self._embed_tokens(idx).float()

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

    def loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy of hidden states (B, T, C) against targets (B, T): the mean over trained
        (non-ignored) targets, or their sum. The head and the loss run over ``loss_chunk_rows`` rows at a time,
        so the (B*T, V) logits never exist (equal to ``F.cross_entropy(self.head(x), ...)`` to float rounding)."""
        h = self.ln_f(x)  # (B, T, C)
        module = self.wte if self.cfg.tied else self.lm_head
        rows = loss_chunk_rows(self.cfg.vocab_size, self.loss_chunk_rows)
        if (held := trained_rows(module)) is not None:  # a row block: the frozen matrix and its trained slice
            weight, part = held
            return chunked_cross_entropy(h.reshape(-1, h.size(-1)), weight, targets.reshape(-1), rows, reduction,
                                         part)
        return chunked_cross_entropy(h.reshape(-1, h.size(-1)), module.weight, targets.reshape(-1), rows,
                                     reduction)

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
            elif name.endswith(self.residual_projections):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)
        self._init_buffers()

    def _init_buffers(self) -> None:
        """Recompute non-persistent buffers (after a meta-device build)."""
