"""What deletes proves what it deletes; a damaged record never breaks a command; no partial result passes for a whole
one; the tracking backend as a user meets it; every argument bounded (issue 32).

One test per class, on a tiny real run built once through the plain task functions (version 0 from ``new_run``, three
visits' block files and records committed directly) and copied per test: the exit, the one line naming the file or the
argument, and that nothing was written or removed that should not have been. The store tree before and after is
compared file by file, an ``outside`` folder beside the store included.

Run: python -m pytest -q tests/test_hostile_store.py -m "not slow"
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from bcdflow.core.config import load_config
from bcdflow.flows.cli import main
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.store import Store
from tests.helpers import TINY, fill_disk, new_run, visit_record
from tests.test_bad_input import _one_line

# -- a run to damage --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Run ``r`` at version 3: version 0 of the tiny model, then three visits (blocks 0, 1, 2), each a changed block
    file, its optimizer state (``bcd.moments=keep``) and its record, committed as a visit commits them."""
    root = tmp_path_factory.mktemp("hostile-store") / "store"
    cfg = load_config(sets=TINY + [f"store={root}", "tracking_uri=none", "bcd.moments=keep"])
    new_run(cfg)
    store = Store(cfg.store)
    for v in (1, 2, 3):
        b = v - 1
        tensors = checkpoints.load_blocks(store, "r", v - 1, [b])
        entry = checkpoints.save_block(store, "r", {k: t + 0.01 * v for k, t in tensors.items()})
        checkpoints.commit_version(store, "r", v - 1, v, {b: entry})
        moments = checkpoints.save_block(store, "r", {f"exp_avg/{k}": torch.full((4,), float(v)) for k in tensors})
        runs.append_visit(store, "r", visit_record(cfg.spend, 0, b, version=v, step_end=10 * v, train=1.0,
                                                   val=5.0 - 0.1 * v, moments=moments))
    return root


