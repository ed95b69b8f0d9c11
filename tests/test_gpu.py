"""On a CUDA device (skipped without one, so CI never runs them; ``pytest -m gpu``, or ``make gpu-check`` where a GPU
is lent): what the CPU tests cannot show. The CPU runs the same code paths (``tests/test_stream.py`` with the device
named ``cpu:0`` stands for ``cuda:0``), but not side-stream copies, events, the caching allocator, page-locked
memory or the device's own numerics. Each test says what would make it fail.

    pytest -q -m gpu tests/test_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from bcdflow.models.memory import CONTEXT_BYTES, FRAGMENTATION, GB, WORKSPACE_BYTES, device_budget

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# an L-1.5B layer (d 2048, 16 heads, 4 KV heads, MLP 5050): 44 M parameters, 88 MB in bf16
SHAPE = ["model.name=L-1.5B", "model.n_kv_head=4", "data.vocab_size=32000", "data.seq_len=1024",
         "train.batch_size=2", "train.precision=bf16", "bcd.recompute=on"]
MB = 2**20


def streaming(*args: str, sets: tuple[str, ...] = ()) -> dict:
    from benchmarks.streaming import main

    torch.cuda.empty_cache()
    return main(["--device", "cuda", "--blocks-to-run", "0", "--steps", "3", *args,
                 *[a for s in [*SHAPE, *sets] for a in ("--set", s)]])


def test_streamed_weights_hold_the_window_whatever_the_number_of_layers():
    """Reserved memory of a streamed visit (block 0: 4 trained layers, the rest streamed; expansion's adapters on, the
    default) is the planner's peak plus at most the reserve's share, and does not grow with the streamed layers
    beyond what recompute keeps per layer. Fails if copies allocate per layer (a fresh tensor per copy freed through
    record_stream grew reserved memory by a layer's 88 MB for each streamed layer), if the host buffers are not the
    planner's bytes, or if the allocator had to retry (a plan that does not fit what it says)."""
    out = {}
    for n in (12, 24):
        v = streaming("--holdings", "stream", sets=(f"model.n_layer={n}", "bcd.boundaries=[4]"))["visits"][0]
        s = out[n] = v["stream"]
        assert s["expand_rank"] == 16, s  # the default visit: adapters on the streamed suffix
        assert s["device_buffers"] == 2 and s["alloc_retries"] == 0, s
        assert s["host_bytes"] == s["planned_host_bytes"], s
        assert s["peak_allocated_bytes"] <= 1.10 * s["planned_peak_bytes"], s
        assert s["peak_reserved_bytes"] <= (1 + FRAGMENTATION) * s["planned_peak_bytes"] + WORKSPACE_BYTES, s
    grown = out[24]["peak_reserved_bytes"] - out[12]["peak_reserved_bytes"]
    planned = out[24]["planned_peak_bytes"] - out[12]["planned_peak_bytes"]  # 12 more recomputed layer inputs
    assert grown <= planned + 64 * MB, (grown, planned)


def test_pinned_host_memory_is_the_planners_bytes_not_a_power_of_two_each():
    """The stream's flat host buffers are page-locked exactly (cudaHostRegister), not through torch's pinned
    allocator, which would round each tensor up to a power of two (an L-1.5B MLP matrix: 19.7 MB -> 32 MB). Fails if
    a buffer is not page-locked (is_pinned false: copies would be synchronous) or if anything went through torch's
    caching host allocator (its reserved bytes grew)."""
    from bcdflow.models import build_model, get_config
    from bcdflow.models.stream import LayerStream

    cfg = get_config("L-1.5B", n_layer=4, n_kv_head=4, vocab_size=32000)
    model = build_model(cfg, layers=(0, 4), embed=False, head=False, device="meta", init=False,
                        frozen_dtype=torch.bfloat16).to_empty(device="cpu").requires_grad_(False)
    from benchmarks.streaming import pinned_allocator_bytes

    before = pinned_allocator_bytes()  # raises where torch names the figure otherwise: never a silent 0
    stream = LayerStream(model, range(4), "cuda", window=2)
    grown = pinned_allocator_bytes() - before
    assert all(h.is_pinned() for h in stream.host.values())
    entries = [e for es in stream.layout.values() for e in es]  # (name, parameter, offset, bytes, shape)
    assert stream.host_bytes <= sum(e[3] for e in entries) + 256 * len(entries)  # the tensors, aligned: no more
    assert grown < MB, grown  # nothing went through the rounding allocator
    assert stream.device.index == torch.cuda.current_device()  # "cuda" resolved to the index tensors report
    stream.close()


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_streamed_step_on_cuda_equals_the_resident_one(device, recompute):
    """Side-stream copies, events and saved-weight references on CUDA, with the device named as train.device=auto
    used to name it ("cuda", no index) and indexed: the loss equals the resident one exactly (same kernels, same
    inputs), the gradients to float rounding, over two steps (the second starts from the slots the first left).
    Without recompute the backward reads the weights it saved: fails with "weight of shape [0]" (a placeholder) or
    gradients from another layer's weights (a slot reused) if a saved weight is not packed as a reference, and with
    wrong gradients if a copy or a slot's reuse is not ordered by its event."""
    import contextlib
    import copy

    from bcdflow.models import build_model, get_config
    from bcdflow.models.stream import LayerStream
    from bcdflow.models.visit_compute import visit_loss

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    cfg = get_config("tiny-llama", vocab_size=4096, n_layer=8, d_model=512, n_head=8, n_kv_head=2)
    host = build_model(cfg)
    lo, hi = 2, 4
    for n, p in host.named_parameters():
        p.requires_grad_(n.startswith(("h.2.", "h.3.")))
    frozen = [i for i in range(8) if not lo <= i < hi]
    x, y = torch.randint(0, 4096, (4, 256), device=dev), torch.randint(0, 4096, (4, 256), device=dev)
    out = {}
    for mode in ("resident", "stream"):
        model = copy.deepcopy(host)
        stream = LayerStream(model, frozen, device, window=2, grad_from=lo) if mode == "stream" else None
        model.to(dev)
        losses = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with stream.saving() if stream else contextlib.nullcontext():
                loss = visit_loss(model, x, y, lo, False, hi=hi, recompute=recompute)
            loss.backward()
            losses.append(float(loss))
        torch.cuda.synchronize()
        out[mode] = (losses, {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None})
        if stream:
            assert stream.storages == {s.untyped_storage().data_ptr() for s in stream.slots}
            stream.close()
        del model, stream
        torch.cuda.empty_cache()
    (l0, g0), (l1, g1) = out["resident"], out["stream"]
    assert l0 == l1 and g0.keys() == g1.keys() and g0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-6) for n in g0)


