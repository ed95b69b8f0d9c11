"""The frozen suffix kept moving, state-free (``bcd.expand=sign``; models/suffix.py, tasks/expand.py; issue 41): a
visit steps every weight after its block by sign descent in the weight's own gradient hook, commits its block and the
suffix blocks, leaves the prefix (and so the stored activations) bitwise untouched, keeps no gradient and no state,
resumes bitwise after an interruption (fp32, and bf16 with stochastic rounding), and is refused where it cannot run.

    python -m pytest -q tests/test_suffix.py
"""
from __future__ import annotations

import itertools

import pytest
import torch

from bcdflow.core import stop_signals
from bcdflow.core.config import load_config
from bcdflow.core.context import RunContext, block_plan, model_config
from bcdflow.models import build_model
from bcdflow.models.errors import ConfigError
from bcdflow.models.model_config import get_config
from bcdflow.models.suffix import SignSuffix
from bcdflow.models.visit_compute import visit_loss
from bcdflow.storage.checkpoints import load_blocks, read_manifest
from bcdflow.storage.store import Store
from bcdflow.tasks.train import train_block
from bcdflow.core.rules import VisitSpec
from tests.helpers import TINY, Spy, new_run
from tests.test_expand import expanded_visit, layer

SIGN = ("bcd.expand=sign", "bcd.expand_lr=1e-3")


@pytest.mark.parametrize("block,preinfer,sets", [(0, True, ()), (1, True, ()), (1, False, ()),
                                                 (0, True, ("model.name=tiny-llama", "train.precision=bf16")),
                                                 (1, True, ("bcd.freeze=[head]", "model.name=tiny-llama"))],
                         ids=["block0", "middle-preinfer", "middle-no-preinfer", "llama-bf16", "freeze-head"])
def test_a_sign_visit_moves_its_block_and_every_suffix_weight_and_nothing_before(tiny_cfg, monkeypatch, block,
                                                                                  preinfer, sets):
    cfg = tiny_cfg(f"bcd.preinfer={str(preinfer).lower()}", *SIGN, *sets)
    ds_id = new_run(cfg)
    store = Store(cfg.store)
    ctx = RunContext.of(cfg, "r", ds_id)
    plan = block_plan(cfg, model_config(cfg, 512))
    lo, hi = plan.visits[block].layers
    before = load_blocks(store, "r", 0)
    spy = Spy(monkeypatch)

    out = expanded_visit(cfg, ds_id, block)

    after = load_blocks(store, "r", 1)
    suffix = set(range(block + 1, len(plan.visits)))
    moving = set(plan.visits[block].params) | {n for b in suffix for n in ctx.trainable(b)}
    for name, t in before.items():
        if name in ctx.trainable(block) or name in moving - set(plan.visits[block].params):
            assert not torch.equal(t, after[name]), f"{name} did not change"
        else:  # the prefix, and what bcd.freeze keeps
            assert torch.equal(t, after[name]), f"{name} changed"
        assert after[name].dtype == t.dtype, name
    m0, m1 = read_manifest(store, "r", 0)["blocks"], read_manifest(store, "r", 1)["blocks"]
    assert {int(k) for k in m0 if m0[k] != m1[k]} == {block} | suffix
    assert set(out.suffix_norms) == suffix and all(v > 0 for v in out.suffix_norms.values())
    (params,) = spy.opt_params  # the optimizer holds the block alone: the suffix has no state
    assert {id(p) for p in params} == {id(p) for n, p in spy.models[0].named_parameters() if n in ctx.trainable(block)}
    assert all(p.grad is None and not p.requires_grad for n, p in spy.models[0].named_parameters()
               if n not in ctx.trainable(block))  # detached: no hook, no gradient left


