"""How a visit holds its model (models/holding.py, models/memory.py's budget and no-grad passes): the device budget's
reserve, partial residency chosen to fit, the per-phase time model, the recommendation, the no-grad batch, and the
refusal of a plan that cannot fit. Pure planner arithmetic on meta shapes, plus CPU checks against what the code
allocates.

    python -m pytest -q tests/test_holding.py
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from bcdflow.models import build_model, get_config, model_plan
from bcdflow.models.holding import (choose_holding, fit_holding, no_grad_holding, recommend, spread, step_time,
                                    streamed_choice)
from bcdflow.models.memory import (CONTEXT_BYTES, FRAGMENTATION, GB, WORKSPACE_BYTES, NoGradPass, device_budget,
                                   no_grad_memory, no_grad_rows, visit_memory)
from bcdflow.models.specs import StepShape

BF16 = StepShape(2, 1024, "bf16")  # Llama-3-8B's shape in docs/guide/memory.md: 2 x 1024 tokens, bf16

L8B = dict(family="llama", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab_size=128256,
           n_ctx=8192)


def llama8b():
    from bcdflow.models.model_config import ModelConfig
    return ModelConfig(**L8B, tie_embeddings=False, bias=False)


def test_the_budget_keeps_the_context_and_a_stated_reserve():
    b = device_budget(24 * GB)
    free = 24 * GB - CONTEXT_BYTES
    assert b.free == int(free) and b.reserve == int(WORKSPACE_BYTES + FRAGMENTATION * free)
    assert b.usable == b.free - b.reserve and 21 * GB < b.usable < 22 * GB
    measured = device_budget(24 * GB, free=20 * GB)  # what mem_get_info says once the context exists
    assert measured.free == 20 * GB and measured.usable < 20 * GB
    assert device_budget(24 * GB, gpus=2).reserve > b.reserve  # NCCL's buffers with several processes
    assert "reserve" in b.line() and "context" in b.line()


def test_partial_residency_streams_the_fewest_layers_that_fit():
    cfg = llama8b()
    plan = model_plan(cfg, 8)
    budget = device_budget(24 * GB).usable
    h = choose_holding(cfg, plan, 0, BF16, budget)
    assert h.fits and h.estimate.peak <= budget
    assert 0 < len(h.streamed) < h.frozen  # some frozen layers stay resident: the card is used, not left idle
    fewer = streamed_choice(sorted(h.estimate.layer_sizes), plan.visits[0].layers[0], len(h.streamed) - 1)
    less = visit_memory(cfg, plan, 0, replace(h.shape, streamed=fewer))
    assert less.peak > budget  # one layer fewer streamed would not fit: the fewest
    # every held frozen layer streamed (train.offload=stream) and none (off)
    assert choose_holding(cfg, plan, 0, replace(BF16, offload="stream"), budget).streamed == tuple(
        sorted(h.estimate.layer_sizes))
    off = choose_holding(cfg, plan, 0, replace(BF16, offload="off"), budget)
    assert off.streamed == () and not off.fits
    # no budget (the CPU): nothing streams unless asked
    assert choose_holding(cfg, plan, 0, BF16, None).streamed == ()


def test_streamed_layers_are_spread_prefix_first():
    assert spread(list(range(10)), 2) == [2, 7] and spread([4, 5, 6], 3) == [4, 5, 6] and spread([1, 2], 0) == []
    assert streamed_choice([0, 1, 2, 6, 7, 8, 9], lo=4, k=2) == (0, 2)  # the prefix: copied for the forward only
    assert streamed_choice([0, 1, 6, 7, 8, 9], lo=4, k=4) == (0, 1, 7, 9)


def test_the_time_model_counts_copies_per_phase_and_when_they_hide():
    cfg = llama8b()
    plan = model_plan(cfg, 12)
    e = visit_memory(cfg, plan, 0, replace(BF16, offload="stream"))
    sizes = {i: f for i, (_, f) in e.layer_sizes.items()}
    streamed = replace(BF16, recompute="on", streamed=e.streamed)
    t = step_time(cfg, plan, 0, streamed, sizes)
    assert t.streamed_s > t.resident_s > 0 and t.copy_fwd_bytes > 0 and t.copy_bwd_bytes > 0
    assert t.copy_fwd_bytes + t.copy_bwd_bytes == e.copy_bytes  # the same slot plan as the memory estimate
    # a fully streamed forward at 2x1024 is PCIe-bound: each Llama-3-8B layer copies in 17 ms at 25 GB/s and
    # computes in 11 ms at 80 TFLOP/s; from the tokens the model names, the copies hide (within 1%)
    assert t.hides_at_tokens and t.hides_at_tokens > 2048
    rows = math.ceil(t.hides_at_tokens / 1024)
    big = step_time(cfg, plan, 0, replace(streamed, batch=rows), sizes)
    assert big.overhead <= 0.011
    # resident: no copies, no overhead; recompute adds the suffix's forward to the resident time
    plain = step_time(cfg, plan, 0, replace(BF16, recompute="off"))
    assert plain.overhead == 0 and plain.resident_s < t.resident_s


def test_the_time_model_is_per_precision():
    """fp32 (the default precision) computes at about half bf16's rate on a 4090 (CUDA cores, no TF32): the same
    visit's resident step takes twice as long, so the same copies hide behind it from half the tokens; a given
    ``train.tflops`` overrides both. One constant for both (80) made fp32 visits look twice as fast as they run."""
    from bcdflow.models.specs import TFLOPS, tflops_for

    cfg = llama8b()
    plan = model_plan(cfg, 12)
    e = visit_memory(cfg, plan, 0, replace(BF16, offload="stream"))
    sizes = {i: f for i, (_, f) in e.layer_sizes.items()}
    t = {p: step_time(cfg, plan, 0, replace(BF16, precision=p, recompute="on", streamed=e.streamed), sizes)
         for p in ("fp32", "bf16")}
    assert TFLOPS["fp32"] == TFLOPS["bf16"] / 2 and tflops_for("bf16", 120.0) == 120.0
    assert t["fp32"].resident_s == pytest.approx(2 * t["bf16"].resident_s)
    assert t["fp32"].overhead < t["bf16"].overhead and t["fp32"].hides_at_tokens < t["bf16"].hides_at_tokens
    given = step_time(cfg, plan, 0, replace(BF16, recompute="on", precision="fp32", tflops=TFLOPS["bf16"]))
    assert given.resident_s == pytest.approx(t["bf16"].resident_s)
    # the holding a run chooses times it at its precision
    h = {p: choose_holding(cfg, plan, 0, replace(BF16, precision=p, recompute="on", offload="stream"),
                           device_budget(80 * GB).usable) for p in ("fp32", "bf16")}
    assert h["fp32"].time.resident_s == pytest.approx(2 * h["bf16"].time.resident_s)


def test_auto_picks_the_faster_way_that_fits():
    """With bcd.recompute=auto and train.offload=auto the visit is held the fastest way that fits; with a budget that
    fits everything resident, nothing streams and nothing recomputes."""
    cfg = llama8b()
    plan = model_plan(cfg, 8)
    roomy = choose_holding(cfg, plan, 3, BF16, 200 * GB)
    assert roomy.streamed == () and not roomy.recompute and roomy.time.overhead == 0
    tight = choose_holding(cfg, plan, 3, BF16, device_budget(24 * GB).usable)
    others = [choose_holding(cfg, plan, 3, replace(BF16, recompute=r), device_budget(24 * GB).usable)
              for r in ("on", "off")]
    assert tight.fits and all(tight.time.streamed_s <= o.time.streamed_s for o in others if o.fits)


def test_the_recommendation_fits_every_visit_with_the_reserve():
    cfg = llama8b()
    budget = device_budget(24 * GB)
    rec = recommend(cfg, BF16, budget)
    assert rec.blocks and all(h.fits for h in rec.holdings) and rec.worst_peak <= budget.usable
    fewer = model_plan(cfg, rec.blocks - 1)  # the smallest count: one block fewer leaves a visit that does not fit
    assert not all(fit_holding(cfg, fewer, b, BF16, budget.usable).fits for b in range(len(fewer.visits)))
    assert rec.host_bytes >= max(h.estimate.host_bytes for h in rec.holdings) > 0
    assert f"bcd.blocks={rec.blocks}" in rec.line() and "usable" in rec.line()


def test_no_grad_batch_is_the_most_rows_that_fit():
    cfg = get_config("L-1.5B")
    prefix = NoGradPass((0, 10), True, False, limit=256)
    room = no_grad_memory(cfg, prefix, replace(BF16, batch=8)).peak
    rows = no_grad_rows(cfg, prefix, BF16, room)
    assert rows == 8  # the peak grows with the rows: 8 fit exactly, 9 do not
    assert no_grad_rows(cfg, replace(prefix, limit=4), BF16, room) == 4
    assert no_grad_rows(cfg, replace(prefix, limit=1000), replace(BF16, seq=64), None) == 16384 // 64  # no budget
    # a prefix too big for the budget streams its layers, the fewest that let a batch (2 rows) fit, then fills rows
    small = no_grad_memory(cfg, prefix, BF16).peak - 1
    streamed, r = no_grad_holding(cfg, prefix, BF16, small)
    assert streamed and r >= 2
    assert no_grad_memory(cfg, prefix, replace(BF16, batch=r, streamed=streamed)).peak <= small


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])
def test_no_grad_memory_agrees_with_the_cpu_tracker(family):
    """A no-grad forward's peak (pre-inference's prefix, evaluation with the head) against the CPU tensor tracker."""
    from benchmarks.common import LiveBytes, tensor_bytes
    from bcdflow.models.visit_compute import prefix_hidden

    torch.set_num_threads(1)
    cfg = get_config(family, vocab_size=2048, n_layer=4, d_model=128, n_head=4)
    for head in (False, True):
        model = build_model(cfg, layers=(0, 4), embed=True, head=head).eval().requires_grad_(False)
        x, y = torch.randint(0, 2048, (8, 64)), torch.randint(0, 2048, (8, 64))
        base = tensor_bytes(list(model.parameters()), list(model.buffers()), x, y)
        with torch.inference_mode(), LiveBytes() as tracker:
            out = model(x, y) if head else prefix_hidden(model, x, 4)
        del out
        measured = base + tracker.peak
        planned = no_grad_memory(cfg, NoGradPass((0, 4), True, head), StepShape(8, 64, "fp32")).peak
        assert abs(planned / measured - 1) <= 0.15, (head, measured, planned)


def test_a_plan_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, capsys):
    from bcdflow.flows.cli import main

    store = tmp_path / "s"
    sets = ["model.name=L-6B", "data.seq_len=1024", "train.batch_size=2", "train.precision=bf16", "bcd.blocks=2",
            "train.memory_gb=8", "tracking_uri=none"]
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--store", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.memory_gb:" in err[0] and "usable" in err[0] and "reserve" in err[0], err
    assert not store.exists()


def test_plan_memory_rows_of_the_recommendation_all_fit(capsys):
    from bcdflow.flows.cli import main

    args = ["plan-memory", "--set", "model.name=L-6B", "--set", "data.seq_len=1024", "--set", "train.batch_size=2",
            "--set", "train.precision=bf16", "--gpu-gb", "24"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reserve" in out and "(recommended)" in out and "recommended: bcd.blocks=" in out
    rec = out.split("(recommended):")[1].split("\n\n")[0]
    rows = [r for r in rec.splitlines() if r.startswith("block ")]
    assert rows and all(r.endswith("yes") for r in rows), rec  # the recommendation's own table never says no
    assert "trains" in out and "holds" in out  # the layers a visit trains and those it holds, apart


def test_the_planners_public_functions_take_the_shape_not_loose_settings():
    """Every public function of the planner takes at most five parameters: the model config, the plan and block it
    plans a visit of, the step's shape (models/specs.StepShape, built once by ``RunConfig.step_shape``) and a
    budget; a setting the planner gains is a field of the shape, not a parameter at every call site.
    ``visit_memory`` took 20, ``choose_holding`` 16. And models/holding.py uses models/memory.py's public names only."""
    import ast
    import inspect

    from bcdflow.models import holding, memory

    for mod in (memory, holding):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ == mod.__name__ and not name.startswith("_"):
                assert len(inspect.signature(fn).parameters) <= 5, (mod.__name__, name)
    tree = ast.parse(inspect.getsource(holding))
    private = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == memory.__name__
               for a in n.names if a.name.startswith("_")]
    assert not private, private


