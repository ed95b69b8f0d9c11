"""A stored run's settings as an input (issue 45): ``bcdflow config show --run RUN`` shows them, ``--like RUN`` starts
``train``, ``baseline`` and ``plan`` from them (flows/like.py); a run that is missing, damaged or from a newer bcdflow
is one line naming it, exit 2, nothing written. And a run's identity on resume: continuing a peer baseline with
another peer setting (``optim.lisa_layers``, ``optim.rank``) is refused naming the key, before anything is written
(tasks/run.IDENTITY). The runs are made at version 0 through the plain task functions (no flow), so every refusal
here takes a second; the demo's path to ``compare`` is one slow test.

Run: python -m pytest -q tests/test_like.py -m "not slow"
"""
from __future__ import annotations

import json
import shlex
import shutil

import pytest

from bcdflow.core.config import load_config
from bcdflow.flows.cli import main
from bcdflow.storage.store import Store
from tests.helpers import TINY
from tests.test_bad_input import _one_line
from tests.test_hostile_store import _edit, _tree

PEERS = {"lisa": ["optim.name=lisa", "optim.lisa_layers=1", "optim.switch_every=3"],
         "lora": ["optim.name=lora", "optim.rank=4"]}


def _cfg(root, *sets: str):
    return load_config(sets=[*TINY, f"store={root}", "tracking_uri=none", *sets])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A store with a BCD run ``r`` (optim.lr 0.002, seed 3), an AdamW baseline ``full`` and the baselines ``lisa``
    and ``lora``, each at version 0 (as a run killed in its first visit is)."""
    from bcdflow.flows.bcd import full_config
    from bcdflow.tasks.data import prepare_data
    from bcdflow.tasks.run import init_run

    root = tmp_path_factory.mktemp("like") / "store"
    cfg = _cfg(root, "optim.lr=0.002", "seed=3")
    ds = prepare_data.fn(cfg, Store(cfg.store))
    init_run.fn(cfg, "r", ds)
    init_run.fn(full_config(_cfg(root, "train.steps=8", "optim.lr=0.002")), "full", ds, "full")
    for name, sets in PEERS.items():
        init_run.fn(full_config(_cfg(root, "train.steps=8", *sets)), name, ds, "full")
    return root


@pytest.fixture
def store(made, tmp_path):
    shutil.copytree(made, tmp_path / "store", symlinks=True)
    return tmp_path / "store"


def _sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, "tracking_uri=none", *extra] for a in ("--set", s)]


# -- show and reuse ---------------------------------------------------------------------------------------------------

def test_config_show_run_prints_the_stored_settings_and_what_set_adds(made, capsys):
    assert main(["config", "show", "--run", "r", "--store", str(made), "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)
    assert (keys["optim.lr"]["value"], keys["seed"]["value"], keys["model.d_model"]["value"]) == (0.002, 3, 64)
    assert main(["config", "show", "--run", "r", "--store", str(made), "--set", "seed=5"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# run r's settings") and "seed: 5" in text
    assert [ln for ln in text.splitlines() if ln.strip().startswith("lr: 0.002")][0].split("#")[1].startswith(" (set)")


def test_like_starts_from_the_stored_settings_and_takes_set_on_top(made):
    from bcdflow.flows.like import like_config

    at = [f"store={made}"]
    cfg = like_config(None, [*at, "bcd.blocks=2"], "r", "full")
    assert (cfg.optim.lr, cfg.seed, cfg.model.d_model, cfg.bcd.blocks, cfg.bcd.window) == (0.002, 3, 64, 2, 3)
    assert cfg.store == str(made) and cfg.tracking_uri == "none"
    # a baseline's stored bcd keys are the ones it set itself: a BCD command like it gets their defaults
    assert like_config(None, at, "full", None).bcd.blocks == 1  # config show: as stored
    bcd = like_config(None, at, "full", "bcd")
    assert (bcd.bcd.blocks, bcd.bcd.cycles, bcd.bcd.max_steps, bcd.optim.lr) == (3, 2, 200, 0.002)


def test_plan_like_plans_the_stored_run(made, capsys):
    assert main(["plan", "--like", "r", "--set", f"store={made}", "--set", "bcd.blocks=2", "--tokens", "1e5",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["blocks"] == 2 and res["config"]["seq_len"] == 32 and res["config"]["batch_size"] == 8


# -- a run that cannot be reused ---------------------------------------------------------------------------------------

UNUSABLE = {
    "no such run": ("nope", lambda s: None, "run 'nope' not found in store"),
    "an invalid id": ("../r", lambda s: None, "--like: '../r' is not a valid run id"),
    "its state damaged": ("r", lambda s: (s / "runs/r/state.json").write_text("{"), "run 'r': its settings cannot be "
                                                                                    "read: "),
    "its config not JSON": ("r", lambda s: (s / "runs/r/config.json").write_text("{"), "config.json is damaged"),
    "its config gone": ("r", lambda s: (s / "runs/r/config.json").unlink(), "config.json is missing"),
    "a setting out of range": ("r", lambda s: _edit(s / "runs/r/config.json", lambda d: {
        **d, "optim": {**d["optim"], "lr": -1}}), "optim.lr"),
    "a newer bcdflow's": ("r", lambda s: _edit(s / "runs/r/config.json", lambda d: {**d, "format": 99}),
                          "run 'r' was made by a newer bcdflow (run format 99"),
}
COMMANDS = {
    "config show": lambda run, s: ["config", "show", "--run", run, "--store", str(s)],
    "plan": lambda run, s: ["plan", "--like", run, "--set", f"store={s}", "--tokens", "1e5"],
    "baseline": lambda run, s: ["baseline", "--like", run, "--store", str(s), "--run-id", "new"],
    "train": lambda run, s: ["train", "--like", run, "--store", str(s), "--run-id", "new"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("run,damage,words", UNUSABLE.values(), ids=UNUSABLE.keys())
def test_like_a_run_that_cannot_be_read_is_one_line_naming_it_exit_2_nothing_written(store, capsys, command, run,
                                                                                       damage, words):
    damage(store)
    before = _tree(store)
    assert main(COMMANDS[command](run, store)) == 2
    line = _one_line(capsys)
    assert words in line and repr(run) in line, line
    assert _tree(store) == before


# -- identity on resume ------------------------------------------------------------------------------------------------

CHANGED = {"lisa": ("optim.lisa_layers=2", "optim.lisa_layers"), "lora": ("optim.rank=8", "optim.rank")}


@pytest.mark.parametrize("peer", CHANGED)
def test_continuing_a_peer_baseline_with_another_peer_setting_is_refused_naming_the_key(prefect_server, store, capsys,
                                                                                        peer):
    """It was accepted (issue 45): config.json kept the old value, and a LoRA baseline killed mid-visit died on the
    checkpoint's shapes. Refused now before the run's lease or anything else is written; --like the run too."""
    change, key = CHANGED[peer]
    before = _tree(store)
    for args in (_sets("train.steps=8", *PEERS[peer], change), ["--like", peer, "--set", change]):
        assert main(["baseline", *args, "--store", str(store), "--run-id", peer]) == 2
        line = _one_line(capsys)
        assert f"run {peer!r} exists with a different config: {key} differ" in line, line
        assert _tree(store) == before


@pytest.mark.parametrize("change", ["optim.lisa_layers=2", "optim.switch_every=5", "optim.schedule=cosine",
                                    "optim.min_lr_ratio=0.5", "optim.decay_steps=9"])
def test_a_deployments_run_is_refused_too(made, change):
    """``init_run`` (a deployment's run has no command line to check first) refuses the same keys."""
    from bcdflow.flows.bcd import full_config
    from bcdflow.models.errors import ConfigError
    from bcdflow.storage import runs
    from bcdflow.tasks.run import init_run

    ds = runs.read_config(Store(str(made)), "lisa")["dataset"]
    with pytest.raises(ConfigError, match=f"{change.split('=')[0]} differ"):
        init_run.fn(full_config(_cfg(made, "train.steps=8", *PEERS["lisa"], change)), "lisa", ds, "full")


@pytest.mark.parametrize("change", ["bcd.budget=fixed", "bcd.moments=reset"])
def test_a_bcd_run_keeps_its_budget_and_moments(made, change):
    from bcdflow.models.errors import ConfigError
    from bcdflow.storage import runs
    from bcdflow.tasks.run import init_run

    ds = runs.read_config(Store(str(made)), "r")["dataset"]
    with pytest.raises(ConfigError, match=f"{change.split('=')[0]} differ"):
        init_run.fn(_cfg(made, "optim.lr=0.002", "seed=3", change), "r", ds)


# -- from the demo to compare ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_demo_prints_the_commands_from_it_to_compare(prefect_server, tmp_path, capsys):
    """`bcdflow demo` (shortened), then the baseline and compare commands its closing lines print, as printed."""
    short = ["model.d_model=64", "model.n_head=4", "data.seq_len=32", "data.vocab_size=512",
             "data.builtin_bytes=200000", "bcd.cycles=1", "bcd.max_steps=4", "bcd.window=2",
             "train.batch_size=8", "train.eval_rows=32", "train.steps=12", "tracking_uri=none"]
    assert main(["demo", *[a for s in short for a in ("--set", s)], "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    cmds = [shlex.split(ln.split("   #")[0]) for ln in out.split("\nnext:")[1].splitlines()
            if ln.strip().startswith(("bcdflow baseline", "bcdflow compare"))]
    assert [c[1] for c in cmds] == ["baseline", "compare"] and "--like" in cmds[0], out
    assert main(cmds[0][1:]) == 0
    capsys.readouterr()
    assert main(cmds[1][1:]) == 0
    table = capsys.readouterr().out
    full, demo = cmds[1][2:4]
    assert full in table and demo in table, table
    stored = json.loads((tmp_path / "s" / "runs" / full / "config.json").read_text())
    assert (stored["mode"], stored["train"]["steps"], stored["optim"]["lr"], stored["bcd"]["max_steps"]) == \
        ("full", 12, 0.003, 12)  # the demo's settings, trained as a baseline


def test_config_show_run_imports_neither_torch_nor_prefect(made):
    from tests.test_cli_quick import HEAVY, _imports

    proc, mods, _ = _imports("config", "show", "--run", "r", "--store", str(made))
    assert proc.returncode == 0 and "lr: 0.002" in proc.stdout, proc.stderr[-2000:]
    assert not set(HEAVY) & mods, sorted(set(HEAVY) & mods)