def test_the_rule_is_a_sign_step_of_each_weight_in_its_hook_with_no_gradient_kept():
    torch.manual_seed(0)
    cfg = get_config("tiny", n_layer=3, d_model=32, n_head=2, vocab_size=64, n_ctx=16)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters() if layer(n) == 2 or n.startswith("ln_f")]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    rule = SignSuffix(model, names, lambda: 0.01, seed=3).attach()
    x, y = torch.randint(64, (4, 16)), torch.randint(64, (4, 16))
    ref = build_model(cfg, init=False)
    ref.load_state_dict(start)
    loss = visit_loss(ref, x, y, 0, False, hi=3)
    loss.backward()
    visit_loss(model, x, y, 0, False, hi=3).backward()
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if n in names:
            assert params[n].grad is None  # dropped in the hook
            assert torch.equal(params[n].detach(), start[n] - 0.01 * torch.sign(p.grad)), n
        else:
            assert torch.equal(params[n].detach(), start[n]), n
    assert rule.steps == [1] * len(names)
    rule.detach()
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("sets", [(), ("model.name=tiny-llama", "train.precision=bf16"),
                                  ("bcd.expand=normalized", "model.name=tiny-llama", "train.precision=bf16")],
                         ids=["fp32", "bf16", "normalized-bf16"])
def test_a_sign_visit_interrupted_and_resumed_ends_bitwise_where_an_uninterrupted_one_does(tiny_cfg, monkeypatch,
                                                                                          sets):
    """The suffix weights and their step counts (the stochastic rounding's seed under bf16) travel in the mid-visit
    checkpoint: a visit stopped at step 5 and resumed commits the files an uninterrupted visit commits."""
    cfg = tiny_cfg(*SIGN, *sets, "bcd.max_steps=9", "checkpoint.every_steps=3", "checkpoint.max_share=1",
                   "checkpoint.every_seconds=1000")
    ds = new_run(cfg)
    assert new_run(cfg, "ref") == ds
    ref = train_block.fn(RunContext.of(cfg, "ref", ds), VisitSpec(0, 0, 0))
    polls = itertools.count(1)
    monkeypatch.setattr(stop_signals, "requested", lambda: next(polls) >= 5)
    with pytest.raises(SystemExit):
        train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 0, 0))
    monkeypatch.undo()
    resumed = train_block.fn(RunContext.of(cfg, "r", ds), VisitSpec(0, 0, 0))
    assert resumed.resumed_at == 5 and resumed.steps == ref.steps == 9
    assert resumed.block_file == ref.block_file and resumed.suffix_files == ref.suffix_files and ref.suffix_files


@pytest.mark.parametrize("sets,why", [(("train.offload=stream",), "train.offload=stream"),
                                      (("train.gpus=2",), "train.gpus > 1"),
                                      (("bcd.vocab_blocks=2",), "bcd.vocab_blocks > 1")])
def test_sign_where_it_cannot_run_is_one_line_naming_the_key(sets, why):
    with pytest.raises(ConfigError, match=rf"^bcd\.expand: sign runs in one process .*not with {why}") as e:
        load_config(sets=[*TINY, "bcd.expand=sign", *sets])
    assert "\n" not in str(e.value)


def test_sign_plans_its_visits_resident_and_a_run_refuses_another_suffix_rule_on_resume(tiny_cfg):
    from bcdflow.tasks.run import init_run

    cfg = tiny_cfg(*SIGN, "train.offload=auto")
    assert cfg.step_shape().offload == "off" and cfg.step_shape(no_grad=True).offload == "auto"
    assert cfg.step_shape().expand_rank == 0
    ds = new_run(cfg)
    with pytest.raises(ConfigError, match=r"bcd\.expand"):
        init_run.fn(tiny_cfg("bcd.expand=lora", "bcd.expand_lr=1e-3"), "r", ds)


def test_sign_reaches_a_loss_plain_bcd_does_not_when_the_suffix_must_move():
    """tests/test_expand.py's teacher problem (the student's last two layers knocked off by a rank-2 update; only the
    first layer trains): plain BCD gets from 7.6 to 5.9 in 300 steps; with the two layers after it stepped by sign
    descent at 1e-3 (no state) the same visit gets under 1 (0.37 measured)."""
    from tests.test_expand import teacher_problem

    plain, signed = teacher_problem(None), teacher_problem(1e-3)
    assert plain > 5 and signed < 0.2 * plain, (plain, signed)


@pytest.mark.parametrize("model,over", [("gpt2-124m", {}), ("L-1.5B", {"n_kv_head": 2, "d_ff": 352})],
                         ids=["gpt", "llama"])
