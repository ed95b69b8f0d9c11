"""The visit's computation in models/: the chunked loss over the vocabulary (no full logits), recompute of the
frozen suffix, and frozen weights stored in bf16 (docs/DESIGN.md I6), on the CPU.

    python -m pytest -q tests/test_visit_compute.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import LiveBytes
from bcdflow.models import build_model, get_config, model_plan
from bcdflow.constants import IGNORE_INDEX
from bcdflow.models.base import chunked_cross_entropy
from bcdflow.models.build import frozen_in
from bcdflow.models.visit_compute import autocast, visit_loss

FAMILIES = {"gpt": ("tiny", {}), "llama": ("tiny-llama", {})}


def small(family: str, **over):
    name, base = FAMILIES[family]
    return get_config(name, **{"d_model": 64, "n_head": 4, "vocab_size": 512, **base, **over})


def batch(cfg, B=3, T=24, masked=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(cfg.vocab_size, (B, T), generator=g)
    if masked:  # supervised fine-tuning masks prompt tokens: whole rows and scattered positions
        y[0, :10] = IGNORE_INDEX
        y[2, ::3] = IGNORE_INDEX
    return x, y


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("rows", [1, 7, 32, 10_000])
def test_chunked_loss_equals_full_cross_entropy_with_equal_gradients(family, rows):
    torch.manual_seed(0)
    cfg = small(family, tie_embeddings=family == "gpt")
    model = build_model(cfg)
    x, y = batch(cfg)
    h = model.run_layers(model.embed(x), 0, cfg.n_layer)
    full = F.cross_entropy(model.head(h).float().view(-1, cfg.vocab_size), y.reshape(-1))  # ignore_index -100
    g_full = grads_of(model, full)
    model.loss_chunk_rows = rows
    chunked = model(x, y)
    g_chunk = grads_of(model, chunked)
    assert abs(full.item() - chunked.item()) <= 1e-6
    assert g_full.keys() == g_chunk.keys()
    for n in g_full:
        assert torch.allclose(g_full[n], g_chunk[n], atol=1e-6, rtol=0), n
    # the mean is over trained targets only; the sum is the mean times their count
    total = model.loss(h.detach(), y, reduction="sum")
    assert total.item() == pytest.approx(chunked.item() * int((y != IGNORE_INDEX).sum()), rel=1e-6)


def test_chunked_loss_never_holds_the_full_logits():
    V, N, C, rows = 4096, 512, 32, 64
    torch.manual_seed(0)
    h = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V, C, requires_grad=True)
    y = torch.randint(V, (N,))
    with LiveBytes() as tr:
        loss = chunked_cross_entropy(h, w, y, rows)
        loss.backward()
    # one chunk of fp32 logits (rows x V) plus the two gradients; the full logits alone are N x V x 4 = 8 MB
    logits = N * V * 4
    assert tr.peak < logits / 2, (tr.peak, logits)
    assert tr.peak < 1.5 * (rows * V * 4 + h.numel() * 4 + w.numel() * 4 * 2)


def test_chunked_loss_without_gradients_and_all_targets_ignored():
    cfg = small("gpt")
    model = build_model(cfg).eval()
    x, y = batch(cfg)
    with torch.no_grad():
        a = model(x, y)
        model.loss_chunk_rows = 5
        b = model(x, y)
    assert abs(a.item() - b.item()) <= 1e-6
    y[:] = IGNORE_INDEX
    with torch.no_grad():  # like F.cross_entropy: nothing to average is NaN (evaluate_model skips such batches)
        assert torch.isnan(model(x, y))


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("block,from_acts", [(0, False), (1, True), (1, False)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_gives_bitwise_the_same_gradients(family, block, from_acts, precision):
    torch.manual_seed(0)
    cfg = small(family)
    plan = model_plan(cfg, 3)
    lo, hi = plan.visits[block].layers
    model = build_model(cfg)
    active = set(plan.visits[block].params)
    for n, p in model.named_parameters():
        p.requires_grad_(n in active)
    if precision == "bf16":
        frozen_in(model, torch.bfloat16, active)
    x, y = batch(cfg)
    if from_acts:
        with torch.no_grad(), autocast(torch.device("cpu"), precision):
            x = model.run_layers(model.embed(x), 0, lo).float()

    def grads(recompute: bool):
        with autocast(torch.device("cpu"), precision):
            loss = visit_loss(model, x, y, lo, from_acts, hi=hi, recompute=recompute)
        return loss.detach(), grads_of(model, loss)

    (l0, g0), (l1, g1) = grads(False), grads(True)
    assert hi < cfg.n_layer and torch.equal(l0, l1)
    assert g0.keys() == g1.keys() == active
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_frozen_weights_in_bf16_compute_what_fp32_storage_computes(family):
    """Under bf16 autocast, a frozen layer stored in bf16 runs the same matmuls as one stored in fp32 (autocast
    rounds the fp32 weight to the same bf16 values), so the visit's loss and the active block's gradients agree
    to rounding; only the embedding tables read rounded values."""
    torch.manual_seed(0)
    cfg = small(family)
    plan = model_plan(cfg, 3)
    block = 1
    lo, hi = plan.visits[block].layers
    active = set(plan.visits[block].params)
    ref = build_model(cfg)
    low = build_model(cfg, init=False, frozen_dtype=torch.bfloat16, trainable=active)
    low.load_state_dict(ref.state_dict())
    for m in (ref, low):
        for n, p in m.named_parameters():
            p.requires_grad_(n in active)
    dtypes = {n: p.dtype for n, p in low.named_parameters()}
    assert all(dtypes[n] == torch.float32 for n in active)  # fp32 master weights for the active block
    frozen_mats = [n for n, p in low.named_parameters() if n not in active and p.dim() >= 2]
    assert frozen_mats and all(dtypes[n] == torch.bfloat16 for n in frozen_mats)
    assert all(dtypes[n] == torch.float32 for n, p in low.named_parameters() if p.dim() == 1)
    x, y = batch(cfg)
    out = []
    for m in (ref, low):
        with autocast(torch.device("cpu"), "bf16"):
            h = m.run_layers(m.embed(x), 0, lo)  # the frozen prefix, pre-inference off
            loss = visit_loss(m, h.detach(), y, lo, True, hi=hi)
        out.append((loss.detach(), grads_of(m, loss)))
    (l_ref, g_ref), (l_low, g_low) = out
    assert abs(l_ref.item() - l_low.item()) < 2e-2
    for n in g_ref:
        rel = (g_ref[n] - g_low[n]).norm() / g_ref[n].norm()
        assert rel < 0.05, (n, rel.item())
    # with the same bf16-rounded embedding input, the frozen suffix is bitwise what fp32 storage computes
    with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
        h = low.run_layers(low.embed(x), 0, lo).detach()
    with autocast(torch.device("cpu"), "bf16"):
        a = visit_loss(ref, h, y, lo, True, hi=hi)
        b = visit_loss(low, h, y, lo, True, hi=hi)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_visit_loss_is_the_whole_model_loss_at_every_cut(family):
    """Whatever block is active, from stored activations (pre-inference) or through the frozen prefix, the
    visit computes the whole model's loss and the whole model's gradients of its block: an independent check of
    the prefix (I2 compares pre-inference on with off, which share it)."""
    from bcdflow.models.visit_compute import prefix_hidden

    torch.manual_seed(0)
    cfg = small(family, n_layer=4)
    model = build_model(cfg)
    x, y = batch(cfg)
    whole = model(x, y)
    g_whole = grads_of(model, whole)
    for lo in range(1, cfg.n_layer):
        block = {n for n in g_whole if n.startswith((f"h.{lo}.", f"layers.{lo}."))}
        assert block, lo
        for from_acts in (True, False):
            inp = prefix_hidden(model, x, lo) if from_acts else x
            loss = visit_loss(model, inp, y, lo, from_acts, hi=lo + 1)
            assert abs(loss.item() - whole.item()) <= 1e-6, (lo, from_acts)
            g = grads_of(model, loss)
            for n in block:
                assert torch.allclose(g[n], g_whole[n], atol=1e-6, rtol=0), (lo, from_acts, n)
