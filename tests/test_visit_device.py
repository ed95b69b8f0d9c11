"""What a visit sets on its device each time it starts (issue 43): the allocator's cap (``train.memory_gb``) is set by
every visit, on the device its process trains on, not once per run context (a worker's context outlives its
visits, a distributed rank's device was never capped), and the CUDA RNG a checkpoint carries is that device's. The CPU
tests follow the same code path with the device the context names; the ``gpu`` tests run it on CUDA
(``make gpu-check`` runs every ``gpu``-marked test).

    python -m pytest -q tests/test_visit_device.py
"""
from __future__ import annotations

import pytest
import torch

from bcdflow.core.context import RunContext
from tests.helpers import do_visit, new_run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_every_visit_sets_the_allocator_cap_on_its_processs_device(tiny_cfg, monkeypatch):
    """Two visits of one run in one process share a run context: each sets the cap again, on the context's device
    (it was set once, when the context first named its device)."""
    import bcdflow.tasks.engine as engine

    cfg = tiny_cfg("bcd.blocks=2", "bcd.max_steps=2")
    ds = new_run(cfg)
    calls = []
    real = engine.cap_allocator
    monkeypatch.setattr(engine, "cap_allocator", lambda c, d: (calls.append(str(d)), real(c, d))[1])
    do_visit(cfg, "r", ds, cycle=0, block=0, version=0)
    do_visit(cfg, "r", ds, cycle=0, block=1, version=1)
    assert calls == [str(RunContext.of(cfg, "r", ds).device)] * 2


@pytest.mark.gpu
@cuda
def test_the_cap_empties_the_cache_and_holds_the_visit_to_the_card(tiny_cfg):
    """On CUDA: what an earlier visit left in the allocator's cache is released when the next visit sets its cap
    (a cache above the cap would make its first allocations retry), and an allocation past the planned card fails
    as it would on that card."""
    from bcdflow.core.context import cap_allocator
    from bcdflow.models.memory import CONTEXT_BYTES, GB

    dev = torch.device("cuda", torch.cuda.current_device())
    cached = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    del cached
    assert torch.cuda.memory_reserved(dev) >= 512 * 2**20
    cfg = tiny_cfg("train.device=cuda:0", "train.memory_gb=1")
    try:
        cap_allocator(cfg, dev)
        assert torch.cuda.memory_reserved(dev) < 512 * 2**20
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(1 * GB - CONTEXT_BYTES) + 64 * 2**20, dtype=torch.uint8, device=dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)


@pytest.mark.gpu
@cuda
def test_a_checkpoint_restores_the_cuda_rng_of_the_runs_device(tmp_path):
    """On CUDA: the RNG saved with ``rng_device=cuda:0`` comes back on cuda:0 (draws after the load repeat the draws
    after the save), and the device named ``cuda`` is its current index."""
    from bcdflow.storage import layout, trainckpt
    from bcdflow.storage.store import Store

    store, vkey = Store(str(tmp_path / "store")), layout.visit_key("r", 0, 0)
    for name in ("cuda:0", "cuda"):
        torch.cuda.manual_seed(7)
        trainckpt.save(store, vkey, 1, {"w": torch.zeros(2)}, {}, {"base_version": 0, "loop": {}}, rng_device=name)
        want = torch.rand(4, device="cuda:0")
        assert trainckpt.load(store, vkey, rng_device=name) is not None
        assert torch.equal(torch.rand(4, device="cuda:0"), want), name


def test_the_host_check_counts_a_mid_visit_checkpoint_beside_the_pinned_buffers(monkeypatch):
    """The host peak of a visit is its pinned buffers plus the largest of what it takes in phases: loading a block
    file, a mid-visit checkpoint (written or resumed: the block's weights and AdamW state, as tensors and as bytes,
    24 bytes a trained parameter), a commit. Only loading was counted: a host between the two figures was let run
    and ran out at the first checkpoint. Refused now, naming the checkpoint."""
    from types import SimpleNamespace

    from bcdflow.core import context
    from bcdflow.core.config import load_config
    from bcdflow.errors import BadInput
    from bcdflow.models.memory import host_phases

    cfg = load_config(sets=["model.name=G-1.6B", "bcd.blocks=4", "data.seq_len=32", "data.vocab_size=32000",
                            "train.offload=off", "tracking_uri=none"])
    mcfg = context.model_config(cfg)
    plan = context.block_plan(cfg, mcfg)
    phases = [host_phases(mcfg, plan, b, cfg.step_shape(), context.fit_holding(mcfg, plan, b, cfg.step_shape(),
                                                                                None).estimate)
              for b in range(len(plan.visits))]
    load, ckpt = max(p["load"] for p in phases), max(p["checkpoint"] for p in phases)
    assert ckpt > 2 * load  # 24 bytes a trained parameter against one 4-byte file
    monkeypatch.setattr(context.psutil, "virtual_memory", lambda: SimpleNamespace(available=(load + ckpt) // 2))
    with pytest.raises(BadInput, match=r"^train\.offload: .* to write or resume a mid-visit checkpoint") as e:
        context.check_plan_fits(cfg)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(context.psutil, "virtual_memory", lambda: SimpleNamespace(available=ckpt + 1))
    context.check_plan_fits(cfg)
