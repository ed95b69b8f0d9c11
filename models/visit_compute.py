"""What a visit computes, as pure model code (paper §3.2.2, docs/DESIGN.md §2 steps 2-3): the frozen prefix's
forward pass (pre-inference) and the visit's loss. The train task, the pre-inference task and the
benchmarks all call these, so they measure and run one computation.

A visit to the block whose layers start at ``lo`` trains on either

- token ids ``(B, T)``: the model holds the embeddings and every layer from 0; layers [0, lo) run
  under ``no_grad`` (the frozen prefix is off the gradient path), or
- pre-inferred hidden states ``(B, T, C)`` of layer ``lo``: the model holds layers >= lo and the head only.

Either way the suffix (layers lo..n and the head) runs with autograd, so the loss reaches the active block.
With ``recompute`` the frozen layers after the active block [hi, n) keep only their input for backward and
run their forward again there (``torch.utils.checkpoint``, one layer at a time): their weights need no
gradient, so what they save is pure activation memory (about 10 C per token per layer, the largest part of
block 0's peak). The gradients are bitwise those without recompute (the same kernels on the same inputs).
"""
from __future__ import annotations

import contextlib
import math
from contextlib import contextmanager
from typing import Callable, Collection

import torch
from torch.utils.checkpoint import checkpoint

from bcdflow.models.base import Decoder


def autocast(device: torch.device, precision: str):
    """bf16 autocast for the forward pass where asked; fp32 otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def prefix_hidden(model: Decoder, idx: torch.Tensor, lo: int) -> torch.Tensor:
    """The frozen prefix: (B, T) token ids -> (B, T, C) hidden states entering layer ``lo``. No autograd."""
    with torch.no_grad():
        return model.run_layers(model.embed(idx), 0, lo)


def visit_loss(model: Decoder, x: torch.Tensor, targets: torch.Tensor, lo: int, from_acts: bool,
               hi: int | None = None, recompute: bool = False, reduction: str = "mean",
               recompute_active: bool = False) -> torch.Tensor:
    """Next-token loss of a visit whose active block holds layers [lo, hi) (the mean over trained targets, or
    their sum with ``reduction="sum"``).

    ``from_acts``: ``x`` is (B, T, C) pre-inferred hidden states of layer ``lo``; else (B, T) token ids.
    ``recompute``: the frozen suffix [hi, n) is recomputed in backward instead of keeping its activations;
    ``recompute_active``: the active block's own layers [lo, hi) too (long sequences: each keeps its input only)."""
    n = model.cfg.n_layer
    if from_acts:
        h = x
    elif lo == 0:
        h = model.embed(x)  # block 0 owns the embeddings: on the gradient path
    else:  # pre-inference off: the frozen prefix runs here
        h = prefix_hidden(model, x, lo)
    hi = n if hi is None else hi
    if not (recompute and hi < n) and not recompute_active:
        return model.loss(model.run_layers(h, lo, n), targets, reduction)
    extra = model._layer_extra(h.size(1), h.device)
    for i in range(lo, n):  # a recomputed layer keeps its (B, T, C) input; the rest comes back in backward
        layer = model.h[str(i)]
        again = recompute_active if i < hi else recompute
        h = checkpoint(layer, h, extra, use_reentrant=False) if again else layer(h, extra)
    return model.loss(h, targets, reduction)


def block_grad_norms(model: Decoder, x: torch.Tensor, targets: torch.Tensor, owner: Callable[[str], int],
                     blocks: Collection[int]) -> dict[int, float]:
    """Gradient norm of each of ``blocks``'s parameters (``owner``: parameter name -> block) for the whole model's
    loss on (x, targets), computed one layer at a time, so no more than one layer's gradients ever exist: a no-grad
    forward keeps each layer's (B, T, C) input on the host, then the backward goes down the layers, each layer's
    forward run again from its input with its weights requiring grad (a streamed layer's in its slot,
    ``model.stream.pointed``). The values are those of one backward through the whole model (a tied embedding's two
    gradients are added before the norm); only the embeddings and the head, which never stream, require grad, and
    only for their own step."""
    named = dict(model.named_parameters())
    sq = {b: 0.0 for b in blocks}
    stream = getattr(model, "stream", None)

    def add(names: list[str], grads) -> None:
        for k, g in zip(names, grads):
            if owner(k) in sq:
                sq[owner(k)] += float(g.float().pow(2).sum())

    with torch.no_grad():
        h = model.embed(x)
        extra = model._layer_extra(x.size(1), h.device)
        ins = []  # each layer's (B, T, C) input, on the host: the device holds one layer's worth at a time
        for i in range(model.cfg.n_layer):
            ins.append(h.to("cpu"))
            h = model.h[str(i)](h, extra)
    head = [k for k in named if k.startswith(("ln_f.", "lm_head."))] + (["wte.weight"] if model.cfg.tied else [])
    head = [k for k in head if owner(k) in sq]
    tied = None
    with torch.enable_grad():
        h = h.detach().requires_grad_()
        with _requiring_grad([named[k] for k in head]) as ps:
            g, *grads = torch.autograd.grad(model.loss(h, targets), [h, *ps])
        if model.cfg.tied and "wte.weight" in head:
            tied = grads.pop(head.index("wte.weight"))  # completed by the embedding's gradient below
            head.remove("wte.weight")
        add(head, grads)
        for i in reversed(range(model.cfg.n_layer)):
            layer = model.h[str(i)]
            prefix = f"h.{i}."
            want = any(owner(prefix + k) in sq for k, _ in layer.named_parameters())
            names = [k for k, _ in layer.named_parameters()]
            held = (stream.pointed(i, backward=True) if stream is not None and i in stream.layout else
                    contextlib.nullcontext())
            with held, _requiring_grad(list(layer.parameters()) if want else []) as ps:
                inp = ins[i].to(h.device).requires_grad_()
                out = layer.forward(inp, extra)  # not through the stream's hooks: the layer stays pointed
                g, *grads = torch.autograd.grad(out, [inp, *ps], g)
            add([prefix + k for k in names] if want else [], grads)
            ins[i] = None
        emb = [k for k in named if k.startswith(("wte.", "wpe.")) and owner(k) in sq]
        if emb:
            with _requiring_grad([named[k] for k in emb]) as ps:
                grads = list(torch.autograd.grad(model.embed(x), ps, g))
            if tied is not None:
                grads[emb.index("wte.weight")] = grads[emb.index("wte.weight")] + tied
            add(emb, grads)
    return {b: math.sqrt(v) for b, v in sq.items()}


@contextmanager
def _requiring_grad(params: list[torch.nn.Parameter]):
    """Resident parameters (embeddings, head) requiring grad for one ``autograd.grad``, then frozen again."""
    for p in params:
        p.requires_grad_(True)
    try:
        yield params
    finally:
        for p in params:
            p.requires_grad_(False)
