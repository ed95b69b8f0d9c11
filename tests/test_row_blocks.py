"""``bcd.vocab_blocks``: the token embedding and an untied head trained in row blocks (issue 33, item 2;
docs/DESIGN.md §2.7, docs/guide/row-blocks.md). A row visit changes only its rows (bitwise elsewhere, in every block),
its optimizer holds the slice alone, the slice's gradient is those rows of the whole matrix's (bitwise on the CPU),
the planner agrees with the CPU tensor tracker, and a killed run with row blocks resumes bitwise and exports as a run
without them does.

    python -m pytest -q tests/test_row_blocks.py
"""
from __future__ import annotations

import gc
import json
import os
import signal
from dataclasses import replace

import pytest
import torch

from benchmarks.common import Workload
from bcdflow.core.context import RunContext
from bcdflow.flows.cli import main
from bcdflow.models import build_model, get_config, model_plan
from bcdflow.models.memory import visit_memory
from bcdflow.models.rows import attach_rows, detach_rows
from bcdflow.models.specs import StepShape
from bcdflow.models.visit_compute import visit_loss
from bcdflow.storage import runs
from bcdflow.storage.checkpoints import load_blocks
from bcdflow.storage.store import Store
from bcdflow.tasks.engine import prepare_model
from tests.helpers import TINY, Spy, assert_same, do_visit, finished_weights, new_run


def _all(store: Store, version: int) -> dict[str, torch.Tensor]:
    return load_blocks(store, "r", version)


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_a_row_visit_trains_and_changes_only_its_rows(tiny_cfg, monkeypatch, model):
    """Each row block of the plan (the tied embedding; the untied embedding and head): the optimizer gets one
    (rows, C) parameter, the commit changes those rows of the matrix and nothing else of any block, bitwise."""
    cfg = tiny_cfg(f"model.name={model}", "bcd.vocab_blocks=2")
    ds_id = new_run(cfg)
    ctx = RunContext.of(cfg, "r", ds_id)
    plan, store = ctx.plan, Store(cfg.store)
    matrices = ["wte.weight"] + ([] if ctx.model_cfg.tied else ["lm_head.weight"])
    assert [(b.params, b.rows) for b in plan.extra] == [((m,), r) for m in matrices for r in ((0, 256), (256, 512))]
    assert all(m not in ctx.trainable(plan.owner(m)) for m in matrices)  # the owner's own visit leaves it alone
    spy = Spy(monkeypatch)
    version = 0
    for blk in plan.extra:
        before = _all(store, version)
        out = do_visit(cfg, "r", ds_id, cycle=0, block=blk.index, version=version)
        version += 1
        after = _all(store, version)
        name, (lo, hi) = blk.params[0], blk.rows
        (params,) = spy.opt_params[-1:]
        assert [tuple(p.shape) for p in params] == [(hi - lo, ctx.model_cfg.d_model)]  # the slice, nothing else
        assert out.stored == blk.stored
        for k in before:
            if k != name:
                assert torch.equal(before[k], after[k]), k
        assert torch.equal(before[name][:lo], after[name][:lo]) and torch.equal(before[name][hi:], after[name][hi:])
        assert (before[name][lo:hi] != after[name][lo:hi]).any(dim=1).all()  # every row of the slice trained


@pytest.mark.parametrize("sets", [("bcd.vocab_blocks=2",), ("bcd.freeze=[embeddings,head]",)],
                         ids=["row-blocks", "freeze"])
def test_under_bf16_a_visit_commits_the_matrices_it_holds_frozen_as_stored(tiny_cfg, sets):
    """Under ``train.precision=bf16`` a layer block's visit holds its frozen matrices in bf16 (a matrix trained in
    row blocks, or one ``bcd.freeze`` keeps): its commit writes them as the base version stores them (fp32, bitwise),
    never the held bf16 copy, so a row block's fp32 rows are not rounded by the next visit of the matrix's block."""
    cfg = tiny_cfg("model.name=tiny-llama", "train.precision=bf16", *sets)
    ds_id = new_run(cfg)
    ctx = RunContext.of(cfg, "r", ds_id)
    store, last = Store(cfg.store), len(ctx.plan.blocks) - 1
    before = _all(store, 0)
    do_visit(cfg, "r", ds_id, cycle=0, block=0, version=0)
    do_visit(cfg, "r", ds_id, cycle=0, block=last, version=1)
    after = _all(store, 2)
    for name in ("wte.weight", "lm_head.weight"):
        assert after[name].dtype == torch.float32 and torch.equal(before[name], after[name]), name
    assert not torch.equal(before["h.0.attention.wq.weight"], after["h.0.attention.wq.weight"])  # block 0 trained


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model,name", [("tiny", "wte.weight"), ("tiny-llama", "wte.weight"),
                                        ("tiny-llama", "lm_head.weight")])
