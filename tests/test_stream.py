"""Frozen layers streamed from host memory (``train.offload=stream``, models/stream.py; docs/DESIGN.md I6): a streamed
visit computes what a resident one does, bit for bit, on the CPU, and holds at most its window of frozen layers
on the device at once.

    python -m pytest -q tests/test_stream.py
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from bcdflow.core.context import RunContext
from bcdflow.models import build_model, get_config, model_plan
from bcdflow.models.memory import visit_memory
from bcdflow.models.specs import StepShape
from bcdflow.models.stream import LayerStream
from bcdflow.models.visit_compute import visit_loss
from bcdflow.storage.checkpoints import load_from_manifest
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import train_block
from bcdflow.core.rules import VisitSpec
from tests.helpers import new_run


def _frozen_but(model, lo: int, hi: int) -> list[int]:
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(tuple(f"h.{i}." for i in range(lo, hi))))
    return [i for i in range(model.cfg.n_layer) if not lo <= i < hi]


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_streamed_loss_and_gradients_are_the_resident_ones(family, recompute, window, device):
    """``cpu:0`` stands for a GPU's device as ``train.device=auto`` named it: an index in the name, none in what
    tensors report (``cuda`` against ``cuda:0`` is the same mismatch the other way round). A device comparison that
    an index breaks packs no streamed weight, and the backward reads emptied placeholders or overwritten slots."""
    torch.manual_seed(0)
    cfg = get_config(family, vocab_size=512)
    resident = build_model(cfg)
    streamed = copy.deepcopy(resident)
    lo, hi = 2, 4  # prefix [0, 2) under no_grad, suffix [4, 6) on the gradient path
    _frozen_but(resident, lo, hi)
    stream = LayerStream(streamed, _frozen_but(streamed, lo, hi), device, window=window, grad_from=lo)
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
    return train_block.fn(ctx, VisitSpec(0, block, 0))


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


@pytest.mark.parametrize("block,extra", [
    (0, ["bcd.recompute=off"]), (0, ["bcd.recompute=on"]), (0, ["bcd.recompute=off", "bcd.expand=lora"]),
    (0, ["bcd.recompute=on", "bcd.expand=lora", "model.name=tiny-llama"]), (1, ["bcd.recompute=off", "bcd.expand=lora"]),
    # a row block (bcd.vocab_blocks): the embedding's first rows, every layer frozen on the gradient path, streamed
    (3, ["bcd.recompute=off", "bcd.vocab_blocks=2", "model.name=tiny-llama"]),
    (3, ["bcd.recompute=on", "bcd.vocab_blocks=2", "model.name=tiny-llama"]),
])
def test_a_visit_streamed_on_an_indexed_device_commits_the_resident_block_bitwise(tiny_cfg, block, extra):
    """The product path (the train task, the Resident holding, train.offload=stream) on ``train.device=cpu:0``, the
    CPU's stand-in for the ``cuda:0`` a GPU run resolves to: the streamed visit's losses, validation points, block
    file and (expansion on) merged suffix files are the resident visit's on ``cpu``, bitwise, with recompute off
    (streamed weights saved by reference for the backward) and on, and with expansion's hooks on streamed layers.
    It fails where a device comparison breaks on the index (a saved weight not packed: "weight of shape [0]")."""
    out = {}
    for offload, device in (("off", "cpu"), ("stream", "cpu:0")):
        cfg = tiny_cfg(*extra, f"train.offload={offload}", f"train.device={device}",
                       f"store={tiny_cfg().store}-{offload}")
        out[offload] = _visit(cfg, new_run(cfg), block)
    off, on = out["off"], out["stream"]
    assert off.streamed == 0 and on.streamed > 0 and on.recompute == off.recompute == ("bcd.recompute=on" in extra)
    assert (off.first_loss, off.train_loss, off.val_points) == (on.first_loss, on.train_loss, on.val_points)
    assert off.block_file["sha256"] == on.block_file["sha256"]
    assert {b: f["sha256"] for b, f in off.suffix_files.items()} == {b: f["sha256"] for b, f in on.suffix_files.items()}
    assert bool(on.suffix_files) == ("bcd.expand=lora" in extra)


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
    lo, hi = plan.visits[block].layers
    active = plan.visits[block].trainable((), cfg.tied)
    held_lo = lo if plan.visits[block].reads_activations(preinfer) else 0
    shape = StepShape(2, 16, "bf16", preinfer=preinfer, window=2)
    base = visit_memory(cfg, plan, block, shape)
    frozen = sorted(base.layer_sizes)
    layers = frozen if part == "all" else list(streamed_choice(frozen, lo, len(frozen) - 2))
    est = visit_memory(cfg, plan, block, replace(shape, streamed=tuple(layers)))
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
    base = visit_memory(ctx.model_cfg, ctx.plan, 0, cfg.step_shape())
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
    sets = ["model.name=L-23B", "bcd.blocks=16", "train.offload=stream", "data.seq_len=32", "tracking_uri=none"]
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
    est = {a: visit_memory(cfg, model_plan(cfg, 3), 1, StepShape(4, 64, recompute=a)) for a in ("on", "all")}
    assert est["all"].activations < est["on"].activations


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
    want = {b: float(torch.sqrt(sum((grads[n].grad.float() ** 2).sum() for n in plan.visits[b].params))) for b in range(3)}
    model.stream = LayerStream(model, [1, 2, 4], "cpu", window=2)
    got = block_grad_norms(model, x, y, plan.owner, range(3))
    assert all(abs(got[b] - want[b]) <= 1e-6 * want[b] for b in range(3)), (got, want)
    assert not any(p.requires_grad for p in model.parameters())


_PEAK_SCRIPT = """
import sys, tracemalloc
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext
cfg = RunConfig.model_validate_json(sys.argv[1])
ctx = RunContext.of(cfg, "r", sys.argv[2])
n, manifest = int(sys.argv[3]), ctx.manifest(0)
ctx.load_part(manifest, (0, n), True, True, trainable=(), stream=range(n)).stream.close()  # imports done
tracemalloc.start()
model = ctx.load_part(manifest, (0, n), True, True, trainable=(), stream=range(n))
print(tracemalloc.get_traced_memory()[1])
"""


def _python_peak_of_a_streamed_load(cfg, ds_id: str, n: int) -> int:
    """The peak bytes Python allocates while loading the part with every layer streamed, in a process of its own:
    tracemalloc counts every thread's allocations, and the suite's session-wide servers (moto's S3, Prefect's
    services) run threads in this one (in the whole suite they added 400 KB to the peak)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, cfg.model_dump_json(), ds_id, str(n)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_loading_a_streamed_part_holds_one_block_file_at_a_time(tiny_cfg):
    """``RunContext.load_part`` with every layer streamed: the part is built on the meta device and each stored tensor
    copied straight into the flat host buffer (or device tensor) it lives in, one block file read at a time. So the
    storages made while loading are the streamed buffers and the resident tensors, nothing twice (the earlier loader
    built the whole part on the host, then held every stored tensor of it at once, then copied the layers into the
    buffers: about three copies), and Python holds one block file's bytes at a time, which the planner's
    ``load_bytes`` covers."""
    from benchmarks.common import LiveBytes
    from bcdflow.models.memory import load_bytes

    cfg = tiny_cfg("model.name=tiny-llama", "model.n_layer=8", "bcd.blocks=4", "train.offload=stream")
    ds_id = new_run(cfg)
    ctx = RunContext.of(cfg, "r", ds_id)
    n = ctx.model_cfg.n_layer
    manifest = ctx.manifest(0)
    files = sorted(e["bytes"] for e in manifest["blocks"].values())
    with LiveBytes() as live:  # the storages made
        model = ctx.load_part(manifest, (0, n), True, True, trainable=(), stream=range(n))
    model.stream.close()
    py_peak = _python_peak_of_a_streamed_load(cfg, ds_id, n)  # the bytes Python holds (the block files)
    model = ctx.load_part(manifest, (0, n), True, True, trainable=(), stream=range(n))
    resident = sum(p.numel() * p.element_size() for p in model.parameters())  # the embedding and the head
    s = model.stream
    assert s.host_bytes > 0 and s.order == list(range(n))
    # the host buffers, the slots (the CPU is the device here) and the resident tensors, and nothing else
    assert live.peak <= s.host_bytes + s.device_bytes + resident + 4096, (live.peak, s.host_bytes, resident)
    assert py_peak < files[-1] + files[-2] // 2, (py_peak, files)  # one file's bytes, not two at once
    assert load_bytes(ctx.model_cfg, ctx.plan, 0, cfg.step_shape()) >= files[-1]
    # and the values are the stored ones: the same loss as the part loaded resident
    x, y = ctx.dataset.train_pairs(np.arange(4))
    ref = ctx.load_part(manifest, (0, n), True, True, trainable=())
    with torch.no_grad():
        assert torch.equal(visit_loss(model, x, y, 0, False), visit_loss(ref, x, y, 0, False))
    model.stream.close()


def test_a_stream_dropped_without_close_drains_then_frees_its_buffers():
    """A LayerStream dropped without ``close()`` (an error inside a visit, a context evicted) goes through its
    finalizer, which waits for the side stream's copies (CUDA) before its slots and host buffers are freed: here, that
    the finalizer runs when the model and stream go, and that the buffers go with it (nothing keeps them alive)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = build_model(get_config("tiny", vocab_size=512))
    stream = LayerStream(model.requires_grad_(False), [1, 2, 3], "cpu:0", window=2)
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 8)))
    host, slot, drain = weakref.ref(stream.host[1]), weakref.ref(stream.slots[0]), stream._drain
    assert drain.alive
    del model, stream
    gc.collect()
    assert not drain.alive and host() is None and slot() is None