@pytest.fixture
def store(made, tmp_path):
    """A copy of the run's store under tmp_path, with an ``outside`` folder beside it that nothing may touch."""
    shutil.copytree(made, tmp_path / "store", symlinks=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("not bcdflow's")
    return tmp_path / "store"


def _tree(root) -> dict[str, str]:
    """Every file below ``root`` (links as links) with a hash of its bytes."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = "link" if os.path.islink(p) else hashlib.md5(open(p, "rb").read()).hexdigest()
    return out


def _edit(path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _refused(capsys, args: list[str], words: str, code: int) -> str:
    assert main(args) == code, capsys.readouterr()
    line = _one_line(capsys)
    assert line.startswith("bcdflow: error: ") and words in line, line
    return line


# -- 1. deletion is proven, confined and minimal ---------------------------------------------------------------

DISAGREE = {
    "a version past the manifests": (lambda s: _edit(s / "runs/r/state.json", lambda d: {**d, "version": 999}),
                                     "state.json is damaged (the run is at version 999, but its visits made 3)"),
    "a version below zero": (lambda s: _edit(s / "runs/r/state.json", lambda d: {**d, "version": -1}),
                             "state.json is damaged (version: Input should be greater than or equal to 0)"),
    "the state's manifest gone": (lambda s: (s / "runs/r/versions/3.json").unlink(),
                                  "its state says version 3, but runs/r/versions/3.json does not exist"),
    "a kept version's file gone": (lambda s: (s / "runs/r" / json.loads(
        (s / "runs/r/versions/3.json").read_text())["blocks"]["2"]["file"]).unlink(),
        "(block 2 of kept version 3) is missing: a prune keeps only whole versions; nothing pruned"),
    "a kept manifest without a block": (lambda s: _edit(s / "runs/r/versions/3.json", lambda d: {
        **d, "blocks": {k: e for k, e in d["blocks"].items() if k != "1"}}), "it has blocks [0, 2], the run's plan"),
}


@pytest.mark.parametrize("damage,words", DISAGREE.values(), ids=DISAGREE.keys())
def test_prune_decides_from_the_manifests_and_a_state_that_disagrees_deletes_nothing(store, capsys, damage, words):
    """A state naming a version that is not one of the run's manifests made prune keep nothing and delete every block
    file (valid JSON, a number out of range). Now it is damage: one line naming the file, exit 1, nothing written,
    the dry run too (its lease included)."""
    damage(store)
    before = _tree(store.parent)
    for extra in (["--dry-run"], []):
        _refused(capsys, ["prune", "r", "--keep", "1", *extra, "--store", str(store)], words, code=1)
        assert _tree(store.parent) == before


def test_prune_and_rm_delete_nothing_through_a_link_nor_what_bcdflow_did_not_write(made, store, capsys):
    """``blocks/`` a link to a folder outside the store: prune followed it and deleted every file there no kept
    manifest named. Now nothing is deleted through a link (exit 1, naming it), only the names the layout makes are
    candidates, and rm removes the run's own objects and leaves the link, the outside folder and a user's files."""
    outside = store.parent / "outside"
    blocks = store / "runs/r/blocks"
    shutil.move(blocks, outside / "blocks")
    (outside / "blocks" / "mine.safetensors").write_text("a user's file")
    blocks.symlink_to(outside / "blocks")
    before = _tree(store.parent)
    _refused(capsys, ["prune", "r", "--keep", "1", "--store", str(store)],
             "runs/r/blocks is a symbolic link (to ", code=1)
    assert _tree(store.parent) == before
    blocks.unlink()
    shutil.move(outside / "blocks", blocks)
    (store / "runs/r/notes.txt").write_text("mine")  # a user's file in the run's folder, and in blocks/
    (blocks / "README").write_text("mine")
    assert main(["prune", "r", "--keep", "1", "--store", str(store)]) == 0
    assert (blocks / "mine.safetensors").exists() and (blocks / "README").exists()
    capsys.readouterr()
    (store / "runs/r/visits").mkdir(exist_ok=True)
    (store / "runs/r/visits/link").symlink_to(outside)
    assert main(["rm", "r", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "left in runs/r/ what bcdflow did not write: blocks/README, blocks/mine.safetensors, notes.txt, " \
           "visits/link" in out
    assert set(_tree(store / "runs/r")) == {"notes.txt", "blocks/README", "blocks/mine.safetensors", "visits/link"}
    assert (outside / "keep.txt").read_text() == "not bcdflow's" and not runs.run_exists(Store(str(store)), "r")
    # a run whose folder is itself a link out of the store: rm removes nothing through it
    shutil.rmtree(store / "runs/r")
    shutil.copytree(made / "runs/r", outside / "r")
    (store / "runs/r").symlink_to(outside / "r")
    before = _tree(store.parent)
    _refused(capsys, ["rm", "r", "--store", str(store)], "runs/r is a symbolic link (to ", code=1)
    assert _tree(store.parent) == before


def test_a_lease_folder_that_is_a_link_is_never_written_through(store, capsys):
    """``lease/`` a link to a folder outside the store: prune wrote its lease object there (and exited 0), rm wrote it
    there before refusing. Now both refuse before taking the lease: one line naming the link, exit 1, nothing written
    inside or outside the store."""
    outside = store.parent / "outside"
    (outside / "lease").mkdir()
    if (store / "runs/r/lease").exists():
        shutil.rmtree(store / "runs/r/lease")
    (store / "runs/r/lease").symlink_to(outside / "lease")
    before = _tree(store.parent)
    for args in (["prune", "r", "--keep", "1"], ["rm", "r"]):
        _refused(capsys, [*args, "--store", str(store)], "runs/r/lease is a symbolic link (to ", code=1)
        assert _tree(store.parent) == before, args
    assert os.listdir(outside / "lease") == []


def test_dry_run_lists_exactly_what_prune_removes(store, capsys):
    """One function makes the list: the keys ``--dry-run`` prints are the files the prune then removes, no more."""
    (store / "runs/r/blocks" / f".tmp-{'ab' * 16}.safetensors").write_bytes(b"a dead writer's half file")
    assert main(["prune", "r", "--keep", "1", "--dry-run", "--store", str(store)]) == 0
    listed = {ln.split("would remove ", 1)[1].split()[0] for ln in capsys.readouterr().out.splitlines()  # key (what)
              if ln.startswith("  would remove ")}
    before = _tree(store)
    assert main(["prune", "r", "--keep", "1", "--store", str(store)]) == 0
    after = _tree(store)
    removed = set(before) - set(after)
    assert listed and removed == listed, (sorted(listed), sorted(removed))
    assert {k for k in after if k not in before or after[k] != before[k]} <= {
        "runs/r/retention.json", "runs/r/lease/000000000000.json"}  # the record and the lease only
    assert len([k for k in listed if k.startswith("runs/r/versions/")]) == 3  # versions 0, 1, 2


def test_prune_and_rm_free_space_on_a_full_disk(store, capsys, monkeypatch):
    """No write succeeds (the disk is full): the commands that free space still free it, without first writing their
    lease or the prune's record."""
    import bcdflow.storage.store as store_module

    fill_disk(monkeypatch, store_module)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store / "runs/r/blocks") for f in fs)
    assert main(["prune", "r", "--keep", "1", "--store", str(store)]) == 0
    captured = capsys.readouterr()
    assert "the store is full" in captured.err and "freed" in captured.out
    left = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store / "runs/r/blocks") for f in fs)
    assert left < size and sorted(os.listdir(store / "runs/r/versions")) == ["3.json"]
    assert checkpoints.load_blocks(Store(str(store)), "r", 3)  # the kept version loads, checksums checked
    assert main(["rm", "r", "--store", str(store)]) == 0
    assert not (store / "runs/r").exists()


