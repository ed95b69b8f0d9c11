"""docs/DESIGN.md §3 invariants on the tiny config: I1 (a visit touches its block only), I2 (pre-inference on = off),
I3 (one-block BCD = full-parameter training), I6 (a visit holds blocks >= b, trains block b only). The per-visit
sampler (paper §3.2.3) is tests/test_rules.py.

Run: python -m pytest -q tests/test_invariants.py   (CPU; the flow tests share one Prefect test server)
"""
from __future__ import annotations

import re

import pytest
import torch

from bcdflow.core.context import block_plan, model_config
from bcdflow.storage import runs
from bcdflow.storage.checkpoints import load_blocks, read_manifest
from bcdflow.storage.store import Store
from bcdflow.core.rules import batch_ranges, sample_rows
from tests.helpers import Spy, do_visit, new_run

_LAYER = re.compile(r"^h\.(\d+)\.")
LLAMA = ("model.name=tiny-llama", "model.d_model=64", "model.n_head=4")


def layers_of(names) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _LAYER.match(n))}


# -- I1 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,preinfer", [(0, True), (1, True), (2, True), (1, False)],
                         ids=["block0", "middle-preinfer", "last-preinfer", "middle-no-preinfer"])
def test_i1_a_visit_changes_only_its_block(tiny_cfg, monkeypatch, block, preinfer):
    cfg = tiny_cfg(f"bcd.preinfer={str(preinfer).lower()}")
    ds_id = new_run(cfg)
    store = Store(cfg.store)
    plan = block_plan(cfg, model_config(cfg, 512))
    before = load_blocks(store, "r", 0)
    spy = Spy(monkeypatch)

    do_visit(cfg, "r", ds_id, cycle=0, block=block, version=0)

    after = load_blocks(store, "r", 1)
    assert after.keys() == before.keys()
    active = set(plan.visits[block].params)
    for name, t in before.items():
        if name in active:
            assert not torch.equal(t, after[name]), f"{name} of the active block did not change"
        else:
            assert torch.equal(t, after[name]), f"{name} outside block {block} changed"
    # copy-on-write: unchanged blocks point at the very same files
    m0, m1 = read_manifest(store, "r", 0)["blocks"], read_manifest(store, "r", 1)["blocks"]
    assert {k for k in m0 if m0[k] != m1[k]} == {str(block)}
    # and the frozen tensors the visit held in memory were not touched either (no weight decay, no
    # in-place update leaking into a frozen tensor such as the tied wte the head reads)
    (model,) = spy.models
    for name, p in model.named_parameters():
        if name not in active:
            assert torch.equal(p.detach(), before[name]), name


# -- I6 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
def test_i6_visit_holds_blocks_from_b_and_trains_block_b_only(tiny_cfg, monkeypatch, family):
    cfg = tiny_cfg(*(LLAMA if family == "tiny-llama" else ()), "bcd.preinfer=true")
    ds_id = new_run(cfg)
    mcfg = model_config(cfg, 512)
    plan = block_plan(cfg, mcfg)
    block = 1
    lo = plan.visits[block].layers[0]
    spy = Spy(monkeypatch)

    do_visit(cfg, "r", ds_id, cycle=0, block=block, version=0)

    (model,) = spy.models
    params = dict(model.named_parameters())
    # weights of blocks >= b only: no prefix layer, no position embedding; wte only for a tied head
    assert min(layers_of(params)) == lo and max(layers_of(params)) == mcfg.n_layer - 1
    assert not any(n.startswith("wpe.") for n in params)
    assert ("wte.weight" in params) == mcfg.tied
    assert "ln_f.weight" in params
    # gradients and optimizer state for block b only
    active = set(plan.visits[block].params)
    assert {n for n, p in params.items() if p.requires_grad} == active
    assert all(p.grad is None for n, p in params.items() if n not in active)
    (opt_params,) = spy.opt_params
    assert {id(p) for p in opt_params} == {id(params[n]) for n in active}
    (opt,) = spy.opts
    assert {id(p) for p in opt.state} <= {id(params[n]) for n in active}


# -- I2, I3 (through the flows) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_store(tmp_path_factory):
    """One store for the flow tests: the token dataset is content-addressed, so it is prepared once."""
    return f"store={tmp_path_factory.mktemp('flows') / 'store'}"


