"""The CLI answers at once and says what to do (issue 28): the read-only commands import neither Prefect nor torch,
``resume`` of a finished run says so, ``config show`` prints every key with its meaning (and the guide's tables list
every key), a mistyped key gets the nearest one, a Prefect API that is set but down is refused before a run exists,
and the demo's last lines name the next commands."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from bcdflow.flows.cli import main
from bcdflow.storage import runs
from bcdflow.storage.store import Store
from tests.test_runs import _run

BCDFLOW = os.path.join(os.path.dirname(sys.executable), "bcdflow")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "prefect", "mlflow", "matplotlib")


def _imports(*args: str) -> tuple[subprocess.CompletedProcess, set[str], float]:
    """Run ``bcdflow ARGS`` under ``python -X importtime``: the process, the top-level packages it imported, and
    its wall seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", BCDFLOW, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    mods = {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s+(\S+)$", proc.stderr, re.M)}
    return proc, mods, wall


def test_help_imports_neither_torch_nor_prefect_and_answers_at_once():
    """It took 5.8 s: the CLI imported torch and Prefect for everything. The bound is generous (a loaded CI box);
    the import list is the real check."""
    proc, mods, wall = _imports("--help")
    assert proc.returncode == 0 and "generate" in proc.stdout and "prune" in proc.stdout
    assert not set(HEAVY) & mods, sorted(set(HEAVY) & mods)
    assert wall < 10.0
    for sub in ("compare", "plan-memory", "generate", "config"):  # each subcommand's own help too
        proc, mods, _ = _imports(sub, "--help")
        assert proc.returncode == 0 and not set(HEAVY) & mods, (sub, sorted(set(HEAVY) & mods))


def test_runs_status_and_compare_read_the_store_without_torch_or_prefect(tmp_path):
    store = Store(str(tmp_path / "store"))
    _run(store, "base", 6, status="done", mode="full")
    _run(store, "bcd", 4)
    for args in (["runs"], ["status", "bcd"], ["compare", "base", "bcd"], ["compare", "base", "bcd", "--json"]):
        proc, mods, _ = _imports(*args, "--store", store.url)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not set(HEAVY) & mods, (args, sorted(set(HEAVY) & mods))


def test_resume_of_a_finished_run_says_so_at_once(tmp_path, capsys):
    """It reran the run's report for half a minute and moved the run to the top of ``runs``."""
    store = Store(str(tmp_path / "store"))
    _run(store, "fin", 6, status="done")
    runs.write_config(store, "fin", {**runs.read_config(store, "fin"), "spend": {"budget_usd": 0.05}})
    before = runs.read_state(store, "fin")
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:  # nothing may start a flow
        mp.setattr("bcdflow.flows.cli._call", lambda *a, **k: pytest.fail("resume of a finished run ran a flow"))
        mp.setattr("bcdflow.flows.cli._continuable", lambda *a: {})  # the fake run has no block files
        assert main(["resume", "fin", "--store", store.url]) == 0
    assert time.perf_counter() - t0 < 5
    out = capsys.readouterr().out
    assert "run fin is done (cycles" in out and "nothing to resume" in out
    assert "bcdflow train --run-id fin" in out and "bcd.cycles=" in out
    assert runs.read_state(store, "fin") == before  # nothing rewritten