def test_a_partly_resident_visit_fits_its_card_without_retries_and_overlaps_its_copies():
    """train.offload=auto on a card the resident visit does not fit: the planner keeps what fits resident and
    streams the rest; its steps run with no allocator retry or out-of-memory and no cache flush in the timed steps,
    reserved within the plan and its reserve, and reserved plus the device memory measured outside the allocator
    (context, kernel modules) within the card; and the copies overlap the compute (at 8x1024 tokens most of the copy
    time is hidden). The allocator is capped 2 GB above the card less what is outside it, so that the reserved
    figures are judged against the plan and the card, not refused by a cap equal to what is asserted. Fails if the
    plan undercounts or if copies serialise with compute."""
    from bcdflow.core.config import load_config
    from bcdflow.core.context import block_plan, model_config
    from bcdflow.models.memory import visit_memory

    sets = ("model.n_layer=16", "bcd.boundaries=[4]", "train.batch_size=8")
    run = load_config(sets=["tracking_uri=none", *SHAPE, *sets])
    mcfg = model_config(run)
    plan = block_plan(run, mcfg)
    est = visit_memory(mcfg, plan, 0, run.step_shape())  # recompute on (SHAPE), nothing streamed
    layer = next(iter(est.layer_sizes.values()))[1]
    usable = est.peak - 5 * layer  # about half of the 12 frozen layers must stream
    card = (usable + WORKSPACE_BYTES) / (1 - FRAGMENTATION) + CONTEXT_BYTES + 1e6
    assert device_budget(card).usable >= usable
    v = streaming("--holdings", "resident", "auto", "--cap-gb", f"{card / GB:.4f}", "--alloc-headroom-gb", "2",
                  sets=sets)["visits"][0]
    r, a = v["resident"], v["auto"]
    assert not r["fits_plan"], r  # the resident visit does not fit this card, by the planner's figures
    assert "error" not in a and a["fits_plan"] and 0 < a["streamed_layers"] < 12, a
    timed = a["allocator"]["timed"]  # alloc_retries: the build's, the warm-up's and the timed steps'
    assert a["alloc_retries"] == 0 and timed["num_ooms"] == 0 and timed["num_device_free"] == 0, a
    reserved = max(a["peak_reserved_bytes"], a["warmup_peak_reserved_bytes"])
    assert reserved <= a["planned_peak_bytes"] + device_budget(card).reserve, a
    assert reserved + a["outside_allocator_bytes"] <= card, a
    # without overlap the step would take the resident compute plus every copy: here most copies hide
    full = streaming("--holdings", "resident", "stream", sets=sets)["visits"][0]
    assert full["stream"].get("hidden", 0) >= 0.4, full


