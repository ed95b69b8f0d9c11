"""Landscape expansion (``bcd.expand=lora``; models/expand.py, tasks/expand.py; docs/DESIGN.md I1): a visit trains low-
rank adapters on the linear maps of the layers after its block and commits them merged, with the prefix bitwise
untouched; the committed version evaluates as the visit's own model; streamed = resident bitwise; DDP reduces the
adapters' gradients; kill -9 mid-visit resumes bitwise; the planner counts the adapters; and on a problem where the
layers after the block must move, expansion gets lower than plain BCD in the same steps.

    python -m pytest -q tests/test_expand.py
"""
from __future__ import annotations

import re
import signal

import pytest
import torch

from bcdflow.core.config import load_config
from bcdflow.core.context import RunContext, block_plan, model_config
from bcdflow.models import build_model
from bcdflow.models.model_config import get_config
from bcdflow.models.errors import ConfigError
from bcdflow.models.expand import SuffixAdapters, merged
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.models.visit_compute import visit_loss
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.checkpoints import commit_version, load_blocks, read_manifest
from bcdflow.storage.store import Store
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.train import evaluate_version, train_block
from bcdflow.core.rules import VisitSpec
from tests.helpers import Spy, assert_same, finished_weights, new_run
from tests.test_memory import measured_vs_planned

LORA = ("bcd.expand=lora", "bcd.expand_rank=4")
_LAYER = re.compile(r"^h\.(\d+)\.")


def expanded_visit(cfg, ds_id: str, block: int, version: int = 0, run_id: str = "r"):
    """One visit through the task functions (pre-infer, train) and its commit: its block and the suffix blocks."""
    ctx = RunContext.of(cfg, run_id, ds_id)
    if ctx.from_acts(block):
        for s in plan_shards.fn(ctx, 0, block):
            preinfer_shard.fn(ctx, 0, block, version, s)
    out = train_block.fn(ctx, VisitSpec(0, block, version))
    commit_version(Store(cfg.store), run_id, version, version + 1, out.files(block))
    return out


def layer(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# -- I1 with expansion ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,preinfer,family", [(0, True, "tiny"), (1, True, "tiny"), (1, False, "tiny"),
                                                   (2, True, "tiny"), (0, True, "tiny-llama")],
                         ids=["block0", "middle-preinfer", "middle-no-preinfer", "last", "llama-block0"])
def test_i1_an_expanded_visit_changes_its_block_and_the_suffixs_linear_maps_only(tiny_cfg, monkeypatch, block,
                                                                                  preinfer, family):
    llama = ("model.name=tiny-llama", "model.d_model=64", "model.n_head=4") if family == "tiny-llama" else ()
    cfg = tiny_cfg(*llama, f"bcd.preinfer={str(preinfer).lower()}", *LORA)
    ds_id = new_run(cfg)
    store = Store(cfg.store)
    plan = block_plan(cfg, model_config(cfg, 512))
    lo, hi = plan.visits[block].layers
    before = load_blocks(store, "r", 0)
    spy = Spy(monkeypatch)

    out = expanded_visit(cfg, ds_id, block)

    after = load_blocks(store, "r", 1)
    assert after.keys() == before.keys()
    active = set(plan.visits[block].params)
    moved = set()
    for name, t in before.items():
        if name in active or ((i := layer(name)) is not None and i >= hi and t.dim() == 2):
            assert not torch.equal(t, after[name]), f"{name} did not change"
            moved.add(name)
        else:  # the prefix, and everything of the suffix that is not a linear map (norms, biases, embeddings)
            assert torch.equal(t, after[name]), f"{name} changed"
    suffix = set(range(block + 1, len(plan.visits)))
    m0, m1 = read_manifest(store, "r", 0)["blocks"], read_manifest(store, "r", 1)["blocks"]
    assert {int(k) for k in m0 if m0[k] != m1[k]} == {block} | suffix
    (model,) = spy.models  # the frozen weights the visit held were read, never written (the merge is from the store)
    for name, p in model.named_parameters():
        if name not in active:
            assert torch.equal(p.detach(), before[name]), name
    assert set(out.suffix_norms) == suffix  # the record: which blocks changed and by how much (as stored)
    for b in suffix:
        diff = sum(float(((after[n] - before[n]).float() ** 2).sum()) for n in plan.visits[b].params)
        assert out.suffix_norms[b] == pytest.approx(diff ** 0.5, rel=1e-5) and out.suffix_norms[b] > 0


