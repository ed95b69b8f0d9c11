"""On a CUDA device (skipped without one, so CI never runs them; ``pytest -m gpu`` where a GPU is lent): the card
holds what the planner promises, at a realistic layer size (d = 2048) in bf16 with recompute, where the CPU tests
cannot see it: memory *reserved* by the caching allocator, its retries, pinned host bytes as allocated, and
whether the copies overlap the compute. Each would have failed before the slot stream:

- copies into fresh device tensors freed through ``record_stream`` let reserved memory grow toward every streamed
  layer while ``max_memory_allocated`` stayed low (the host runs ahead of the GPU);
- per-tensor ``pin_memory`` rounded every tensor up to a power of two in torch's pinned allocator;
- a budget of the card's whole memory left nothing for the context, workspaces and fragmentation.

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


def streaming(*args: str, sets: tuple[str, ...] = ()) -> dict:
    from benchmarks.streaming import main

    torch.cuda.empty_cache()
    return main(["--device", "cuda", "--blocks-to-run", "0", "--steps", "3", *args,
                 *[a for s in [*SHAPE, *sets] for a in ("--set", s)]])


def test_streamed_weights_hold_the_window_whatever_the_number_of_layers():
    """Reserved memory of a streamed visit (block 0: 4 trained layers, the rest streamed) is the planner's peak plus
    at most the reserve's share, and does not grow with the streamed layers beyond what recompute keeps per layer
    (defect 1 grew by a layer's 88 MB for each of them)."""
    out = {}
    for n in (12, 24):
        v = streaming("--holdings", "stream", sets=(f"model.n_layer={n}", "bcd.boundaries=[4]"))["visits"][0]
        s = out[n] = v["stream"]
        assert s["device_buffers"] == 2 and s["alloc_retries"] == 0, s
        assert s["host_bytes"] == s["planned_host_bytes"], s
        assert s["peak_allocated_bytes"] <= 1.10 * s["planned_peak_bytes"], s
        assert s["peak_reserved_bytes"] <= (1 + FRAGMENTATION) * s["planned_peak_bytes"] + WORKSPACE_BYTES, s
    grown = out[24]["peak_reserved_bytes"] - out[12]["peak_reserved_bytes"]
    planned = out[24]["planned_peak_bytes"] - out[12]["planned_peak_bytes"]  # 12 more recomputed layer inputs
    assert grown <= planned + 64 * 2**20, (grown, planned)


def test_pinned_host_memory_is_the_planners_bytes_not_a_power_of_two_each():
    """The stream's flat host buffers are page-locked exactly (cudaHostRegister), not through torch's pinned
    allocator, which would round each tensor up to a power of two (an L-1.5B MLP matrix: 19.7 MB -> 32 MB)."""
    from bcdflow.models import build_model, get_config
    from bcdflow.models.stream import LayerStream

    cfg = get_config("L-1.5B", n_layer=4, n_kv_head=4, vocab_size=32000)
    model = build_model(cfg, layers=(0, 4), embed=False, head=False, device="meta", init=False,
                        frozen_dtype=torch.bfloat16).to_empty(device="cpu").requires_grad_(False)
    before = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    stream = LayerStream(model, range(4), "cuda", window=2)
    grown = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0) - before
    assert all(h.is_pinned() for h in stream.host.values())
    entries = [e for es in stream.layout.values() for e in es]  # (name, parameter, offset, bytes, shape)
    assert stream.host_bytes <= sum(e[3] for e in entries) + 256 * len(entries)  # the tensors, aligned: no more
    assert grown < 2**20, grown  # nothing went through the rounding allocator
    stream.close()


def test_a_partly_resident_visit_fits_its_card_without_retries_and_overlaps_its_copies():
    """train.offload=auto on a card the resident visit does not fit: the planner keeps what fits resident and
    streams the rest; the process capped at that card runs its steps with no allocator retry, within the card less
    the context; and the copies overlap the compute (at 8x1024 tokens most of the copy time is hidden)."""
    from bcdflow.core.config import load_config
    from bcdflow.core.context import block_plan, model_config
    from bcdflow.models.memory import visit_memory

    sets = ("model.n_layer=16", "bcd.boundaries=[4]", "train.batch_size=8")
    run = load_config(sets=["tracking_uri=none", *SHAPE, *sets])
    mcfg = model_config(run)
    plan = block_plan(run, mcfg)
    resident = visit_memory(mcfg, plan, 0, 8, 1024, "bf16", recompute=True).peak
    layer = next(iter(visit_memory(mcfg, plan, 0, 8, 1024, "bf16", recompute=True).layer_sizes.values()))[1]
    usable = resident - 5 * layer  # about half of the 12 frozen layers must stream
    card = (usable + WORKSPACE_BYTES) / (1 - FRAGMENTATION) + CONTEXT_BYTES + 1e6
    assert device_budget(card).usable >= usable
    v = streaming("--holdings", "resident", "auto", "--cap-gb", f"{card / GB:.4f}", sets=sets)["visits"][0]
    r, a = v["resident"], v["auto"]
    assert not r["fits_plan"], r  # the resident visit does not fit this card, by the planner's figures
    assert "error" not in a and a["fits_plan"] and 0 < a["streamed_layers"] < 12, a
    assert a["alloc_retries"] == 0 and a["peak_reserved_bytes"] <= card - CONTEXT_BYTES, a
    # without overlap the step would take the resident compute plus every copy: here most copies hide
    full = streaming("--holdings", "resident", "stream", sets=sets)["visits"][0]
    assert full["stream"].get("hidden", 0) >= 0.4, full


def test_a_visit_through_the_engine_on_cuda_reports_reserved_memory_and_no_retries(tiny_cfg):
    """The product's visit (train task, Resident holding, partial streaming under train.memory_gb) on CUDA: the
    record carries peak reserved and retries, and the card held no more than its budget."""
    from bcdflow.core.context import RunContext
    from bcdflow.tasks.train import train_block
    from tests.helpers import new_run

    cfg = tiny_cfg("train.device=cuda", "model.n_layer=8", "bcd.recompute=off", "train.offload=stream")
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    out = train_block.fn(ctx, 0, 0, 0)
    assert out.streamed > 0 and out.alloc_retries == 0 and out.peak_reserved_bytes >= out.peak_mem_bytes > 0
    assert out.peak_reserved_bytes <= (1 + FRAGMENTATION) * ctx.holding(0).estimate.peak + WORKSPACE_BYTES