def test_config_show_prints_every_key_with_its_meaning_as_a_valid_config_file(tmp_path, capsys):
    from bcdflow.core.config import config_keys, load_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text("bcd:\n  blocks: 4\ntrain:\n  eval_every: 10\n")
    assert main(["config", "show", "-c", str(cfg), "--set", "optim.grad_clip=0.5"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "shown.yaml").write_text(text)
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(str(cfg), ["optim.grad_clip=0.5"])  # a -c file
    lines = [ln for ln in text.splitlines() if "  # " in ln]
    assert len(lines) == len(config_keys())
    assert all(ln.split("  # ", 1)[1].strip() for ln in lines)  # every key has a meaning

    def line(key):
        return next(ln for ln in lines if ln.startswith(f"  {key}"))
    assert "(set)" in line("grad_clip:") and "(set)" in line("eval_every: 10") and "(set)" not in line("window:")
    assert main(["config", "show", "--json"]) == 0
    import json

    keys = json.loads(capsys.readouterr().out)
    assert keys["train.eval_every"]["value"] is None and "compare" in keys["train.eval_every"]["meaning"]


def test_the_guide_tables_list_every_config_key():
    """train.eval_every, bcd.eval_every, optim.grad_clip, ... were undocumented. A row's first cell names its keys:
    ``section.key``, or a bare ``key`` after one of its section in the same cell."""
    from bcdflow.core.config import config_keys

    listed = set()
    pages = sorted(glob.glob(os.path.join(REPO, "docs", "guide", "*.md")))  # config.md, fleet.md, ...
    for line in (line for page in pages for line in open(page, encoding="utf-8")):
        if not line.startswith("| `"):
            continue
        section = None
        for tok in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            sec, dot, name = tok.partition(".")
            if dot:
                section = sec
                listed.add(tok)
            elif section:
                listed.add(f"{section}.{tok}")
            else:
                listed.add(tok)
    missing = [k for k in config_keys() if k not in listed]
    assert not missing, f"the key tables of docs/guide/*.md lack {missing}"


@pytest.mark.parametrize("typo,near", [("train.eval_evry", "train.eval_every"), ("optim.gradclip", "optim.grad_clip"),
                                       ("bcd.batch_size", "train.batch_size"), ("trian.steps", "train")])
def test_an_unknown_key_suggests_the_nearest(tmp_path, capsys, typo, near):
    assert main(["train", "--set", f"{typo}=1", "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"unknown config key (did you mean {near}?)") and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "s")


def test_a_prefect_api_that_does_not_answer_is_refused_before_a_run_exists(tmp_path):
    """A UI session's ``prefect config set PREFECT_API_URL`` outlived its server: train started a run, failed with
    "Failed to reach API", and the resume it suggested said the run did not exist."""
    home = tmp_path / "prefect"
    dead = "http://127.0.0.1:9/api"  # the discard port: nothing listens
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    sets = ["--set", "model.name=tiny", "--store", str(tmp_path / "store"), "--run-id", "r"]
    proc = subprocess.run([BCDFLOW, "train", *sets], capture_output=True, text=True, timeout=120,
                          env={**base, "PREFECT_HOME": str(home), "PREFECT_API_URL": dead})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"PREFECT_API_URL={dead} (set in the environment) does not answer" in line
    assert "unset PREFECT_API_URL" in line
    assert not os.path.exists(tmp_path / "store" / "runs")
    # the same setting left in a profile by `prefect config set`
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    env = {**base, "PREFECT_HOME": str(home)}
    subprocess.run([prefect, "config", "set", f"PREFECT_API_URL={dead}"], env=env, check=True, capture_output=True,
                   timeout=120)
    proc = subprocess.run([BCDFLOW, "train", *sets], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "in Prefect profile" in proc.stderr, proc.stderr
    assert "prefect config unset PREFECT_API_URL" in proc.stderr
    assert not os.path.exists(tmp_path / "store" / "runs")


def test_the_demo_ends_with_the_next_commands(monkeypatch):
    from bcdflow.flows.cli import next_steps

    monkeypatch.delenv("VIRTUAL_ENV", raising=False)  # `make demo` runs .venv/bin/bcdflow without activating it
    text = next_steps("bcd-1", "./bcdflow-store")
    assert "activate" in text, text
    for cmd in ("bcdflow train --set data.files=", "bcdflow compare", "bcdflow export bcd-1", "bcdflow generate bcd-1"):
        assert cmd in text, text


def test_prefect_yaml_deploys_without_prompts():
    """`prefect deploy --all` asked twice about schedules (a deployment without a schedules key) and a script hung."""
    from prefect.cli.deploy._schedules import _construct_schedules

    with open(os.path.join(REPO, "prefect.yaml")) as f:
        spec = yaml.safe_load(f)
    for dep in spec["deployments"]:
        assert "schedules" in dep, dep["name"]
        _construct_schedules(dep, {}, console=None, is_interactive=lambda: pytest.fail(f"{dep['name']} prompts"))


@pytest.mark.slow
def test_a_run_leaves_nothing_in_the_temporary_folder(prefect_api_url, tmp_path):
    """Test runs and the Hugging Face reader left folders in /tmp (bcdflow-hf-cache: the Arrow conversion of the
    corpus, kept for ever)."""
    from tests.helpers import TINY

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "BCDFLOW_HF_CACHE"}, "TMPDIR": str(tmp),
           "PREFECT_API_URL": prefect_api_url}
    sets = [a for s in TINY + ["tracking_uri=none", "bcd.cycles=1"] for a in ("--set", s)]
    proc = subprocess.run([BCDFLOW, "train", *sets, "--store", str(tmp_path / "store"), "--run-id", "t"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(tmp) == []


def test_the_flow_run_url_tag_is_a_url_or_absent(monkeypatch):
    """Every CLI run tagged MLflow with prefect.flow_run_url = "None/flow-runs/flow-run/<id>": the CLI's temporary
    server has no UI address."""
    from prefect.runtime import flow_run

    from bcdflow.flows.visit import prefect_tags

    monkeypatch.setattr(flow_run, "get_id", lambda: "abc")
    monkeypatch.setattr(flow_run, "get_name", lambda: "c0-b0")
    monkeypatch.setattr(flow_run, "get_flow_run_ui_url", lambda: "None/flow-runs/flow-run/abc")
    assert prefect_tags() == {"prefect.flow_run_id": "abc", "prefect.flow_run_name": "c0-b0"}
    monkeypatch.setattr(flow_run, "get_flow_run_ui_url", lambda: "http://127.0.0.1:4200/flow-runs/flow-run/abc")
    assert prefect_tags()["prefect.flow_run_url"] == "http://127.0.0.1:4200/flow-runs/flow-run/abc"


def test_a_run_without_a_prefect_address_says_so_in_its_description(monkeypatch):
    """Issue 37: a run on Prefect's temporary server had no way back from MLflow to its flow runs: where the UI's
    address is unknown its description says how to find the flow run; where it is known the tag links it."""
    from prefect.runtime import flow_run

    from bcdflow.flows.visit import prefect_note

    monkeypatch.setattr(flow_run, "get_id", lambda: "abc")
    monkeypatch.setattr(flow_run, "get_name", lambda: "r/c0-b0")
    monkeypatch.setattr(flow_run, "get_flow_run_ui_url", lambda: "None/flow-runs/flow-run/abc")
    note = prefect_note()
    assert "flow run `r/c0-b0` (abc) ran on Prefect's temporary server" in note
    assert "no `prefect.flow_run_url` tag" in note and "http://127.0.0.1:4200/runs/flow-run/abc" in note
    monkeypatch.setattr(flow_run, "get_flow_run_ui_url", lambda: "http://127.0.0.1:4200/flow-runs/flow-run/abc")
    assert prefect_note() == ""


def test_visit_flow_runs_are_named_by_their_run():
    """Issue 37: every run had its own "c0-b0"; a list of several runs' visits now reads."""
    from bcdflow.flows.visit import short_run_id, visit_run_name

    assert visit_run_name("bcd-20250101-120000-1a2b", 1, 2) == "bcd-20250101-120000-1a2b/c1-b2"
    assert visit_run_name("t", 0, 0) == "t/c0-b0"
    long = "an-experiment-with-a-very-long-name-7"
    assert short_run_id(long) == "an-experiment-w…g-name-7" and len(short_run_id(long)) == 24


def test_a_command_opens_its_store_once_and_reads_each_record_once(tiny_cfg, monkeypatch, capsys):
    """``train --run-id`` of an existing run and ``resume`` open the store once, probe it once and read the run's
    state and config once before the flow starts (they opened it three and two times, probed it twice and read
    state.json and config.json two and three times). The flow is left out: what is counted is the command's own."""
    from bcdflow.flows import cli
    from bcdflow.storage import store as store_mod
    from tests.helpers import TINY, new_run

    cfg = tiny_cfg()
    new_run(cfg)
    counts = {"open": 0, "probe": 0, "state": 0, "config": 0}

    def counted(what, fn):
        def wrapper(*a, **kw):
            counts[what] += 1
            return fn(*a, **kw)
        return wrapper

    init, check = Store.__init__, Store._check  # a store made, a store checked (Store.probe's work)
    monkeypatch.setattr(Store, "__init__", lambda self, *a, **kw: (counts.__setitem__("open", counts["open"] + 1),
                                                                   init(self, *a, **kw))[1])
    monkeypatch.setattr(Store, "_check", lambda self, *a, **kw: (counts.__setitem__("probe", counts["probe"] + 1),
                                                                check(self, *a, **kw))[1])
    monkeypatch.setattr(runs, "read_state", counted("state", runs.read_state))
    monkeypatch.setattr(runs, "read_config", counted("config", runs.read_config))
    monkeypatch.setattr(cli, "_call", lambda fn, cfg, run_id, debug=False: {"run_id": run_id})
    assert store_mod.Store is Store
    sets = [a for s in [*TINY, "tracking_uri=none"] for a in ("--set", s)]
    assert main(["train", *sets, "--run-id", "r", "--store", cfg.store]) == 0
    assert counts == {"open": 1, "probe": 1, "state": 1, "config": 1}, counts
    counts.update(dict.fromkeys(counts, 0))
    assert main(["resume", "r", "--store", cfg.store]) == 0
    assert counts == {"open": 1, "probe": 1, "state": 1, "config": 1}, counts
    capsys.readouterr()