# -- 2. a damaged record is one line, never a traceback, and never hides the rest --------------------------------

def _lease(store, **over):
    p = store / "runs/r/lease/000000000000.json"
    body = {"epoch": 0, "token": "t", "ttl": 60.0, "expires": 0.0, "owner": {"host": "h", "pid": 1, "started": 1.0}}
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps({**body, **over}) if not isinstance(over.get("raw"), str) else over["raw"])


RECORDS = {  # damage, the line's words, the commands that read the record
    "a non-finite loss": (lambda s: (s / "runs/r/state.json").write_text(
        (s / "runs/r/state.json").read_text().replace('"val_loss": 4.9', '"val_loss": NaN', 1)),
        "state.json is damaged (visits.0.val_loss: Input should be a finite number)",
        ["status", "compare", "export", "generate", "prune"]),
    "steps below one": (lambda s: _edit(s / "runs/r/state.json", lambda d: {
        **d, "visits": [{**d["visits"][0], "steps": 0}, *d["visits"][1:]]}),
        "state.json is damaged (visits.0.steps: Input should be greater than or equal to 1)",
        ["status", "compare", "export", "generate", "prune"]),
    "a config section of the wrong type": (lambda s: _edit(s / "runs/r/config.json", lambda d: {**d, "plan": "x"}),
                                           "config.json is damaged (plan: Input should be a valid dictionary",
                                           ["status", "compare", "export", "generate", "prune"]),
    "a lease time that is no number": (lambda s: _edit(s / "runs/r/config.json", lambda d: {
        **d, "fleet": {**d["fleet"], "lease_seconds": "abc"}}), "config.json is damaged (fleet.lease_seconds: Input "
        "should be a valid number", ["status", "prune"]),
    "a setting this version refuses": (lambda s: _edit(s / "runs/r/config.json", lambda d: {  # read through RunConfig
        **d, "optim": {**d["optim"], "name": "nope"}}), "config.json is damaged (optim.name: unknown optim 'nope'",
        ["status", "compare", "prune"]),
    "a lease that is not an object": (lambda s: _lease(s, raw="[1, 2]"), "lease/000000000000.json is damaged "
                                      "(Input should be a valid dictionary", ["status", "prune"]),
    "a lease whose expiry is no time": (lambda s: _lease(s, expires=1e300), "lease/000000000000.json is damaged "
                                        "(expires: Input should be less than or equal to", ["status", "prune"]),
    "a retention record that is a list": (lambda s: (s / "runs/r/retention.json").write_text("[0]"),
                                          "retention.json is damaged (Input should be an object)",
                                          ["export", "generate", "prune"]),
    "a manifest that names another version": (lambda s: _edit(s / "runs/r/versions/3.json",
                                                              lambda d: {**d, "version": 7}),
                                              "versions/3.json is damaged", ["export", "generate", "prune"]),
}
COMMANDS = {"status": ["status", "r"], "compare": ["compare", "r", "r"], "prune": ["prune", "r", "--keep", "1"],
            "generate": ["generate", "r", "The", "--max-new-tokens", "2"], "export": ["export", "r", "OUT"]}