@pytest.mark.parametrize("precision,recompute", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_the_planner_counts_the_sign_suffix_within_10_percent(model, over, precision, recompute):
    """What the suffix's gradients add (each suffix layer keeps its linear maps' inputs, one weight's gradient at a
    time, an untied head's from the loss on), planned against the CPU tensor tracker."""
    from tests.test_memory import measured_vs_planned

    torch.set_num_threads(1)
    for name, measured, planned in measured_vs_planned(model, over, precision, recompute, sign=True):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sign_visit_on_an_indexed_device_commits_the_same_files_with_recompute_on_and_off(tiny_cfg, precision):
    """The device named as a GPU names it (``cpu:0`` stands for ``cuda:0``), through the engine: the suffix's weights
    written inside backward give the same committed files whether the suffix's layers are recomputed in backward or
    kept (recompute re-runs a layer's forward before its weights' gradients exist, so it reads them unchanged)."""
    llama = ("model.name=tiny-llama", "train.precision=bf16") if precision == "bf16" else ()
    files = []
    for recompute in ("off", "on"):
        cfg = tiny_cfg(*SIGN, *llama, "train.device=cpu:0", f"bcd.recompute={recompute}")
        ds = new_run(cfg, f"rc-{recompute}")
        out = train_block.fn(RunContext.of(cfg, f"rc-{recompute}", ds), VisitSpec(0, 0, 0))
        assert RunContext.of(cfg, f"rc-{recompute}", ds).device == torch.device("cpu", 0) and out.recompute == \
            (recompute == "on")
        files.append((out.block_file, out.suffix_files))
    assert files[0] == files[1] and files[0][1]


def test_the_normalized_rule_steps_each_weight_along_its_gradient_at_an_rms_of_the_rate():
    """``bcd.expand=normalized`` (issue 41's other state-free rule): ``w -= lr * sqrt(n) * g / ||g||`` per weight, in
    its hook, no gradient kept: sign's step size (an RMS of ``lr``), the gradient's direction."""
    torch.manual_seed(0)
    cfg = get_config("tiny", n_layer=3, d_model=32, n_head=2, vocab_size=64, n_ctx=16)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters() if layer(n) == 2 or n.startswith("ln_f")]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    rule = SignSuffix(model, names, lambda: 0.01, seed=3, rule="normalized").attach()
    x, y = torch.randint(64, (4, 16)), torch.randint(64, (4, 16))
    ref = build_model(cfg, init=False)
    ref.load_state_dict(start)
    visit_loss(ref, x, y, 0, False, hi=3).backward()
    visit_loss(model, x, y, 0, False, hi=3).backward()
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if n in names:
            moved = start[n] - params[n].detach()
            assert params[n].grad is None
            want = 0.01 * p.grad.numel() ** 0.5 * p.grad / p.grad.norm()
            assert torch.allclose(moved, want, rtol=1e-5, atol=2e-7), n  # atol: 1 - (1 - step) in fp32
            assert abs(float(moved.pow(2).mean().sqrt()) - 0.01) < 1e-6, n  # an RMS of the rate
        else:
            assert torch.equal(params[n].detach(), start[n]), n
    rule.detach()
    with pytest.raises(ValueError, match="unknown suffix rule"):
        SignSuffix(model, names, lambda: 0.01, seed=3, rule="adam")


def test_a_normalized_run_refuses_the_other_rule_on_resume_and_a_streamed_suffix(tiny_cfg):
    """``bcd.expand=normalized`` (its bitwise resume is the sign test's ``normalized-bf16`` case): a run of it resumed
    with ``bcd.expand=sign`` is refused (``bcd.expand`` must match), and it cannot stream its suffix (one line naming
    the key)."""
    from bcdflow.tasks.run import init_run

    rule = ("bcd.expand=normalized", "bcd.expand_lr=1e-3")
    ds = new_run(tiny_cfg(*rule))
    with pytest.raises(ConfigError, match=r"bcd\.expand"):
        init_run.fn(tiny_cfg(*SIGN), "r", ds)
    with pytest.raises(ConfigError, match=r"^bcd\.expand: normalized runs in one process .*train\.offload=stream"):
        load_config(sets=[*TINY, *rule, "train.offload=stream"])