def test_the_slice_gradient_is_those_rows_of_the_whole_matrix_gradient(model, name, precision):
    """At the same weights, the first step's gradient of rows [lo, hi) trained as a slice equals, bitwise, those
    rows of the gradient the matrix gets when it trains whole (a tied matrix's two uses summed alike). Under bf16
    too, with the matrix held in bf16 as a row visit holds it and the slice's rows off bf16's grid: the slice's
    tokens look up its fp32 rows and its gradient is summed in fp32 (over loss chunks, repeated tokens, a tied
    matrix's two uses), as a trainable fp32 matrix's are, never in the held bf16."""
    torch.manual_seed(0)
    cfg = get_config(model, vocab_size=512)
    whole = build_model(cfg)
    if precision == "bf16":  # weights a bf16 matrix holds exactly, so both models start equal
        with torch.no_grad():
            for p in whole.parameters():
                p.copy_(p.bfloat16().float())
    part = build_model(cfg, init=False)
    part.load_state_dict(whole.state_dict())
    x = torch.randint(512, (4, 32))
    y = torch.randint(512, (4, 32))
    lo, hi = 100, 300
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    (_, w), = prepare_model(whole, {name}, 64, False)
    if precision == "bf16":  # trained rows off bf16's grid, as after a step: the held matrix can only round them
        with torch.no_grad():
            w[lo:hi] += 1e-3 * torch.randn(hi - lo, cfg.d_model)
    with bf16:
        loss = visit_loss(whole, x, y, 0, False, hi=0)
    loss.backward()
    assert prepare_model(part, set(), 64, False) == []
    if precision == "bf16":
        dict(part.named_parameters())[name].data = w.detach().bfloat16()
    rows = attach_rows(part, name, lo, hi, init=w[lo:hi])  # the slice's own (fp32) values, as stored
    with bf16:
        loss = visit_loss(part, x, y, 0, False, hi=0)
    loss.backward()
    assert rows.grad is not None and rows.grad.shape == (hi - lo, cfg.d_model)
    assert torch.equal(rows.grad, w.grad[lo:hi])
    assert [p for p in part.parameters() if p.requires_grad] == [rows]  # no gradient of the whole matrix
    with torch.no_grad():
        rows.add_(1.0)
    detach_rows(part, name)
    got = dict(part.named_parameters())[name].float()
    if precision == "fp32":
        assert torch.equal(got[lo:hi], w[lo:hi] + 1.0)
    assert torch.equal(got[:lo], w[:lo]) and torch.equal(got[hi:], w[hi:])


def test_a_deep_copy_with_rows_attached_reads_and_trains_its_own_slice():
    import copy

    model = build_model(get_config("tiny", vocab_size=512))
    attach_rows(model, "wte.weight", 0, 10)
    twin = copy.deepcopy(model)
    mine = twin.wte.parametrizations.weight[0].rows
    with torch.no_grad():
        mine.add_(1.0)
    idx = torch.arange(5)[None]
    assert torch.equal(twin.wte(idx), model.wte(idx) + 1.0)
    twin.wte(idx).sum().backward()
    assert mine.grad is not None and model.wte.parametrizations.weight[0].rows.grad is None
    detach_rows(twin, "wte.weight")
    assert type(twin.wte) is torch.nn.Embedding and "forward" not in vars(twin.wte)


def test_a_slice_outside_the_matrix_is_refused():
    model = build_model(get_config("tiny", vocab_size=512))
    for lo, hi in ((0, 513), (-1, 5), (5, 5)):
        with pytest.raises(ValueError, match="outside wte.weight"):
            attach_rows(model, "wte.weight", lo, hi)


def test_a_params_split_balances_without_the_split_matrices_and_the_planner_counts_the_slice():
    cfg = get_config("tiny-llama", vocab_size=32000)  # matrices as large as several layers
    whole, split = model_plan(cfg, 3), model_plan(cfg, 3, vocab_blocks=4)
    assert len(split.visits) == 3 + 8 and len(split.blocks) == 3
    assert split.blocks[0].layers[1] > whole.blocks[0].layers[1]  # block 0 no longer carries the embedding
    shape = StepShape(2, 32, "bf16")
    row = visit_memory(cfg, split, 3, shape)  # the embedding's first quarter of rows
    assert row.trainable_params == 8000 * cfg.d_model
    assert row.optim == 4 * 2 * 8000 * cfg.d_model  # AdamW's two fp32 moments of the slice only
    assert visit_memory(cfg, whole, 0, shape).optim > 4 * row.optim