@pytest.mark.parametrize("damage,words,commands", RECORDS.values(), ids=RECORDS.keys())
def test_a_damaged_record_is_one_line_naming_it_and_nothing_is_written(store, capsys, damage, words, commands):
    """Every record read from a store is checked for type and range where it is read: each command that reads it names
    the file and what is wrong, exit 1, and writes nothing (no traceback, no lease, no export)."""
    damage(store)
    before = _tree(store.parent)
    for cmd in commands:
        args = [a.replace("OUT", str(store.parent / "out")) for a in COMMANDS[cmd]]
        _refused(capsys, [*args, "--store", str(store)], words, code=1)
        assert _tree(store.parent) == before, cmd


def test_runs_lists_good_runs_beside_a_damaged_one_and_rm_removes_it(store, capsys):
    shutil.copytree(store / "runs/r", store / "runs/d")
    _edit(store / "runs/d/state.json", lambda d: {**d, "run_id": "d", "version": 999})
    _edit(store / "runs/d/config.json", lambda d: {**d, "fleet": {"lease_seconds": "abc"}})
    (store / "runs/d/lease").mkdir(exist_ok=True)
    (store / "runs/d/lease/000000000000.json").write_text("[]")
    assert main(["runs", "--store", str(store)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("r ") and "interrupted" in ln and " 3/3 " in ln for ln in out), out  # the good run
    assert any(ln.startswith("d ") and "damaged" in ln for ln in out)
    assert any(ln.startswith("d: damaged: run config") and "config.json is damaged" in ln for ln in out), out
    assert main(["runs", "--json", "--store", str(store)]) == 0
    rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["r"]["damage"] is None and rows["r"]["version"] == 3 and rows["d"]["status"] == "damaged"
    assert main(["rm", "d", "--store", str(store)]) == 0  # a damaged run (config, state, lease) is removed all the same
    assert not (store / "runs/d").exists() and (store / "runs/r/state.json").exists()


# -- 3. no command reports success over a partial result ---------------------------------------------------------

def test_export_and_generate_of_a_version_missing_a_block_write_nothing(store, capsys):
    """A manifest without one of the plan's blocks: export wrote a model with a block missing and said it exported
    it; generate died with a traceback. Both check the manifest against the run's plan first."""
    _edit(store / "runs/r/versions/3.json", lambda d: {**d, "blocks": {k: e for k, e in d["blocks"].items()
                                                                        if k != "2"}})
    before = _tree(store.parent)
    for args in (["export", "r", str(store.parent / "m")], ["generate", "r", "The"]):
        _refused(capsys, [*args, "--store", str(store)], "it has blocks [0, 1], the run's plan [0, 1, 2]", code=1)
    assert _tree(store.parent) == before
    # a block file that reads but holds other tensors: refused before the export is written
    entry = json.loads((store / "runs/r/versions/2.json").read_text())["blocks"]["1"]
    data = checkpoints.save_block(Store(str(store)), "r", {"not.a.parameter": torch.zeros(2)})
    _edit(store / "runs/r/versions/2.json", lambda d: {**d, "blocks": {**d["blocks"], "1": data}})
    _refused(capsys, ["export", "r", str(store.parent / "m"), "--version", "2", "--store", str(store)],
             "(block 1 of version 2) does not hold the block's tensors", code=1)
    assert not (store.parent / "m").exists() and entry


def test_compare_prices_no_crossing_it_calls_too_imprecise_and_its_json_is_strict(tmp_path, capsys):
    """A crossing whose bracket is too wide for a B-F gives no cost to L* and no saving either; ``--json`` is strict
    JSON (a B-F range open at the top was written as Infinity)."""
    from bcdflow.flows.compare import compare
    from tests.test_compare import _curve_run

    st = Store(str(tmp_path / "store"))
    _curve_run(st, "full", "full", [(200, 3.0, [(20, 6.0), (100, 4.0), (140, 3.5), (160, 3.3), (180, 3.1)])])
    _curve_run(st, "coarse", "bcd", [(100, 4.5, []), (140, 3.5, []), (160, 3.1, []), (180, 2.9, [])])
    res = compare(st, ["full", "coarse"], tol=0.05)
    coarse = res["runs"][1]
    assert coarse["bf_multiplier"] is None and coarse["reached"] and coarse["steps_to_target"]
    assert coarse["spend_to_target_usd"] is None and coarse["what_if_usd"] is None and coarse["cost_withheld"]
    assert all(rows[1]["reduction"] is None for rows in res["cost_reduction"].values())
    # the baseline crossing in its first bracket (from step 0): the B-F range has no top, and no Infinity is written
    _curve_run(st, "early", "full", [(10, 2.0, []), (200, 1.9, [])])
    _curve_run(st, "late", "bcd", [(100, 2.6, []), (120, 2.4, [])])
    assert main(["compare", "early", "late", "--target", "2.5", "--bracket-tol", "2", "--json",
                 "--store", st.url]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert out["runs"][1]["bf_range"][1] is None and out["runs"][1]["bf_multiplier"] == 11.0


def test_an_exported_checkpoint_config_states_what_a_null_was_read_as(tmp_path):
    """A fine-tuned checkpoint's config.json held ``tie_word_embeddings: null`` and ``layer_norm_epsilon: null``; the
    run trained them as their defaults (tied, 1e-5) and the export copied the nulls, which transformers reads as
    something else (untied: the head it loads is not the one trained)."""
    from transformers import AutoConfig

    from bcdflow.core.export import export_hf
    from tests.hf_checkpoints import TEXT, make_checkpoint, make_tokenizer

    ck, _ = make_checkpoint(tmp_path / "ck", "gpt2", make_tokenizer(tmp_path / "tok"))
    conf = json.loads((tmp_path / "ck/config.json").read_text())
    (tmp_path / "ck/config.json").write_text(json.dumps({**conf, "tie_word_embeddings": None,
                                                          "layer_norm_epsilon": None}))
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = load_config(sets=[f"model.from_hf={ck}", f"data.files={tmp_path / 'corpus.txt'}", "data.seq_len=16",
                            "bcd.blocks=2", "train.batch_size=4", "tracking_uri=none", f"store={tmp_path / 'store'}"])
    new_run(cfg)
    export_hf(Store(cfg.store), "r", 0, str(tmp_path / "out"))
    out = json.loads((tmp_path / "out/config.json").read_text())
    assert out["tie_word_embeddings"] is True and out["layer_norm_epsilon"] == 1e-5
    loaded = AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert loaded.tie_word_embeddings is True and loaded.layer_norm_epsilon == 1e-5
    assert {k: v for k, v in out.items() if k not in ("tie_word_embeddings", "layer_norm_epsilon", "dtype",
                                                      "torch_dtype")} == \
        {k: v for k, v in conf.items() if k not in ("tie_word_embeddings", "layer_norm_epsilon", "dtype",
                                                    "torch_dtype")}


# -- 4. the tracking backend as users meet it --------------------------------------------------------------------

def test_a_run_the_tracking_backend_lacks_is_continued_by_a_new_one_that_says_so(tmp_path, caplog):
    """A run resumed on another machine or from another directory: its MLflow run id is not in this backend. A new
    run continues it, tagged with the id it continues, and one warning line says so (it failed with MLflow's error)."""
    from mlflow.tracking import MlflowClient

    from bcdflow.tracking.tracker import Tracker

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    tracker = Tracker(uri, "bcdflow")
    with caplog.at_level(logging.WARNING, logger="bcdflow.tracking.tracker"):
        new = tracker.start("r", params={"a": 1}, tags={"bcdflow.run_id": "r"}, resume_id="0" * 32)
    assert new and new != "0" * 32
    (record,) = [r for r in caplog.records if r.name == "bcdflow.tracking.tracker"]
    assert f"MLflow run {'0' * 32} is not in the tracking backend" in record.getMessage()
    run = MlflowClient(uri).get_run(new)
    assert run.data.tags["bcdflow.continues"] == "0" * 32 and run.data.params == {"a": "1"}
    assert tracker.start("r", resume_id=new) == new  # a run it holds is continued as before
    tracker.end(new)


@pytest.mark.slow
def test_a_run_continued_where_its_mlflow_run_is_unknown_records_the_new_one(store, capsys, prefect_server):
    """The run continues (here: it ends, all its visits done) against a tracking backend that never saw its MLflow run
    (`mlflow_run_id` from another machine): a new MLflow run continues it and the run's state names the new one."""
    from mlflow.tracking import MlflowClient

    _edit(store / "runs/r/state.json", lambda d: {**d, "mlflow_run_id": "f" * 32})
    uri = f"sqlite:///{store.parent / 'here.db'}"
    sets = [a for s in [*TINY, "bcd.moments=keep", f"tracking_uri={uri}", "log_model=false"] for a in ("--set", s)]
    assert main(["train", *sets, "--run-id", "r", "--store", str(store)]) == 0
    state = runs.read_state(Store(str(store)), "r")
    assert state.status == "done" and state.mlflow_run_id not in (None, "f" * 32)
    assert MlflowClient(uri).get_run(state.mlflow_run_id).data.tags["bcdflow.continues"] == "f" * 32


def test_the_tracking_uri_environment_and_an_unreachable_server(tmp_path, capsys, monkeypatch):
    """``MLFLOW_TRACKING_URI`` is honoured below an explicit ``tracking_uri``; a server that does not answer is
    refused before anything is written (exit 2, naming where the address came from)."""
    import socket

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////somewhere/mlflow.db")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # on a version that tried, fail at once
    assert load_config(sets=["store=/tmp/x"]).resolved_tracking_uri() == "sqlite:////somewhere/mlflow.db"
    assert load_config(sets=["store=/tmp/x", "tracking_uri=none"]).resolved_tracking_uri() == "none"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = [a for s in [*TINY, f"tracking_uri=http://127.0.0.1:{port}"] for a in ("--set", s)]
    _refused(capsys, ["train", *sets, "--store", str(tmp_path / "store")],
             f"tracking_uri: the MLflow tracking server http://127.0.0.1:{port} does not answer", code=2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    sets = [a for s in TINY for a in ("--set", s)]
    _refused(capsys, ["train", *sets, "--store", str(tmp_path / "store")],
             "MLFLOW_TRACKING_URI (in the environment): the MLflow tracking server", code=2)
    assert not (tmp_path / "store").exists()


def test_a_tracking_uri_that_cannot_work_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """An unknown scheme, a folder (MLflow 3's refused file store), a SQLite path that is a folder, below a file, not a
    database or not writable, and an HTTP server that answers but is not MLflow: each was found after the run was
    created (or after minutes of MLflow's retries). Now each is one line naming ``tracking_uri``, exit 2, no store."""
    import functools
    import http.server
    import threading

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "text.db").write_text("not a database, only text")
    class Quiet(http.server.SimpleHTTPRequestHandler):  # a plain web server: files, and 404 for the rest
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path /
                                                                                                          "folder")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cases = {"foo://x": "'foo://x' has a scheme MLflow does not track to ('foo'",
             str(tmp_path / "folder"): "is a folder (MLflow's file store",
             f"file://{tmp_path / 'folder'}": "is a folder (MLflow's file store",
             f"sqlite:///{tmp_path / 'folder'}": "is a folder, not a SQLite file",
             f"sqlite:///{tmp_path / 'afile' / 'mlflow.db'}": f"is below {tmp_path / 'afile'}, a file",
             f"sqlite:///{tmp_path / 'text.db'}": "is not a SQLite database",
             f"http://127.0.0.1:{server.server_address[1]}": "answers, but not as an MLflow tracking server (its REST "
                                                             "API answered HTTP 404"}
    if os.geteuid() != 0:  # root writes any file whatever its mode
        (tmp_path / "ro.db").write_bytes(b"")
        (tmp_path / "ro.db").chmod(0o444)
        cases[f"sqlite:///{tmp_path / 'ro.db'}"] = "cannot be written"
    try:
        for uri, words in cases.items():
            sets = [a for s in [*TINY, f"tracking_uri={uri}"] for a in ("--set", s)]
            line = _refused(capsys, ["train", *sets, "--store", str(tmp_path / "store")], words, code=2)
            assert line.startswith("bcdflow: error: tracking_uri: "), line
            assert not (tmp_path / "store").exists(), uri
    finally:
        server.shutdown()
    assert (tmp_path / "text.db").read_text() == "not a database, only text"


def test_a_prefect_home_that_cannot_be_written_is_one_line_naming_the_variable(tmp_path):
    """Prefect's temporary server retried for minutes when its home could not be created."""
    (tmp_path / "afile").write_text("x")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "afile" / "prefect")}
    env.pop("PREFECT_API_URL", None)
    sets = [a for s in [*TINY, "tracking_uri=none"] for a in ("--set", s)]
    try:
        p = subprocess.run([sys.executable, "-m", "bcdflow.flows.cli", "train", *sets, "--store",
                            str(tmp_path / "store")], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a Prefect home that cannot be written: no answer within 120 s")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"bcdflow: error: PREFECT_HOME: {tmp_path / 'afile' / 'prefect'} cannot be created ({tmp_path / 'afile'} "
        "is not a writable directory): set PREFECT_HOME to a writable directory (e.g. export "
        "PREFECT_HOME=$PWD/.prefect)"], p.stderr
    assert not (tmp_path / "store").exists()


# -- 5. every argument bounded ------------------------------------------------------------------------------------

BOUNDS = {
    "a temperature below any that samples": (["generate", "r", "x", "--temperature", "1e-300"], "--temperature: 0 "
                                             "(greedy) or between 0.01 and 100"),
    "a temperature that is not a number": (["generate", "r", "x", "--temperature", "nan"], "--temperature"),
    "more new tokens than the model's context": (["generate", "r", "x", "--max-new-tokens", "100000"],
                                                 "--max-new-tokens: at most the model's context, 256 tokens"),
    "a seed past the generator's": (["generate", "r", "x", "--seed", str(2 ** 64)], "--seed: a number from 0"),
    "a tolerance that is not finite": (["compare", "r", "r", "--tol", "inf"], "--tol: a finite loss >= 0"),
    "a bracket tolerance that is nan": (["compare", "r", "r", "--bracket-tol", "nan"], "--bracket-tol: a finite"),
    "a run id of a megabyte": (["status", "r" * 1_000_000], "is not a valid run id"),
}


@pytest.mark.parametrize("args,words", BOUNDS.values(), ids=BOUNDS.keys())
def test_every_argument_is_bounded(store, capsys, args, words):
    before = _tree(store.parent)
    line = _refused(capsys, [*args, "--store", str(store)], words, code=2)
    assert len(line) < 1200 and _tree(store.parent) == before  # a value it echoes is cut


def test_generate_prints_text_as_it_comes(store):
    from bcdflow.flows.generate import generate

    pieces: list[str] = []
    out = generate(Store(str(store)), "r", "The", max_new_tokens=12, temperature=1.0, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == out["text"]


def test_a_config_file_is_refused_by_its_size_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "run.yaml"
    big.write_text("# a comment\n" * 200_000 + "seed: -1\n")  # 2.4 MB; read whole it would fail on seed
    _refused(capsys, ["train", "-c", str(big), "--store", str(tmp_path / "store")],
             f"config file '{big}' is 2400009 bytes: a run config is at most 1048576 bytes", code=2)
    assert not (tmp_path / "store").exists()


def test_export_into_the_store_or_onto_a_link_is_refused_before_writing(store, capsys, monkeypatch):
    before = _tree(store.parent)
    _refused(capsys, ["export", "r", str(store / "runs/r/exported"), "--store", str(store)],
             "is inside store", code=2)
    (store.parent / "empty").mkdir()
    (store.parent / "link").symlink_to(store.parent / "empty")
    _refused(capsys, ["export", "r", str(store.parent / "link"), "--store", str(store)],
             "is a symbolic link (to ", code=2)
    assert _tree(store.parent) == {**before, "link": "link"}
    import shutil as sh

    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    _refused(capsys, ["export", "r", str(store.parent / "m"), "--store", str(store)], "has 0.0 MB free", code=2)
    assert not (store.parent / "m").exists()


def test_rm_from_inside_the_folder_it_removes(store, capsys, monkeypatch):
    monkeypatch.chdir(store / "runs/r")
    assert main(["rm", "r", "--store", str(store)]) == 0
    assert not (store / "runs/r").exists() and "removed run r" in capsys.readouterr().out


def test_a_closed_output_pipe_is_quiet(store):
    """``bcdflow runs | head -0``: the reader is gone before bcdflow writes; no message, no traceback, exit 141."""
    p = subprocess.Popen([sys.executable, "-m", "bcdflow.flows.cli", "runs", "--store", str(store)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader goes away at once
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_a_lease_duration_is_trusted_only_up_to_its_bound(store):
    from bcdflow.constants import MAX_LEASE_SECONDS
    from bcdflow.storage.lease import read_lease

    _lease(store, ttl=1e300, expires=1.0)
    assert read_lease(Store(str(store)), "runs/r", "000000000000.json")["ttl"] == MAX_LEASE_SECONDS


# -- 6. the planner's inputs: bounded, answered at once, never a traceback -----------------------------------------

PLANNER = {
    "a card of 1e300 GB (plan-memory)": (["plan-memory", "--gpu-gb", "1e300"], "--gpu-gb: must be a positive number "
                                         "of GB up to 1e+06"),
    "a card of 1e300 GB (plan)": (["plan", "--gpu-gb", "1e300", "--tokens", "1e5"], "--gpu-gb: must be a positive "
                                  "number of GB up to 1e+06"),
    "train.memory_gb=1e300 (plan-memory)": (["plan-memory", "--set", "train.memory_gb=1e300"],
                                            "train.memory_gb: Input should be less than or equal to 1000000"),
}


@pytest.mark.parametrize("args,words", PLANNER.values(), ids=PLANNER.keys())
def test_the_planners_sizes_are_bounded(tmp_path, capsys, args, words):
    """Finite but huge sizes overflowed the planner's byte counts (``int(inf)``) to a traceback."""
    sets = [a for s in [*TINY, f"store={tmp_path / 's'}"] for a in ("--set", s)]
    _refused(capsys, [args[0], *sets, *args[1:]], words, code=2)
    assert not (tmp_path / "s").exists()


def _probe_cfg(store: str, *sets):
    return load_config(sets=[*TINY, f"store={store}", "tracking_uri=none", *sets])


def test_the_stores_probe_holds_a_bounded_shard_in_memory(tmp_path, monkeypatch):
    """``bcdflow plan --probe`` allocated one whole shard of the run's rows at once (``bcd.shard_rows`` x seq_len x
    d_model, tens of GB for a large model: a traceback past memory). It holds at most ``PROBE_SHARD_BYTES``, writing the
    run's chunk objects, and measures a rate."""
    from bcdflow.flows import plan
    from bcdflow.storage import probe

    bound = 1 << 18
    monkeypatch.setattr(probe, "PROBE_SHARD_BYTES", bound)
    real = torch.randn

    def randn(shape, **kw):
        assert math.prod(shape) * 4 <= bound, f"the probe allocates {math.prod(shape) * 4 / 1e9:.1f} GB at once"
        return real(shape, **kw)

    monkeypatch.setattr(torch, "randn", randn)
    cfg = _probe_cfg(str(tmp_path / "s"), "bcd.shard_rows=1000003")  # prime: the run's chunk is one row
    out = plan.probe_store(cfg, 64)
    assert out["write_gbs"] > 0 and out["read_gbs"] > 0 and out["bytes"] <= 2 * 4 * bound  # hidden states and targets
    assert os.listdir(tmp_path / "s" / "probes") == []  # the probe's objects removed


def test_a_store_that_goes_away_mid_probe_is_one_line_naming_it(s3_proxy, s3_bucket, capsys, monkeypatch):
    """The S3 store stopped answering between the probe's shards: a traceback (and another from the cleanup). Now one
    line naming the store and what is left, exit 1."""
    from bcdflow.storage import activations

    real, calls = activations.write_shard, []

    def write_shard(*a, **kw):
        if calls:
            s3_proxy.stop()  # the store goes away after the first shard
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(activations, "write_shard", write_shard)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    sets = [a for s in [*TINY, f"store={s3_bucket}/st", f"s3.endpoint_url={s3_proxy.endpoint}"] for a in ("--set", s)]
    line = _refused(capsys, ["plan", *sets, "--tokens", "1e5", "--probe"],
                    "the store stopped answering during bcdflow plan --probe", code=1)
    assert line.startswith(f"bcdflow: error: {s3_bucket}/st: ") and "probes/throughput-" in line, line


def test_plan_memory_recommends_only_what_the_config_accepts(capsys):
    """Llama-3-8B's shape on an 8 GB card fits only with row blocks; ``bcd.order=greedy`` refuses them, and
    ``plan-memory`` recommended them all the same (the config then refused ``bcd.vocab_blocks=2``). Now it says they
    would fit but not with this config, and why; whatever it recommends, the config takes."""
    from bcdflow.core.config import load_config

    sets = ["model.from_hf=benchmarks/shapes/llama-3-8b", "train.batch_size=2", "data.seq_len=1024",
            "train.precision=bf16", "bcd.order=greedy"]
    assert main(["plan-memory", *[a for s in sets for a in ("--set", s)], "--gpu-gb", "8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert "bcd.vocab_blocks" not in (rec.get("settings") or {}), rec
    assert "row blocks (bcd.vocab_blocks=2) would fit, but not with this config (bcd.vocab_blocks: row blocks are " \
           "not for bcd.order=greedy" in rec["line"], rec["line"]
    load_config(sets=[*sets, *(f"{k}={v}" for k, v in (rec.get("settings") or {}).items())])  # accepted