def test_expansion_off_is_todays_visit_bitwise(tiny_cfg):
    """``bcd.expand=off`` (and lora on the last block, which has no suffix) write the block file of a plain visit."""
    plain = tiny_cfg()
    ds_id = new_run(plain)
    a = expanded_visit(plain, ds_id, 1)
    ctx = RunContext.of(plain, "r", ds_id)
    for s in plan_shards.fn(ctx, 0, 2):
        preinfer_shard.fn(ctx, 0, 2, 1, s)
    b = train_block.fn(RunContext.of(tiny_cfg(*LORA), "r", ds_id), VisitSpec(0, 2, 1))
    c = train_block.fn(ctx, VisitSpec(0, 2, 1))
    assert a.suffix_files == {} and b.suffix_files == {} and b.block_file == c.block_file


def test_merged_adds_in_fp32_and_casts_to_the_stored_dtype():
    w = torch.randn(8, 4).to(torch.bfloat16)
    d = torch.full((8, 4), 1e-3)
    new, norm = merged({"x.weight": w, "x.bias": torch.ones(8)}, {"x.weight": d})
    assert new["x.weight"].dtype == torch.bfloat16 and torch.equal(new["x.bias"], torch.ones(8))
    assert torch.equal(new["x.weight"], (w.float() + d).to(torch.bfloat16))
    assert norm == pytest.approx(float((new["x.weight"].float() - w.float()).norm()))


# -- the committed version is the visit's model; streamed = resident ------------------------------------------

@pytest.mark.parametrize("block,extra", [(0, ()), (1, ()), (0, ("train.offload=stream", "model.name=tiny-llama"))],
                         ids=["block0", "middle", "streamed-llama"])
def test_the_committed_version_evaluates_as_the_visits_model(tiny_cfg, block, extra):
    cfg = tiny_cfg(*extra, *LORA)
    ds_id = new_run(cfg)
    out = expanded_visit(cfg, ds_id, block)
    whole = evaluate_version.fn(RunContext.of(cfg, "r", ds_id), 1).val_loss
    assert out.val_loss is not None and abs(out.val_loss - whole) <= 1e-5, (out.val_loss, whole)


@pytest.mark.parametrize("block", [0, 1])
def test_a_streamed_expanded_visit_equals_the_resident_one_bitwise(tiny_cfg, block):
    resident = tiny_cfg(*LORA, "train.offload=off")
    ds_id = new_run(resident)
    a = expanded_visit(resident, ds_id, block)
    b = train_block.fn(RunContext.of(tiny_cfg(*LORA, "train.offload=stream"), "r", ds_id), VisitSpec(0, block, 0))
    assert b.streamed > 0
    assert b.block_file == a.block_file and b.suffix_files == a.suffix_files and b.suffix_files


# -- the planner ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,over", [("gpt2-124m", {}), ("L-1.5B", {"n_kv_head": 2, "d_ff": 352})],
                         ids=["gpt", "llama"])
