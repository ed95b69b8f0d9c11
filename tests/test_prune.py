"""A store that does not only grow (issue 28): ``bcdflow prune`` keeps the last N versions and the pinned ones bitwise
loadable and removes the rest (manifests, block files no kept version names, optimizer states of earlier visits),
``bcdflow rm`` removes a run, both refuse a live run and say what they free; ``bcdflow generate`` samples from a
stored version with the run's tokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from bcdflow.flows.cli import main
from bcdflow.storage import checkpoints, layout, runs
from bcdflow.storage.lease import Lease
from bcdflow.storage.prune import apply_prune, plan_prune, retention, size_of
from bcdflow.storage.runs import RunState, VisitRecord
from bcdflow.storage.store import Store
from tests.helpers import TINY


def _rec(block: int, version: int, moments: dict | None = None) -> VisitRecord:
    return VisitRecord(cycle=0, block=block, version=version, steps=1, step_end=version, stopped_by="max_steps",
                       rows=1, tokens=1, first_loss=1.0, train_loss=1.0, val_loss=1.0, val_ppl=1.0, tokens_per_s=1.0,
                       seconds=1.0, moments=moments)


def _toy_run(store: Store) -> dict:
    """Two blocks, six versions: each visit rewrites one block and (bcd.moments=keep) leaves its optimizer state."""
    files = {b: checkpoints.save_block(store, "r", {f"b{b}": torch.full((64,), -1.0)}) for b in (0, 1)}
    checkpoints.write_manifest(store, "r", 0, files)
    recs = []
    for v in range(1, 7):
        b = (v - 1) % 2
        files = {**files, b: checkpoints.save_block(store, "r", {f"b{b}": torch.full((64,), float(v))})}
        checkpoints.write_manifest(store, "r", v, files)
        moments = checkpoints.save_block(store, "r", {f"exp_avg/b{b}": torch.full((64,), v + 0.5)})
        recs.append(_rec(b, v, moments))
    runs.write_config(store, "r", {"mode": "bcd", "dataset": "d1", "plan": {"blocks": [{}, {}]}})
    runs.write_state(store, RunState(run_id="r", version=6, status="done", visits=recs))
    return {v: checkpoints.load_blocks(store, "r", v) for v in range(7)}


def test_prune_keeps_the_last_versions_and_the_pinned_ones_and_removes_the_rest(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    before = _toy_run(store)
    state = runs.read_state(store, "r")
    last_moments = {r.block: r.moments["file"] for r in state.visits}  # what each block's next visit starts from
    size0 = size_of(store, "runs/r/blocks") + size_of(store, "runs/r/versions")
    plan = plan_prune(store, "r", keep=2, pins=[0])
    assert (plan.kept, plan.versions) == ([0, 5, 6], [1, 2, 3, 4])
    # block files: b0 of v1 and v3, b1 of v2 go; v4's b1 stays (version 5 shares it: copy-on-write)
    assert len(plan.blocks) == 3 and len(plan.moments) == 4  # moments of visits 1..4 (5 and 6 are each block's last)
    assert main(["prune", "r", "--keep", "2", "--pin", "0", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert "kept versions 0, 5, 6 (pinned: 0); removed versions 1, 2, 3, 4" in out and "freed" in out
    assert size0 - size_of(store, "runs/r/blocks") - size_of(store, "runs/r/versions") == plan.freed
    for v in (0, 5, 6):  # bitwise loadable, checksums checked on load
        after = checkpoints.load_blocks(store, "r", v)
        assert all(torch.equal(after[k], before[v][k]) for k in before[v])
    assert sorted(store.listdir("runs/r/versions")) == ["0.json", "5.json", "6.json"]
    left = set(store.listdir("runs/r/blocks"))
    named = {e["file"].removeprefix("blocks/") for v in (0, 5, 6)
             for e in checkpoints.read_manifest(store, "r", v)["blocks"].values()}
    assert left == named | {f.removeprefix("blocks/") for f in last_moments.values()}
    assert retention(store, "r") == {"pinned": [0], "pruned": [1, 2, 3, 4]}
    # a later prune keeps the pin; export of a pruned version says so
    assert plan_prune(store, "r", keep=1).kept == [0, 6]
    assert main(["export", "r", str(tmp_path / "out"), "--version", "3", "--store", store.url]) == 2
    assert "version 3 of run 'r' was removed by bcdflow prune (kept: 0, 5, 6)" in capsys.readouterr().err
    # bad input: nothing removed
    for args, words in ((["--keep", "0"], "--keep"), (["--pin", "3"], "no version 3")):
        assert main(["prune", "r", *args, "--store", store.url]) == 2
        assert words in capsys.readouterr().err
    assert sorted(store.listdir("runs/r/versions")) == ["0.json", "5.json", "6.json"]


def test_prune_dry_run_removes_nothing(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    _toy_run(store)
    size0 = size_of(store, "runs/r")
    assert main(["prune", "r", "--keep", "1", "--dry-run", "--store", store.url]) == 0
    assert "would remove versions 0, 1, 2, 3, 4, 5" in capsys.readouterr().out
    assert size_of(store, "runs/r") == size0 and len(store.listdir("runs/r/versions")) == 7


def test_prune_dry_run_says_which_files_are_optimizer_states_and_what_mlflow_keeps(tmp_path, capsys):
    """Issue 45: the dry run listed every key alike, and said nothing of MLflow. Now each optimizer state
    (bcd.moments=keep) is marked as one, and for a tracked run one line says that MLflow's logged models of the
    pruned versions will point at removed files; an untracked run gets no such line."""
    store = Store(str(tmp_path / "store"))
    _toy_run(store)
    args = ["prune", "r", "--keep", "2", "--pin", "0", "--dry-run", "--store", store.url]
    plan = plan_prune(store, "r", keep=2, pins=[0])
    assert main(args) == 0
    out = capsys.readouterr().out
    listed = [ln for ln in out.splitlines() if ln.startswith("  would remove ")]
    marked = [ln for ln in listed if ln.endswith("(optimizer state of an earlier visit, bcd.moments=keep)")]
    assert len(listed) == len(plan.deletions) and len(marked) == len(plan.moments) == 4, out
    assert sum(ln.endswith("(weights no kept version uses)") for ln in listed) == len(plan.blocks) == 3, out
    assert {ln.split()[2].rsplit("/", 1)[-1] for ln in marked} == {n for n, _ in plan.moments}
    assert "MLflow" not in out  # an untracked run logged no models
    state = runs.read_state(store, "r")
    runs.write_state(store, state.model_copy(update={"mlflow_run_id": "abc123"}))
    assert main(args) == 0
    (note,) = [ln for ln in capsys.readouterr().out.splitlines() if "MLflow" in ln]
    assert note.startswith("note: MLflow logged a model of versions 1, 2, 3, 4 (MLflow run abc123") and \
        "would point at removed files" in note, note


def test_prune_and_rm_refuse_a_live_run(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    _toy_run(store)
    live = Lease(store, layout.run_key("r"), "run 'r'", ttl=3.0)  # renewed every second by its own thread
    with live.held():
        for cmd in ("prune", "rm"):
            assert main([cmd, "r", "--store", store.url]) == 2
            assert "run 'r' is in use by" in capsys.readouterr().err
    assert len(store.listdir("runs/r/versions")) == 7
    # a visit trained by a live process elsewhere (a fleet worker) while nobody holds the run
    visit = Lease(store, layout.visit_key("r", 1, 0), "visit c1-b0", ttl=3.0)
    with visit.held():
        assert main(["prune", "r", "--store", store.url]) == 2
        assert "visit c1-b0 is being trained by" in capsys.readouterr().err


def test_rm_removes_the_run_and_keeps_its_dataset(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    _toy_run(store)
    store.write_json({"n": 1}, "datasets/d1/meta.json")
    size = size_of(store, "runs/r")
    assert main(["rm", "r", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert f"removed run r from {store.url}: freed" in out and "datasets/d1 stays (no other run uses it now)" in out
    assert not store.exists("runs/r") and store.exists("datasets/d1/meta.json") and size > 0
    assert main(["rm", "r", "--store", store.url]) == 2 and "not found" in capsys.readouterr().err


# -- on a real tiny run -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(prefect_server, tmp_path_factory):
    """A finished tiny BCD run: 2 cycles of 3 blocks, kept AdamW moments (6 versions, 6 optimizer states)."""
    root = tmp_path_factory.mktemp("prune") / "store"
    sets = []
    for s in TINY + ["bcd.cycles=2", "bcd.moments=keep", "tracking_uri=none"]:
        sets += ["--set", s]
    assert main(["train", *sets, "--store", str(root), "--run-id", "t"]) == 0
    return root, sets


@pytest.mark.slow
def test_a_pruned_run_exports_its_kept_versions_bitwise_and_trains_on(tiny_run, tmp_path, capsys):
    root, sets = tiny_run
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    store = Store(str(copy))
    before = {v: checkpoints.load_blocks(store, "t", v) for v in (0, 5, 6)}
    assert main(["prune", "t", "--keep", "2", "--pin", "0", "--store", str(copy)]) == 0
    capsys.readouterr()
    for v in (0, 5, 6):
        assert main(["export", "t", str(tmp_path / f"v{v}"), "--version", str(v), "--store", str(copy)]) == 0
        from safetensors.torch import load_file

        exported = load_file(tmp_path / f"v{v}" / "model.safetensors")
        assert exported.keys() == before[v].keys() and all(torch.equal(exported[k], before[v][k]) for k in exported)
    # the run continues (a third cycle): each block's next visit starts from the optimizer state prune kept
    assert main(["train", *sets[:-2], "--set", "bcd.cycles=3", "--set", "tracking_uri=none", "--store", str(copy),
                 "--run-id", "t"]) == 0
    state = runs.read_state(store, "t")
    assert state.version == 9 and state.status == "done"


@pytest.mark.slow
def test_generate_samples_from_the_stored_model_with_the_runs_tokenizer(tiny_run, tmp_path, capsys):
    from tokenizers import Tokenizer

    from bcdflow.flows.generate import generate
    from bcdflow.models import build_model
    from bcdflow.models.model_config import ModelConfig

    root, _ = tiny_run
    store = Store(str(root))
    out = generate(store, "t", "def main(", max_new_tokens=12, temperature=0)
    # greedy, written out independently: the exported model, its tokenizer, argmax one token at a time
    assert main(["export", "t", str(tmp_path / "m"), "--store", str(root)]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    model = build_model(ModelConfig.from_dict(cfg["model"]), init=False)
    from safetensors.torch import load_file

    model.load_state_dict(load_file(tmp_path / "m" / "model.safetensors"))
    model.eval()
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    ids = tok.encode("def main(").ids
    want = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(torch.tensor([ids + want]))[0, -1].argmax())
            want.append(nxt)
            if nxt == store.read_json(f"datasets/{cfg['dataset']}/meta.json")["eos_id"]:
                break
    assert out["ids"] == want and out["prompt_ids"] == ids and out["version"] == 6
    # sampled: the seed decides, the text is the ids decoded; an earlier version samples differently
    a = generate(store, "t", "def main(", max_new_tokens=20, temperature=1.0, seed=3)
    assert a == generate(store, "t", "def main(", max_new_tokens=20, temperature=1.0, seed=3)
    assert a["text"] == tok.decode([i for i in a["ids"]])
    assert generate(store, "t", "def main(", max_new_tokens=20, version=0, temperature=0)["ids"] != \
        generate(store, "t", "def main(", max_new_tokens=20, version=6, temperature=0)["ids"]
    capsys.readouterr()
    assert main(["generate", "t", "def main(", "--max-new-tokens", "5", "--store", str(root)]) == 0
    assert capsys.readouterr().out.startswith("def main(")
    for args, words in ((["--temperature", "-1"], "--temperature"), (["--version", "9"], "--version"),
                        (["--max-new-tokens", "0"], "--max-new-tokens")):
        assert main(["generate", "t", "x", *args, "--store", str(root)]) == 2
        assert words in capsys.readouterr().err


def test_a_record_whose_kept_moments_name_no_block_file_prunes_nothing(tmp_path):
    store = Store(str(tmp_path / "store"))
    _toy_run(store)
    state = runs.read_state(store, "r")
    state.visits[2].moments = {"file": "../elsewhere.safetensors"}
    runs.write_state(store, state)
    before = sorted(store.listdir("runs/r/blocks"))
    with pytest.raises(runs.RunStateError, match=r"state.json is damaged \(visits.2.moments: names no block file for the visit.s kept moments"):
        plan_prune(store, "r", keep=1, pins=[])
    assert sorted(store.listdir("runs/r/blocks")) == before
