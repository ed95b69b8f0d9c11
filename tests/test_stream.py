"""Frozen layers streamed from host memory (``train.offload=stream``, models/stream.py; docs/DESIGN.md I6): a streamed
visit computes what a resident one does, bit for bit, on the CPU, and holds at most its window of frozen layers
on the device at once.

    python -m pytest -q tests/test_stream.py
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from bcdflow.core.context import RunContext
from bcdflow.models import build_model, get_config, model_plan
from bcdflow.models.memory import visit_memory
from bcdflow.models.stream import LayerStream
from bcdflow.models.visit import visit_loss
from bcdflow.storage.checkpoints import load_from_manifest
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import train_block
from tests.test_invariants import new_run


def _frozen_but(model, lo: int, hi: int) -> list[int]:
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(tuple(f"h.{i}." for i in range(lo, hi))))
    return [i for i in range(model.cfg.n_layer) if not lo <= i < hi]


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("window", [1, 2])
def test_streamed_loss_and_gradients_are_the_resident_ones(family, recompute, window):
    torch.manual_seed(0)
    cfg = get_config(family, vocab_size=512)
    resident = build_model(cfg)
    streamed = copy.deepcopy(resident)
    lo, hi = 2, 4  # prefix [0, 2) under no_grad, suffix [4, 6) on the gradient path
    _frozen_but(resident, lo, hi)
    stream = LayerStream(streamed, _frozen_but(streamed, lo, hi), "cpu", window=window)
    x, y = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
    for _ in range(2):  # a second step reuses the window the first one left
        ref = visit_loss(resident, x, y, lo, False, hi=hi, recompute=recompute)
        ref.backward()
        with stream.saving():
            got = visit_loss(streamed, x, y, lo, False, hi=hi, recompute=recompute)
        got.backward()
        assert torch.equal(ref, got)
        del ref, got  # as the step loop does: the graph (what recompute re-ran) goes with the step
    grads = {n: p.grad for n, p in resident.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == {n for n, p in streamed.named_parameters() if p.grad is not None}
    for n, p in streamed.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n
    # instrumented: device copies are tracked by finalizers, so this counts what was really alive, not the cache
    assert stream.peak_live <= max(window, 1 + recompute), stream.peak_live
    held = [i for i in stream.order if any(p.numel() for p in streamed.h[str(i)].parameters())]
    assert len(held) <= window and set(held) <= set(stream.live)  # between steps: the window, nothing else
    stream.release()
    assert all(p.numel() == 0 for i in stream.order for p in streamed.h[str(i)].parameters())


def _visit(cfg, ds_id: str, block: int):
    ctx = RunContext.of(cfg, "r", ds_id)
    if ctx.from_acts(block):
        for s in plan_shards.fn(ctx, 0, block):
            preinfer_shard.fn(ctx, 0, block, 0, s)
    return train_block.fn(ctx, 0, block, 0)


@pytest.mark.parametrize("block", [0, 1])
@pytest.mark.parametrize("extra", [[], ["bcd.recompute=on"], ["model.name=tiny-llama", "bcd.preinfer=false"]])
def test_a_streamed_visit_commits_the_resident_block_bitwise(tiny_cfg, block, extra):
    """Through the train task, from tokens (block 0, or pre-inference off) and from stored activations."""
    out = {}
    for offload in ("off", "stream"):
        cfg = tiny_cfg(*extra, f"train.offload={offload}", f"store={tiny_cfg().store}-{offload}")
        ds_id = new_run(cfg)
        out[offload] = _visit(cfg, ds_id, block)
        out[offload + "-tensors"] = load_from_manifest(Store(cfg.store), "r", {"blocks": {str(block): out[offload].block_file}})
    off, on = out["off"], out["stream"]
    assert off.streamed == 0 and on.streamed > 0
    assert (off.first_loss, off.train_loss, off.val_points) == (on.first_loss, on.train_loss, on.val_points)
    assert off.block_file["sha256"] == on.block_file["sha256"]


def test_the_planner_counts_a_window_of_streamed_layers():
    cfg = get_config("tiny", vocab_size=512)
    plan = model_plan(cfg, 3)
    resident = visit_memory(cfg, plan, 0, 4, 32, "bf16")
    streamed = visit_memory(cfg, plan, 0, 4, 32, "bf16", stream=True, window=1)
    part = build_model(cfg, layers=(5, 6), embed=False, head=False, init=False, frozen_dtype=torch.bfloat16)
    layer = sum(p.numel() * p.element_size() for p in part.parameters())  # as a bf16 visit holds a frozen layer
    frozen = len([i for i in range(cfg.n_layer) if i >= plan[0].layers[1]])
    assert streamed.streamed_layers == frozen and streamed.host_bytes > 0
    assert resident.weights - streamed.weights == (frozen - 1) * layer
    assert streamed.host_bytes == frozen * layer
    assert streamed.copy_bytes == 2 * streamed.host_bytes  # in for the forward, again for the backward


def test_offload_stream_is_refused_with_several_processes(tiny_cfg):
    from bcdflow.models.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.offload: "):
        tiny_cfg("train.offload=stream", "train.gpus=2")


def test_streaming_more_than_the_host_holds_is_refused_before_anything_is_written(tmp_path, capsys):
    from bcdflow.flows.cli import main

    store = tmp_path / "s"
    sets = ["model.name=L-23B", "train.offload=stream", "data.seq_len=32", "tracking_uri=none"]
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--store", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.offload: stream" in err[0] and "GB available" in err[0], err
    assert not store.exists()


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
def test_recomputing_the_active_block_gives_the_same_gradients(family):
    """``bcd.recompute=all``: the active block's own layers are checkpointed too (long sequences)."""
    torch.manual_seed(0)
    cfg = get_config(family, vocab_size=512)
    plain = build_model(cfg)
    again = copy.deepcopy(plain)
    x, y = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
    for model, kw in ((plain, {}), (again, {"recompute": True, "recompute_active": True})):
        _frozen_but(model, 2, 4)
        visit_loss(model, x, y, 2, False, hi=4, **kw).backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), again.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
    est = {a: visit_memory(cfg, model_plan(cfg, 3), 1, 4, 64, recompute=True, recompute_active=a) for a in (0, 1)}
    assert est[1].activations < est[0].activations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streamed_step_equals_resident_and_holds_less():
    """On a GPU: copies on the side stream, prefetch and the window; the same loss, gradients to float rounding
    (a CUDA kernel may pick another algorithm), and a lower allocator peak."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = get_config("tiny-llama", vocab_size=4096, n_layer=8, d_model=512, n_head=8, n_kv_head=2)
    host = build_model(cfg)
    lo, hi = 2, 4
    frozen = _frozen_but(host, lo, hi)
    x, y = torch.randint(0, 4096, (4, 256), device=dev), torch.randint(0, 4096, (4, 256), device=dev)
    out = {}
    for mode in ("resident", "stream"):
        model = copy.deepcopy(host)
        stream = LayerStream(model, frozen, dev, window=2) if mode == "stream" else None
        model.to(dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)  # the peak counts the resident weights, not the host copies
        with stream.saving() if stream else contextlib.nullcontext():
            loss = visit_loss(model, x, y, lo, False, hi=hi)
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        out[mode] = (float(loss), grads, torch.cuda.max_memory_allocated(dev))
        del model, stream, loss
    (l0, g0, p0), (l1, g1, p1) = out["resident"], out["stream"]
    assert l0 == l1 and g0.keys() == g1.keys()
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-6) for n in g0)
    assert p1 < p0, (p0, p1)