def test_choose_cuts_gives_the_fewest_spans_that_fit_and_evens_them():
    """The cut search on its own (any units: layers, later a vocabulary matrix's row slices): heavy ends (an
    embedding, a head) get spans of their own size, the fewest spans that fit, evened out rather than packed in
    front; None when one unit alone is over the budget."""
    from bcdflow.models.holding import choose_cuts

    costs = [6, 1, 1, 1, 1, 1, 1, 1, 1, 6]

    def fits(lo, hi, cap):
        return sum(costs[lo:hi]) <= cap

    cuts = choose_cuts(len(costs), fits, 8)
    spans = list(zip(cuts, cuts[1:]))
    assert len(spans) == 3 and all(sum(costs[a:b]) <= 8 for a, b in spans), cuts  # 20 units of cost: 3 spans
    assert max(sum(costs[a:b]) for a, b in spans) <= 7, cuts  # evened: greedy alone packs 8, 7, 5
    assert choose_cuts(3, lambda lo, hi, cap: hi - lo <= 3, 10) == [0, 3]
    assert choose_cuts(len(costs), fits, 5) is None


def test_boundaries_chosen_by_fit_need_fewer_blocks_than_equal_splits():
    """Issue 33: Llama-3-8B (bf16, 2x1024, the reserve counted) on a 16 GB card, full-parameter: with the lighter
    state its visits fit in 5 blocks cut where they fit (the embedding's and the head's blocks fewer layers), which 5
    equal splits do not; every recommended visit fits the budget."""
    from bcdflow.models.holding import fit_boundaries

    cfg = llama8b()
    budget = device_budget(16 * GB)
    shape = replace(BF16, optim="adamw8bit-bf16")
    rec = recommend(cfg, shape, budget)
    assert rec.blocks == 5 and rec.boundaries and len(rec.boundaries) == 4, rec.line()
    assert all(h.fits and h.estimate.peak <= budget.usable for h in rec.holdings)
    assert rec.boundaries == fit_boundaries(cfg, shape, budget.usable)
    equal = model_plan(cfg, 5)
    assert not all(fit_holding(cfg, equal, b, shape, budget.usable).fits for b in range(5))
    assert f"bcd.boundaries=[{','.join(map(str, rec.boundaries))}]" in rec.line()
    assert recommend(cfg, BF16, budget).blocks is None  # fp32 AdamW: no block count fits 16 GB