def _measured_vs_planned(model, over, precision, rows=64, B=4, T=64):
    # n_ctx = T: the planner counts LLaMA's RoPE tables at n_ctx rows (an upper bound: built for the longest sequence
    # seen), which beside a head-only visit of this tiny shape would be a fifth of the gap allowed
    c = {"model": model, "overrides": {"n_layer": 6, "d_model": 128, "n_head": 4, "vocab_size": 2048, "n_ctx": T,
                                       **over},
         "batch_size": B, "seq_len": T, "precision": precision}
    w = Workload(c, torch.device("cpu"))
    w.args.chunk_rows = rows
    plan = w.plan(3, vocab_blocks=2)
    out = []
    for blk in plan.extra:
        v = w.visit(f"b{blk.index}", blk, preinfer=True)
        v.step(timed=False)
        measured = v.peak()["peak_bytes"]
        est = visit_memory(w.cfg, plan, blk.index, StepShape(B, T, precision, "adamw", chunk_rows=rows,
                                                             recompute="off", preinfer=True, offload="off"))
        out.append((est.name, measured, est.peak))
        del v
        gc.collect()
    return out


@pytest.mark.parametrize("model,over", [("gpt2-124m", {}), ("L-1.5B", {"n_kv_head": 2, "d_ff": 352})],
                         ids=["gpt", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planner_agrees_with_the_tracker_on_row_visits_within_10_percent(model, over, precision):
    torch.set_num_threads(1)
    got = _measured_vs_planned(model, over, precision)
    assert len(got) == (2 if model == "gpt2-124m" else 4)
    for name, measured, planned in got:
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


def test_the_planner_recommends_row_blocks_only_where_whole_matrices_fit_in_no_block():
    """Llama-3-8B (bf16, 2x1024, the reserve counted) on an 8 GB card: no block that owns the 128k-row embedding or
    head fits, with any state; with the matrices in row blocks the layer blocks cut by fit and the fewest row blocks
    fit, every visit within the budget, and the recommendation's settings make that plan. On 16 GB the whole matrices
    fit (5 blocks), so no row blocks are recommended there."""
    from bcdflow.models.holding import recommend, recommend_state
    from bcdflow.models.memory import GB, device_budget

    cfg = get_config("tiny-llama", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab_size=128256,
                     n_ctx=8192)  # Llama-3-8B's shape (benchmarks/shapes/llama-3-8b)
    shape = StepShape(2, 1024, "bf16")
    budget = device_budget(8 * GB)
    assert recommend(cfg, replace(shape, optim="adamw8bit-bf16"), budget).blocks is None
    rec = recommend_state(cfg, shape, budget)
    k = rec.settings.get("bcd.vocab_blocks")
    assert rec.blocks and k and k == rec.vocab_blocks > 1, rec.line()
    assert f"bcd.vocab_blocks={k}" in rec.line() and "whole vocabulary matrices fit in no block count" in rec.hint
    plan = model_plan(cfg, rec.blocks, rec.boundaries, vocab_blocks=k)
    assert len(plan.visits) == len(rec.holdings) == rec.blocks + 2 * k  # an untied head: both matrices in rows
    assert all(h.fits and h.estimate.peak <= budget.usable for h in rec.holdings)
    wider = recommend_state(cfg, shape, device_budget(16 * GB))
    assert wider.vocab_blocks == 1 and "bcd.vocab_blocks" not in wider.settings, wider.line()


def test_plan_memory_plans_the_configs_row_blocks(capsys):
    """``plan-memory`` plans a config's own ``bcd.vocab_blocks``: a row per row block, named by its matrix."""
    assert main(["plan-memory", "--set", "model.name=tiny-llama", "--set", "bcd.vocab_blocks=2", "--gpu-gb", "24"]) == 0
    out = capsys.readouterr().out.split("(recommended)")[0]
    assert out.count("emb rows") == 2 and out.count("lm rows") == 2, out
    # a recommendation of row blocks shows its own table (Llama-3-8B's shape on an 8 GB card), every visit fitting
    assert main(["plan-memory", "--set", "model.from_hf=benchmarks/shapes/llama-3-8b", "--set", "train.batch_size=2",
                 "--set", "data.seq_len=1024", "--set", "train.precision=bf16", "--gpu-gb", "8"]) == 0
    rec = capsys.readouterr().out.split("bcd.vocab_blocks=2 (recommended):")[1].split("\n\n")[0]
    rows = [r for r in rec.splitlines() if r.startswith("block ")]
    assert all(r.endswith("yes") for r in rows) and rec.count("emb rows") == 2 and rec.count("lm rows") == 2, rec


# -- the command line: bad input, resume and export -----------------------------------------------------------------

def _sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, "tracking_uri=none", *extra] for a in ("--set", s)]