def final_weights(cfg, run_id: str) -> dict[str, torch.Tensor]:
    store = Store(cfg.store)
    state = runs.read_state(store, run_id)
    assert state.status == "done"
    return load_blocks(store, run_id, state.version)


@pytest.mark.slow
def test_i2_preinference_on_and_off_give_the_same_weights(tiny_cfg, prefect_server, flow_store):
    from bcdflow.flows.bcd import bcd_train

    short = (flow_store, "bcd.max_steps=4")  # 4 steps x 8 rows: two pre-inference shards per visit
    on, off = tiny_cfg(*short, "bcd.preinfer=true"), tiny_cfg(*short, "bcd.preinfer=false")
    assert (on.bcd.blocks, on.bcd.cycles) == (3, 1)
    r_on = bcd_train(config=on.model_dump(), run_id="pre-on")
    r_off = bcd_train(config=off.model_dump(), run_id="pre-off")
    assert r_on["version"] == r_off["version"] == 3
    store = Store(on.store)
    # the two runs really took the two paths: the prefix was pre-inferred for blocks 1 and 2 of one only
    for run_id, flag in (("pre-on", True), ("pre-off", False)):
        assert runs.read_config(store, run_id)["bcd"]["preinfer"] is flag
        pre = [v.preinfer_seconds > 0 for v in runs.read_state(store, run_id).visits]
        assert pre == [False, flag, flag], (run_id, pre)
    a, b = final_weights(on, "pre-on"), final_weights(off, "pre-off")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-4, f"max abs diff {diff}"
    # not vacuous: every block moved away from version 0
    v0 = load_blocks(store, "pre-on", 0)
    plan = block_plan(on, model_config(on, 512))
    for blk in plan.blocks:
        assert any(not torch.equal(v0[n], a[n]) for n in blk.params), f"block {blk.index} never trained"


def plain_adamw(cfg, store: Store, run_id: str, steps: int) -> dict[str, torch.Tensor]:
    """Full-parameter training written out here, in plain PyTorch, independently of bcdflow's visit and step loop:
    the run's version 0 weights, AdamW over every parameter, gradient clipping at 1, the same batches."""
    from bcdflow.models import build_model
    from bcdflow.storage.tokens import TokenDataset

    ds = TokenDataset.open(store, runs.read_state(store, run_id).dataset)
    model = build_model(model_config(cfg, ds.vocab_size), init=False)
    model.load_state_dict(load_blocks(store, run_id, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=cfg.optim.weight_decay, fused=True)
    bs = cfg.train.batch_size
    rows = sample_rows(ds.n_train, 1.0, cfg.seed, 0, 0)[: steps * bs]  # the one visit's rows, in training order
    ranges = batch_ranges(len(rows), bs, cfg.seed, 0, 0)
    for _ in range(steps):
        lo, hi = next(ranges)
        t = torch.from_numpy(ds.train_rows(rows[lo:hi])).long()  # (B, T+1)
        opt.zero_grad(set_to_none=True)
        model(t[:, :-1], t[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_i3_one_block_bcd_equals_full_training(tiny_cfg, prefect_server, flow_store):
    from bcdflow.flows.bcd import bcd_train, full_train

    cfg = tiny_cfg(flow_store, "bcd.blocks=1", "bcd.cycles=1", "bcd.sample_rate=1", "bcd.max_steps=4",
                   "train.steps=4", "train.eval_every=2")
    r_bcd = bcd_train(config=cfg.model_dump(), run_id="bcd")
    r_full = full_train(config=cfg.model_dump(), run_id="full")
    assert r_bcd["steps"] == r_full["steps"] == 4
    # the reference is plain PyTorch written in this test (full_train itself is one-block BCD)
    ref = plain_adamw(cfg, Store(cfg.store), "full", 4)
    for run_id in ("bcd", "full"):
        got = final_weights(cfg, run_id)
        assert got.keys() == ref.keys()
        for k in got:
            assert torch.equal(got[k], ref[k]), (run_id, k)
    v0 = load_blocks(Store(cfg.store), "bcd", 0)
    assert all(not torch.equal(v0[k], ref[k]) for k in ("wte.weight", "h.0.attn.c_attn.weight", "ln_f.weight"))
    # the baseline evaluated mid-run (every 2 steps), and that did not perturb training
    (full_visit,) = runs.read_state(Store(cfg.store), "full").visits
    assert len(full_visit.val_points) == 2