ENGINE = ["model.name=tiny-llama", "model.n_layer=8", "model.d_model=512", "model.n_head=8", "model.n_kv_head=2",
          "data.seq_len=256", "data.vocab_size=4096", "train.batch_size=8"]


@pytest.mark.parametrize("device,extra", [
    ("auto", ["bcd.recompute=off"]), ("cuda", ["bcd.recompute=on"]),
    ("auto", ["bcd.recompute=off", "bcd.expand=lora", "train.precision=bf16"]),
])
def test_a_streamed_visit_through_the_engine_equals_the_resident_one(tiny_cfg, device, extra):
    """The product's visit (train task, Resident holding) streamed (train.offload=stream) on the device
    ``train.device=auto``/``cuda`` resolves to, against the same visit resident (train.offload=off): the first loss
    equal, the last loss and every validation point within float rounding, the committed block and (expansion on)
    the merged suffix blocks within rounding of AdamW's few steps; no allocator retry; the loop's peak allocation
    within 10% of the planner's figure plus the allocator's 2 MB rounding, and reserved within the reserve's share
    (both beyond what the process held before the visit: cuBLAS's workspaces are made first, outside the plan).
    Fails on the unindexed-device crash (the first version of this path raised in the backward), on a slot read
    before its copy landed (losses differ), and on a planner that undercounts the visit (peak over its figure)."""
    from bcdflow.core.context import RunContext
    from bcdflow.storage.checkpoints import load_from_manifest
    from bcdflow.storage.store import Store
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block
    from tests.helpers import new_run

    dev = torch.device("cuda", torch.cuda.current_device())
    # cuBLAS keeps a workspace per (handle, stream) through the caching allocator (32 MiB on sm90), one for this
    # thread and one for autograd's device thread: made here, before the visits, so what the visits add is theirs
    a = torch.randn(256, 256, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out = {}
    for offload in ("off", "stream"):
        cfg = tiny_cfg(*ENGINE, *extra, f"train.device={device}", f"train.offload={offload}",
                       f"store={tiny_cfg().store}-{offload}")
        ctx = RunContext.of(cfg, "r", new_run(cfg))
        assert ctx.device == dev
        base = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        res = train_block.fn(ctx, VisitSpec(0, 0, 0))
        files = res.files(0)
        tensors = load_from_manifest(Store(cfg.store), "r", {"blocks": {str(b): f for b, f in files.items()}})
        out[offload] = (res, tensors, ctx.holding(0), base)
        torch.cuda.empty_cache()
    (off, t_off, h_off, b_off), (on, t_on, h_on, b_on) = out["off"], out["stream"]
    assert off.streamed == 0 and on.streamed == len(h_on.streamed) > 0
    assert off.first_loss == on.first_loss
    assert on.train_loss == pytest.approx(off.train_loss, rel=1e-3)
    assert [s for s, _ in on.val_points] == [s for s, _ in off.val_points]
    assert all(v1 == pytest.approx(v0, rel=1e-3) for (_, v0), (_, v1) in zip(off.val_points, on.val_points))
    assert t_off.keys() == t_on.keys() and t_off
    assert all(torch.allclose(t_off[n].float(), t_on[n].float(), rtol=1e-3, atol=1e-4) for n in t_off)
    assert bool(on.suffix_files) == ("bcd.expand=lora" in extra)
    for res, held, (alloc0, reserved0) in ((off, h_off, b_off), (on, h_on, b_on)):
        assert res.alloc_retries == 0, res
        peak = res.peak_mem_bytes - alloc0  # the visit's own: its model, step and batch slots' device copies
        assert peak <= 1.10 * held.estimate.peak + 2 * MB, (peak, held.estimate.peak)
        assert res.peak_reserved_bytes - reserved0 <= (1 + FRAGMENTATION) * held.estimate.peak + 64 * MB, res


def test_train_memory_gb_caps_the_allocator_at_the_card_it_plans_for(tiny_cfg):
    """train.memory_gb=2 on a bigger GPU: the run's device caps the caching allocator at that card less its context,
    so an allocation past it fails as it would on that card (before, the plan was checked against 2 GB while the
    visit could use the whole GPU: a 24 GB plan on an 80 GB card proved nothing). Fails if nothing caps it."""
    from bcdflow.core.context import RunContext
    from tests.helpers import new_run

    cfg = tiny_cfg("train.device=cuda", "train.memory_gb=2")
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    dev = ctx.device
    try:
        torch.cuda.empty_cache()
        ok = torch.empty(int(1.2 * GB), dtype=torch.uint8, device=dev)  # within 2 GB less the context
        del ok
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(1.6 * GB), dtype=torch.uint8, device=dev)  # past it: refused by the cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
