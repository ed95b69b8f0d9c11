"""``bcd.freeze``: the embeddings and the output head kept frozen in every visit (BAdam's default; docs/DESIGN.md §10).
The block that owns them trains the rest of its parameters, their stored tensors stay bitwise as they were, a
``params`` split balances what trains, and the planner counts only what trains.

    python -m pytest -q tests/test_freeze.py
"""
from __future__ import annotations

import torch

from bcdflow.core.context import RunContext
from bcdflow.models import get_config, model_plan
from bcdflow.models.memory import visit_memory
from bcdflow.models.specs import StepShape
from bcdflow.storage.checkpoints import load_blocks
from bcdflow.storage.store import Store
from tests.helpers import Spy, do_visit, new_run


def test_a_visit_with_frozen_embeddings_trains_its_layers_only(tiny_cfg, monkeypatch):
    cfg = tiny_cfg("bcd.freeze=[embeddings]")
    ds_id = new_run(cfg)
    ctx = RunContext.of(cfg, "r", ds_id)
    assert ctx.trainable(0) == set(ctx.plan.visits[0].params) - {"wte.weight", "wpe.weight"}
    before = load_blocks(Store(cfg.store), "r", 0)
    spy = Spy(monkeypatch)
    do_visit(cfg, "r", ds_id, cycle=0, block=0, version=0)
    (model,) = spy.models
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in spy.opt_params[0]} == ctx.trainable(0)
    after = load_blocks(Store(cfg.store), "r", 1)
    for name in ("wte.weight", "wpe.weight"):
        assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(before[n], after[n]) for n in ctx.trainable(0))


def test_a_params_split_balances_what_trains():
    cfg = get_config("tiny-llama", vocab_size=32000)  # an embedding and head as large as several layers
    whole, frozen = model_plan(cfg, 3), model_plan(cfg, 3, freeze=["embeddings", "head"])
    assert frozen.blocks[0].layers[1] > whole.blocks[0].layers[1] and frozen.blocks[2].layers[0] < whole.blocks[2].layers[0]


def test_the_planner_counts_only_what_trains():
    cfg = get_config("tiny-llama", vocab_size=32000)
    plan = model_plan(cfg, 3, freeze=["embeddings", "head"])
    full = visit_memory(cfg, plan, 0, StepShape(2, 32, "bf16"))
    frozen = visit_memory(cfg, plan, 0, StepShape(2, 32, "bf16", freeze=("embeddings", "head")))
    assert full.trainable_params - frozen.trainable_params == 32000 * cfg.d_model
    assert frozen.optim < full.optim