def test_the_planner_recommends_the_lighter_state_where_it_halves_the_blocks():
    """Llama-3-8B on 24 GB (no expansion): fp32 AdamW needs 8 blocks, bf16 masters with 8-bit moments at most 5
    (the issue's target), so that is recommended, with what fp32 AdamW would need beside it."""
    from bcdflow.models.holding import recommend_state

    cfg = llama8b()
    budget = device_budget(24 * GB)
    rec = recommend_state(cfg, BF16, budget)
    assert rec.settings.get("optim.name") == "adamw8bit-bf16" and rec.blocks <= 5, rec.line()
    assert "optim.name=adamw8bit-bf16" in rec.line() and "fp32 AdamW needs bcd.blocks=8" in rec.hint
    assert all(h.estimate.peak <= budget.usable for h in rec.holdings)
    assert recommend_state(cfg, replace(BF16, optim="sgd"), budget).settings.get("optim.name") is None


def test_plan_memory_times_a_visit_by_the_cards_kind(capsys):
    """``plan-memory``'s step times are the card kind's (``spend.train_device``; models/specs.CARD_RATES): Llama-3-8B
    at 2x1024 in bf16 on its own card, a 24 GB RTX 4090 and an 80 GB A100, at least 1.5x apart in every visit (a
    4090's rates for every card made them one); the rates it used are in its output."""
    import json

    from bcdflow.flows.cli import main
    from bcdflow.models.specs import CARD_RATES

    def plan(kind: str, gpu_gb: str) -> dict:
        sets = ["model.from_hf=benchmarks/shapes/llama-3-8b", "train.batch_size=2", "data.seq_len=1024",
                "train.precision=bf16", "bcd.blocks=9", f"spend.train_device={kind}"]
        assert main(["plan-memory", *[a for kv in sets for a in ("--set", kv)], "--gpu-gb", gpu_gb, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    rtx, a100 = plan("rtx4090", "24"), plan("a100", "80")
    assert (rtx["tflops"], rtx["pcie_gbs"], rtx["card"]) == (80.0, 25.0, "rtx4090")
    assert (a100["tflops"], a100["pcie_gbs"]) == (CARD_RATES["a100"].bf16, CARD_RATES["a100"].pcie_gbs)
    assert all(v["fits"] for v in rtx["visits"] + a100["visits"])
    ratios = [r["step_s"] / a["step_s"] for r, a in zip(rtx["visits"], a100["visits"])]
    assert len(ratios) == 9 and min(ratios) >= 1.5, ratios
    mean = [sum(v["step_s"] for v in p["visits"]) / 9 for p in (rtx, a100)]
    assert mean[0] >= 1.5 * mean[1], mean