@pytest.mark.parametrize("sets,message", [
    (["bcd.vocab_blocks=513"], "bcd.vocab_blocks: 513 row blocks of a 512-row vocabulary matrix"),
    (["bcd.vocab_blocks=0"], "bcd.vocab_blocks: Input should be greater than or equal to 1"),
    (["bcd.vocab_blocks=2", "bcd.order=greedy"], "bcd.vocab_blocks: row blocks are not for bcd.order=greedy"),
])
def test_a_bad_row_split_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, sets, message):
    store = tmp_path / "store"
    assert main(["train", *_sets(*sets), "--store", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bcdflow: error: ") and message in err[0], err
    assert not store.exists()


ROWS = ["bcd.vocab_blocks=2", "model.name=tiny-llama", "checkpoint.every_steps=2", "checkpoint.max_share=1"]


@pytest.fixture(scope="module")
def rows_reference(prefect_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("rows-ref")
    assert main(["train", *_sets(*ROWS), "--store", str(root), "--run-id", "ref"]) == 0
    return root


@pytest.mark.slow
def test_a_row_block_run_killed_mid_visit_resumes_bitwise_and_exports_as_any_run(prefect_api_url, rows_reference,
                                                                                 tmp_path):
    """kill -9 at the second checkpoint of the head's first row visit (c0-b5: trained from the whole model's stored
    activations), then ``bcdflow resume``: the weights equal the uninterrupted run's bitwise; the Hugging Face export
    holds the model's tensors at their shapes, as a run without row blocks exports them."""
    from tests.test_resume import _cli

    ref = Store(str(rows_reference))
    assert [v.block for v in runs.read_state(ref, "ref").visits] == list(range(7))
    store = str(tmp_path / "store")
    # 2 checkpoints (steps 2, 4; the last step commits instead) per visit of 6 steps: the 12th is c0-b5's second
    killed = _cli(prefect_api_url, "train", *_sets(*ROWS), "--store", store, "--run-id", "k",
                  env={"BCDFLOW_FAILPOINTS": "train-checkpoint:12"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    pointer = Store(store).read_json("runs/k/visits/c0-b5/train-ckpt/ckpt.json")
    assert pointer["step"] == 4
    done = _cli(prefect_api_url, "resume", "k", "--store", store)
    assert done.returncode == 0, done.stderr[-3000:]
    visits = runs.read_state(Store(store), "k").visits
    assert [v.block for v in visits] == list(range(7)) and visits[5].resumed_at == 4
    assert_same(finished_weights(Store(store), "k"), finished_weights(ref, "ref"))
    # the export: a transformers directory of the model's own tensors, the trained rows in it
    out, plain = tmp_path / "hf", tmp_path / "hf-plain"
    assert main(["export", "k", str(out), "--format", "hf", "--store", store]) == 0
    assert main(["train", *_sets("model.name=tiny-llama", "bcd.cycles=1"), "--store", str(tmp_path / "p"),
                 "--run-id", "p"]) == 0
    assert main(["export", "p", str(plain), "--format", "hf", "--store", str(tmp_path / "p")]) == 0
    assert sorted(os.listdir(out)) == sorted(os.listdir(plain))
    from safetensors.torch import load_file

    got, other = load_file(str(out / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in other.items()}
    assert json.loads((out / "config.json").read_text()) == json.loads((plain / "config.json").read_text())
    final = finished_weights(Store(store), "k")
    assert torch.equal(got["lm_head.weight"], final["lm_head.weight"])
    assert torch.equal(got["model.embed_tokens.weight"], final["wte.weight"])


def test_under_bf16_a_row_visit_starts_from_the_stored_rows(tiny_cfg):
    """Under ``train.precision=bf16`` the visit's model holds the vocabulary matrices in bf16; a row visit's fp32
    slice starts from the rows the base version stores, not from the held matrix's bf16 rounding of them. At
    ``optim.lr=1e-12`` a whole cycle moves no tensor of any block by more than 1e-6 (the slice copied from the bf16
    copy moved ``wte`` and ``lm_head`` by ~2e-4: the rounding, committed)."""
    cfg = tiny_cfg("model.name=tiny-llama", "train.precision=bf16", "bcd.vocab_blocks=2", "optim.lr=1e-12")
    ds_id = new_run(cfg)
    ctx = RunContext.of(cfg, "r", ds_id)
    store = Store(cfg.store)
    before = _all(store, 0)
    for version in range(len(ctx.plan.visits)):
        do_visit(cfg, "r", ds_id, cycle=0, block=version, version=version)
    after = _all(store, len(ctx.plan.visits))
    assert ctx.plan.extra and before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == before[name].dtype
        assert (after[name].double() - before[name].double()).abs().max() <= 1e-6, name


def test_the_plan_s_visits_are_each_stored_block_s_then_the_row_visits_each_with_its_kind():
    """Issue 44: ``Plan.visits`` (``VisitTarget``: index, kind, the stored block its commit writes) beside
    ``Plan.blocks`` (the stored partition); a row visit's arithmetic is its kind's (models/rows.RowVisit), and the
    record a run stores keeps its shape (the row visits under ``rows``, each naming its ``owner``)."""
    from bcdflow.models.plan import VISIT_KINDS, LayerVisit, _kind

    cfg = get_config("tiny-llama", vocab_size=32000)
    plan, plain = model_plan(cfg, 3, vocab_blocks=2), model_plan(cfg, 3)
    assert [v.kind for v in plan.visits] == ["layers"] * 3 + ["rows"] * 4
    assert [v.index for v in plan.visits] == list(range(7)) and len(plan.blocks) == 3
    owners = [plan.owner("wte.weight")] * 2 + [plan.owner("lm_head.weight")] * 2
    assert [v.stored for v in plan.visits] == [0, 1, 2, *owners]
    assert plan.counts() == "3 blocks, 4 row visits" and model_plan(cfg, 1).counts() == "1 block"
    assert [r["owner"] for r in plan.to_dict()["rows"]] == owners and "rows" not in plain.to_dict()
    assert all(isinstance(_kind(k), LayerVisit) for k in VISIT_KINDS)
    row = plan.visits[3]
    C = cfg.d_model
    assert row.mechanism.trained_shape(row, "wte.weight", (32000, C)) == (16000, C)
    assert row.mechanism.label(row) == "wte.weight[0:16000]" and plain.visits[0].mechanism.label(plain.visits[0]) is None
    assert not row.mechanism.expands and plan.suffix(3, (), cfg.tied) == set()
    assert plan.suffix(0, (), cfg.tied) == {n for b in plan.visits[1:3] for n in b.trainable((), cfg.tied)}


def test_no_module_but_the_row_kind_s_branches_on_a_row_visit():
    """Issue 44: row visits were special-cased at 31 sites in 6 files; a visit's kind is now asked through its hooks
    (``LayerVisit``), so only models/plan.py (the kinds' registry and the plan's builder) and models/rows.py (the
    kind itself) test a visit for rows."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    branch = re.compile(r"\.rows is (not )?None|kind == \"rows\"|kind != \"layers\"|RowVisit|row_slice")
    found = sorted({str(p.relative_to(root)) for d in ("core", "models", "tasks", "flows", "storage", "tracking")
                    for p in (root / d).glob("*.py") if branch.search(p.read_text())})
    assert found == ["models/plan.py", "models/rows.py"], found


def test_a_row_visit_on_an_indexed_device_commits_the_same_file_as_on_the_plain_device(tiny_cfg):
    """The device named as a GPU names it (``cpu:0`` stands for ``cuda:0``), through the engine: a row visit of the
    embedding (its kind's ``attach`` from the stored rows, its ``commit`` into the stored block holding the matrix,
    the matrix held in bf16) commits the same file on ``cpu`` and ``cpu:0``, with the layers after it recomputed in
    backward and kept."""
    from bcdflow.core.rules import VisitSpec
    from bcdflow.tasks.train import train_block

    out = []
    for device, recompute in (("cpu", "off"), ("cpu:0", "off"), ("cpu:0", "on")):
        run = f"rows-{device.replace(':', '')}-{recompute}"
        cfg = tiny_cfg("model.name=tiny-llama", "train.precision=bf16", "bcd.vocab_blocks=2", "bcd.max_steps=4",
                       f"train.device={device}", f"bcd.recompute={recompute}")
        ds = new_run(cfg, run)
        ctx = RunContext.of(cfg, run, ds)
        first = len(ctx.plan.blocks)  # the embedding's first row visit
        assert ctx.plan.visits[first].kind == "rows"
        res = train_block.fn(ctx, VisitSpec(0, first, 0))
        assert res.recompute == (recompute == "on") and res.stored == ctx.plan.visits[first].stored
        out.append(res.block_file)
    assert out[0] == out[1] == out[2]
