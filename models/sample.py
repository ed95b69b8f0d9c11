"""Sampling text from a model: ``bcdflow generate`` (flows/generate.py) on a stored version.

Autoregressive, one token at a time over the whole window (no key/value cache: it is for looking at what a run
learned, not for serving), the window cut to the model's context; temperature 0 is greedy decoding.

    ids = sample(model, prompt_ids, max_new_tokens=50, temperature=0.8, top_k=50,
                 generator=torch.Generator().manual_seed(0), stop_id=eos)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from bcdflow.models.base import Decoder


@torch.no_grad()
def sample(model: Decoder, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None,
           stop_id: int | None = None, vocab: int | None = None,
           on_token: Callable[[int], None] | None = None) -> list[int]:
    """The ids ``model`` continues ``prompt`` with: at most ``max_new_tokens``, ending early at ``stop_id``
    (included). Each step draws from the softmax of the last position's logits over ``temperature`` (0: the
    most likely token), cut to the ``top_k`` most likely and to the tokenizer's ``vocab`` ids (an embedding padded
    past the tokenizer has rows no text decodes to). ``on_token`` is called with each id as it is drawn (the CLI
    prints text as it comes)."""
    if not prompt:
        raise ValueError("an empty prompt (give at least one token)")
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.n_ctx:])[0, -1, :vocab].float()  # (V,)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if nxt == stop_id:
            break
        idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    return out
