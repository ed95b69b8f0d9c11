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
from bcdflow.models.visit_compute import visit_loss
from bcdflow.storage.checkpoints import load_from_manifest
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import train_block
from tests.helpers import new_run


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
    stream = LayerStream(streamed, _frozen_but(streamed, lo, hi), "cpu", window=window, grad_from=lo)
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
    # every streamed weight was computed from one of the window's slots: the device holds window slots, whatever
    # the number of streamed layers (the slots live all along, so no other allocation can share their addresses)
    assert len(stream.slots) == window and stream.storages == {s.untyped_storage().data_ptr() for s in stream.slots}
    assert stream.device_bytes == window * stream.slot_bytes
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


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("block,preinfer,part", [(0, True, "all"), (1, True, "some"), (1, False, "all"),
                                                  (1, False, "some")])
def test_the_planner_counts_the_streams_slots_host_buffers_and_copies(family, block, preinfer, part):
    """What the planner says a streamed visit holds is what LayerStream allocates and copies, on the CPU through the
    same slots and slot plan as on CUDA: host bytes (flat buffers as allocated), device bytes (window slots in place
    of the streamed layers) and the bytes copied per steady-state step; with every frozen layer streamed and with a
    part of them (partial residency)."""
    from bcdflow.models.holding import streamed_choice

    torch.manual_seed(0)
    cfg = get_config(family, vocab_size=512, n_layer=8)
    plan = model_plan(cfg, 3)
    lo, hi = plan[block].layers
    active = plan[block].trainable((), cfg.tied)
    held_lo = lo if plan[block].reads_activations(preinfer) else 0
    base = visit_memory(cfg, plan, block, 2, 16, "bf16", preinfer=preinfer)
    frozen = sorted(base.layer_sizes)
    layers = frozen if part == "all" else list(streamed_choice(frozen, lo, len(frozen) - 2))
    est = visit_memory(cfg, plan, block, 2, 16, "bf16", preinfer=preinfer, streamed=layers, window=2)
    model = build_model(cfg, layers=(held_lo, cfg.n_layer), embed=held_lo == 0, head=True)
    from bcdflow.models.build import frozen_in
    frozen_in(model, torch.bfloat16, active)
    for n_, p in model.named_parameters():
        p.requires_grad_(n_ in active)
    resident_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    stream = LayerStream(model, layers, "cpu", window=2, grad_from=lo)
    model.stream = stream
    assert stream.host_bytes == est.host_bytes == sum(h.numel() for h in stream.host.values())
    assert est.weights - base.weights == stream.device_bytes - sum(base.layer_sizes[i][0] for i in layers)
    on = sum(p.numel() * p.element_size() for p in model.parameters()) + stream.device_bytes
    assert on == resident_weights - sum(base.layer_sizes[i][0] for i in layers) + stream.device_bytes
    x = (torch.randn(2, 16, cfg.d_model) if held_lo else torch.randint(0, 512, (2, 16)))
    y = torch.randint(0, 512, (2, 16))
    copied = []
    for _ in range(3):
        before = stream.bytes_copied
        with torch.autocast("cpu", torch.bfloat16), stream.saving():
            loss = visit_loss(model, x, y, lo, bool(held_lo), hi=hi)
        loss.backward()
        copied.append(stream.bytes_copied - before)
    assert copied[1] == copied[2] == est.copy_bytes, (copied, est.copy_bytes)  # the steady state the planner counts
    assert stream.storages == {s.untyped_storage().data_ptr() for s in stream.slots}


def test_a_partly_streamed_visit_commits_the_resident_block_bitwise(tiny_cfg, monkeypatch):
    """train.offload=auto under a budget between the resident visit and the fully streamed one: some frozen layers
    stay resident, the fewest that fit stream, and the visit's losses and block are the resident visit's, bitwise."""
    sets = ["model.n_layer=8", "bcd.recompute=off"]
    cfg = tiny_cfg(*sets, f"store={tiny_cfg().store}-off", "train.offload=off")
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    base = visit_memory(ctx.model_cfg, ctx.plan, 0, cfg.train.batch_size, ctx.dataset.seq_len, "fp32")
    raw, flat = next(iter(base.layer_sizes.values()))
    budget = base.peak - 3.5 * raw + 2 * flat  # 4 streamed layers fit, 3 do not
    monkeypatch.setattr(RunContext, "budget", lambda self: None if self.cfg.train.offload == "off" else budget)
    off = _visit(cfg, ctx.dataset_id, 0)
    cfg_auto = tiny_cfg(*sets, f"store={tiny_cfg().store}-auto", "train.offload=auto")
    auto_ctx = RunContext.of(cfg_auto, "r", new_run(cfg_auto))
    held = auto_ctx.holding(0)
    assert 0 < len(held.streamed) == 4 < held.frozen and held.estimate.peak <= budget
    on = _visit(cfg_auto, auto_ctx.dataset_id, 0)
    assert off.streamed == 0 and on.streamed == 4
    assert (off.first_loss, off.train_loss, off.val_points) == (on.first_loss, on.train_loss, on.val_points)
    assert off.block_file["sha256"] == on.block_file["sha256"]


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
    assert len(err) == 1 and "train.offload: the streamed frozen layers" in err[0] and "GB available" in err[0], err
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
        stream = LayerStream(model, frozen, dev, window=2, grad_from=lo) if mode == "stream" else None
        model.to(dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)  # the peak counts the resident weights, not the host copies
        with stream.saving() if stream else contextlib.nullcontext():
            loss = visit_loss(model, x, y, lo, False, hi=hi)
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        out[mode] = (float(loss), grads, torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev))
        if stream:
            assert stream.storages == {s.untyped_storage().data_ptr() for s in stream.slots}
            stream.close()
        del model, stream, loss
        torch.cuda.empty_cache()
    (l0, g0, p0, r0), (l1, g1, p1, r1) = out["resident"], out["stream"]
    assert l0 == l1 and g0.keys() == g1.keys()
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-6) for n in g0)
    assert p1 < p0 and r1 < r0, (p0, p1, r0, r1)  # reserved too: what the card holds


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
def test_greedy_gradient_norms_one_layer_at_a_time_are_the_whole_backwards(family):
    """``bcd.order=greedy``'s probe (models/visit_compute.block_grad_norms): every block's gradient norm, taken one layer at
    a time with streamed layers in their slots, equals a whole fp32 backward's (a tied embedding's two parts added)."""
    from bcdflow.models.visit_compute import block_grad_norms

    torch.manual_seed(0)
    cfg = get_config(family, vocab_size=512)
    model = build_model(cfg).requires_grad_(False)
    ref = copy.deepcopy(model).requires_grad_(True)
    plan = model_plan(cfg, 3)
    x, y = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    ref(x, y).backward()
    grads = dict(ref.named_parameters())
    want = {b: float(torch.sqrt(sum((grads[n].grad.float() ** 2).sum() for n in plan[b].params))) for b in range(3)}
    model.stream = LayerStream(model, [1, 2, 4], "cpu", window=2)
    got = block_grad_norms(model, x, y, plan.owner, range(3))
    assert all(abs(got[b] - want[b]) <= 1e-6 * want[b] for b in range(3)), (got, want)
    assert not any(p.requires_grad for p in model.parameters())