@pytest.mark.parametrize("precision,recompute", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_the_planner_counts_the_adapters_within_10_percent(model, over, precision, recompute):
    torch.set_num_threads(1)
    for name, measured, planned in measured_vs_planned(model, over, precision, recompute, expand=8):
        assert abs(planned / measured - 1) <= 0.10, (name, measured, planned)


# -- the step: clipping apart, lr ratio, config ------------------------------------------------------------------

def test_config_refuses_what_the_adapters_cannot_run_with():
    with pytest.raises(ConfigError, match=r"^bcd\.expand: .*train\.compile"):
        load_config(sets=["bcd.expand=lora", "train.compile=true"])
    with pytest.raises(ConfigError, match=r"^bcd\.expand: FSDP does not shard the adapters"):
        load_config(sets=["bcd.expand=lora", "train.gpus=2", "train.parallel=fsdp"])
    with pytest.raises(ConfigError, match=r"bcd\.expand_rank"):
        load_config(sets=["bcd.expand_rank=0"])
    load_config(sets=["bcd.expand=lora", "train.gpus=2", "train.parallel=auto"])  # auto takes ddp
    assert load_config(sets=["bcd.expand=off"]).bcd.expand == "off"  # YAML reads off as false


def test_adapters_start_at_zero_and_never_enter_the_models_parameters():
    torch.manual_seed(0)
    cfg = get_config("tiny", n_layer=3, d_model=32, n_head=2, vocab_size=64)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    x = torch.randint(64, (2, 8))
    ref = model(x)
    ad = SuffixAdapters(model, range(1, 3), rank=2, seed=0).attach(model)
    assert [n for n, _ in model.named_parameters()] == names  # block files, plans and streaming see nothing new
    assert len(ad.named()) == 2 * 4 * 2  # A and B of 4 linear maps in each of 2 layers
    assert torch.equal(model(x), ref)  # B = 0: the visit starts from the committed model
    again = SuffixAdapters(model, range(1, 3), rank=2, seed=0)  # seeded by the visit, not the global RNG
    assert all(torch.equal(a, b) for a, b in zip(ad.tensors().values(), again.tensors().values()))
    with torch.no_grad():
        for _, p in ad.named():
            p.normal_()
    assert not torch.equal(model(x), ref)
    ad.detach()
    assert torch.equal(model(x), ref)


# -- a problem where the suffix must move ------------------------------------------------------------------------

def teacher_problem(sign_lr: float | None = None, expand: bool = False) -> float:
    """A teacher model (its tied head scaled up: sharp predictions) labels random token sequences with its argmax; the
    student is the teacher with its last two layers' linear maps knocked off by a rank-2 update. Trains the student's
    first layer alone for 300 steps (plain BCD), with rank-4 adapters on the two layers after it (``expand``), or
    with those layers stepped by sign descent at ``sign_lr`` (``bcd.expand=sign``); returns the last 10 steps' mean
    loss."""
    from bcdflow.models.suffix import SignSuffix

    torch.manual_seed(0)
    cfg = get_config("tiny", n_layer=3, d_model=32, n_head=2, vocab_size=64, n_ctx=16)
    teacher = build_model(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(64, (256, 16), generator=g)
    with torch.no_grad():
        teacher.wte.weight.mul_(30)
        y = teacher(x).argmax(-1)  # (N, T) deterministic labels the teacher gets right (loss 0.001)
    student = build_model(cfg)
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        for n, p in student.named_parameters():
            if layer(n) in (1, 2) and p.dim() == 2:
                p += 0.5 * torch.randn(p.shape[0], 2, generator=g) @ torch.randn(2, p.shape[1], generator=g)

    def train() -> float:
        model = build_model(cfg, init=False)
        model.load_state_dict(student.state_dict())
        active = {n for n in dict(model.named_parameters()) if layer(n) == 0}
        for n, p in model.named_parameters():
            p.requires_grad_(n in active)
        params = [p for n, p in model.named_parameters() if n in active]
        spec = OptimSpec("adamw", lr=3e-3)
        opt = make_optimizer(params, spec)
        extra = None
        if expand:
            ad = SuffixAdapters(model, range(1, 3), rank=4, seed=0).attach(model)
            extra = [p for _, p in ad.named()]
            opt.add_param_group({"params": extra, "weight_decay": 0.0})
        if sign_lr:
            SignSuffix(model, [n for n, _ in model.named_parameters() if layer(n) in (1, 2)], lambda: sign_lr,
                       seed=0).attach()
        batches = ((x[i % 8 * 32:(i % 8 + 1) * 32], y[i % 8 * 32:(i % 8 + 1) * 32]) for i in range(10 ** 6))
        res = run_steps(lambda b: visit_loss(model, b[0], b[1], 0, False, hi=1), params, batches, opt, spec,
                        StopRule(max_steps=300), extra=extra)
        return sum(res.losses[-10:]) / 10

    return train()


def test_expansion_reaches_a_loss_plain_bcd_does_not_when_the_suffix_must_move():
    """The teacher problem (:func:`teacher_problem`): training the first layer alone (plain BCD) cannot undo the
    knocked-off suffix in 300 steps (7.6 -> 5.9); the same visit with rank-4 adapters on the two layers after it can
    (-> 0.3)."""
    plain, expanded = teacher_problem(), teacher_problem(expand=True)
    assert plain > 5 and expanded < 0.2 * plain, (plain, expanded)


# -- several processes, kill -9 ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ddp_reduces_the_adapters_gradients(tiny_cfg):
    """Two gloo processes, each on half of every batch: the adapters (a submodule of DDP's step, not of the model)
    get the whole batch's gradient, so the block and the merged suffix equal one process's to float rounding."""
    sgd = ("optim.name=sgd", "optim.lr=0.1")  # gradients enter the weights linearly: rounding stays at rounding
    one = tiny_cfg(*sgd, *LORA)
    ds = new_run(one)
    ctx = RunContext.of(one, "r", ds)
    for s in plan_shards.fn(ctx, 0, 1):
        preinfer_shard.fn(ctx, 0, 1, 0, s)
    ref = train_block.fn(ctx, VisitSpec(0, 1, 0))
    out = train_block.fn(RunContext.of(tiny_cfg(*sgd, *LORA, "train.gpus=2", "train.parallel=ddp"), "r", ds), VisitSpec(0, 1, 0))
    assert out.gpus == 2 and set(out.suffix_files) == set(ref.suffix_files) == {2}
    store = Store(one.store)
    for b, a_entry, b_entry in [(1, ref.block_file, out.block_file), (2, ref.suffix_files[2], out.suffix_files[2])]:
        a = checkpoints.load_from_manifest(store, "r", {"blocks": {str(b): a_entry}}, [b])
        c = checkpoints.load_from_manifest(store, "r", {"blocks": {str(b): b_entry}}, [b])
        assert max((a[k] - c[k]).abs().max().item() for k in a) <= 1e-6, b
    assert out.suffix_norms[2] == pytest.approx(ref.suffix_norms[2], rel=1e-4)


@pytest.mark.slow
def test_an_expanded_visit_killed_mid_visit_resumes_bitwise(prefect_api_url, tmp_path):
    """kill -9 right after the step-4 checkpoint of c0-b0 (which holds the adapters and their AdamW state): the resume
    ends bitwise where an uninterrupted run ends, suffix blocks and records included."""
    from bcdflow.flows.cli import main
    from tests.test_resume import _cli, _sets

    ref = str(tmp_path / "ref")
    assert main(["train", *_sets(*LORA), "--store", ref, "--run-id", "k"]) == 0
    store = str(tmp_path / "store")
    killed = _cli(prefect_api_url, "train", *_sets(*LORA), "--store", store, "--run-id", "k",
                  env={"BCDFLOW_FAILPOINTS": "train-checkpoint:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert runs.read_state(Store(store), "k").visits == []
    done = _cli(prefect_api_url, "resume", "k", "--store", store)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same(finished_weights(Store(store), "k"), finished_weights(Store(ref), "k"))
    got, want = runs.read_state(Store(store), "k").visits, runs.read_state(Store(ref), "k").visits
    assert [v.resumed_at for v in got] == [4, 0, 0]
    assert [v.expanded for v in got] == [v.expanded for v in want] and set(got[0].expanded) == {1, 2}


def test_plan_memory_counts_the_adapters(capsys):
    """``bcdflow plan-memory`` with ``bcd.expand=lora``: Llama-3-8B's shape on a 24 GB card needs one block more
    with fp32 AdamW (9, not 8) once every visit also holds rank-16 adapters and what their backward keeps (the
    recommendation is then the lighter state, which says what fp32 AdamW needs)."""
    from bcdflow.flows.cli import main

    base = ["plan-memory", "--set", "model.from_hf=benchmarks/shapes/llama-3-8b", "--set", "train.batch_size=2",
            "--set", "data.seq_len=1024", "--set", "train.precision=bf16", "--gpu-gb", "24"]
    lines = {}
    for expand in ("off", "lora"):
        assert main([*base, "--set", f"bcd.expand={expand}", "--set", "bcd.expand_rank=16"]) == 0
        rec = capsys.readouterr().out.split("\nrecommended:")[1]  # the recommendation, wrapped to 120 columns
        lines[expand] = [" ".join(rec.split())]
    assert "fp32 AdamW needs bcd.blocks=8" in lines["off"][0] and "fp32 AdamW needs bcd.blocks=9" in lines["lora"][0], \
        lines


def test_a_run_stored_before_lora_was_the_default_continues_without_it(tiny_cfg):
    """A stored config without ``bcd.expand`` was trained with expansion off: its resume and its identity check read
    it so (a mid-visit checkpoint of such a run holds no adapters), while a new run gets the default."""
    from bcdflow.core.config import RunConfig, with_former_defaults
    from bcdflow.tasks.run import _normalized

    assert RunConfig().bcd.expand == "lora" and RunConfig().bcd.expand_rank == 16
    stored = tiny_cfg().model_dump(exclude={"store"})
    del stored["bcd"]["expand"]
    assert _normalized(with_former_defaults(stored))["bcd"]["expand"] == "off"
    assert with_former_defaults({**stored, "bcd": {**stored["bcd"], "expand": "lora"}})["bcd"]["expand"] == "lora"


def test_a_lora_visit_on_an_indexed_device_commits_the_same_files_as_on_the_plain_device(tiny_cfg):
    """The device named as a GPU names it (``cpu:0`` stands for ``cuda:0``), through the engine with expansion on:
    the adapters (``run_steps``' ``extra``) train and merge into the same committed files as on ``cpu``, with the
    suffix recomputed in backward and kept."""
    files = []
    for device, recompute in (("cpu", "off"), ("cpu:0", "off"), ("cpu:0", "on")):
        run = f"lora-{device.replace(':', '')}-{recompute}"
        cfg = tiny_cfg("bcd.expand=lora", "bcd.expand_rank=4", f"train.device={device}", f"bcd.recompute={recompute}")
        ds = new_run(cfg, run)
        out = train_block.fn(RunContext.of(cfg, run, ds), VisitSpec(0, 0, 0))
        assert out.recompute == (recompute == "on")
        files.append((out.block_file, out.suffix_files))
    assert files[0][1] and files[0] == files[1] == files[2]
