"""A visit validates the version it makes with its own model (docs/DESIGN.md §2.4): the frozen prefix does not change
in a visit, so the new version's validation loss is the visit's model on the validation rows' prefix states, and
no visit reloads the whole model from the store to evaluate. It equals the whole-model evaluation of the
committed version.

    python -m pytest -q tests/test_visit_eval.py
"""
from __future__ import annotations

import pytest

from bcdflow.core.context import RunContext
from bcdflow.storage.checkpoints import commit_version
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import evaluate_version, train_block
from bcdflow.core.rules import VisitSpec
from tests.helpers import new_run


@pytest.mark.parametrize("block", [0, 1, 2])
@pytest.mark.parametrize("extra", [[], ["train.offload=stream", "model.name=tiny-llama"]])
def test_the_visits_validation_loss_is_the_committed_versions(tiny_cfg, block, extra):
    cfg = tiny_cfg(*extra)
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    if ctx.from_acts(block):
        for s in plan_shards.fn(ctx, 0, block):
            preinfer_shard.fn(ctx, 0, block, 0, s)
    out = train_block.fn(ctx, VisitSpec(0, block, 0))
    commit_version(Store(cfg.store), "r", 0, 1, {block: out.block_file})
    whole = evaluate_version.fn(ctx, 1).val_loss
    assert out.val_loss is not None and abs(out.val_loss - whole) <= 1e-5, (out.val_loss, whole)


def test_bf16_stored_activations_leave_it_to_the_whole_model(tiny_cfg):
    cfg = tiny_cfg("bcd.act_dtype=bfloat16")
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    for s in plan_shards.fn(ctx, 0, 1):
        preinfer_shard.fn(ctx, 0, 1, 0, s)
    assert train_block.fn(ctx, VisitSpec(0, 1, 0)).val_loss is None  # rounded prefix states: not the whole model's loss


def test_a_whole_model_evaluation_within_a_budget_streams_and_equals_the_resident_one(tiny_cfg, monkeypatch):
    """The evaluation that loads the whole model (after a visit on several processes, bf16 stored activations) holds
    it within the device's budget: the layers that fit resident, the rest streamed; the loss is the resident one."""
    from bcdflow.models.memory import NoGradPass, no_grad_memory
    from bcdflow.models.specs import StepShape

    cfg = tiny_cfg("model.n_layer=8", "train.eval_batch_size=8")
    ctx = RunContext.of(cfg, "r", new_run(cfg))
    n, T = ctx.model_cfg.n_layer, ctx.dataset.seq_len
    resident = evaluate_version.fn(ctx, 0).val_loss
    whole = no_grad_memory(ctx.model_cfg, NoGradPass((0, n), True, True), StepShape(8, T, "fp32"))
    one = no_grad_memory(ctx.model_cfg, NoGradPass((0, 1), False, False), StepShape(8, T, "fp32")).weights  # a layer's
    monkeypatch.setattr(RunContext, "budget", lambda self: whole.peak - 4 * one)
    streamed, rows = ctx.no_grad_pass(NoGradPass((0, n), True, True, cfg.train.eval_rows, cfg.train.eval_batch_size))
    assert 0 < len(streamed) < n and rows == 8
    assert evaluate_version.fn(ctx, 0).val_loss == resident
