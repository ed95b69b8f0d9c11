"""End-to-end CLI on the tiny config: train, status --json, export, baseline, and every bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from bcdflow.flows.cli import main
from tests.helpers import TINY


def _args(tmp_path, *extra: str) -> list[str]:
    out = []
    for s in TINY + [f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra]:
        out += ["--set", s]
    return out + ["--store", str(tmp_path / "store")]


@pytest.mark.slow
def test_train_status_export(prefect_server, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["train", *_args(tmp_path, "bcd.cycles=2"), "--run-id", "r1"]) == 0
    capsys.readouterr()
    assert main(["status", "r1", "--store", store, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["run_id"] == "r1" and st["version"] == 6
    # blocks balance parameter counts: block 0 carries the embeddings, so it gets fewer layers
    assert [b["layers"] for b in st["blocks"]] == [[0, 1], [1, 4], [4, 6]]
    assert [(v["cycle"], v["block"], v["version"]) for v in st["visits"]] == [
        (0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 4), (1, 1, 5), (1, 2, 6)]
    for v in st["visits"]:
        assert set(v) >= {"cycle", "block", "version", "steps", "train_loss", "val_loss", "seconds"}
        assert v["steps"] == 6
    # validation loss falls across the run
    assert st["visits"][-1]["val_loss"] < st["visits"][0]["val_loss"]

    out = tmp_path / "export"
    assert main(["export", "r1", str(out), "--store", store]) == 0
    tensors = load_file(out / "model.safetensors")
    owned = {p for b in st["blocks"] for p in b["params"]}
    assert set(tensors) == owned
    config = json.loads((out / "config.json").read_text())
    assert config["version"] == 6 and config["model"]["n_layer"] == 6
    assert main(["export", "r1", str(tmp_path / "v0"), "--version", "0", "--store", store]) == 0
    v0 = load_file(tmp_path / "v0" / "model.safetensors")
    # every block was visited (twice): exactly every tensor of the model moved away from version 0
    assert {k for k in tensors if not torch.equal(v0[k], tensors[k])} == owned

    # a second train with the same id resumes: every visit is committed, nothing is redone
    assert main(["train", *_args(tmp_path, "bcd.cycles=2"), "--run-id", "r1"]) == 0
    assert main(["status", "r1", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n}\n", 1)[1])["version"] == 6

    # MLflow: one run per training run, one nested run per visit
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bcdflow")
    all_runs = client.search_runs([exp.experiment_id])
    parent = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in all_runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parent) == 1 and len(children) == 6
    assert parent[0].data.params["bcd.blocks"] == "3"
    hist = client.get_metric_history(parent[0].info.run_id, "train_loss")
    assert len(hist) == 36 and sorted(m.step for m in hist) == list(range(1, 37))
    assert {"val_loss", "val_ppl"} <= set(children[0].data.metrics)
    assert {"bcdflow.tokens_per_s", "bcdflow.seconds"} <= set(children[0].data.tags)  # single values: the summary


@pytest.mark.slow
def test_baseline(prefect_server, tmp_path, capsys, monkeypatch):
    from bcdflow.core import context

    checked, fits = [], context.check_plan_fits
    monkeypatch.setattr(context, "check_plan_fits", lambda cfg: (checked.append(cfg.bcd.blocks), fits(cfg))[1])
    assert main(["baseline", *_args(tmp_path), "--run-id", "full1"]) == 0
    assert checked == [1]  # the preflight checked the one-block config the baseline trains, once (not the flow again)
    capsys.readouterr()
    assert main(["status", "full1", "--store", str(tmp_path / "store"), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["mode"] == "full" and len(st["blocks"]) == 1 and len(st["visits"]) == 1
    assert st["visits"][0]["steps"] == 6


BAD = [
    (["--set", "model.name=gpt5"], "model.name"),
    (["--set", "bcd.order=zigzag"], "bcd.order"),
    (["--set", "bcd.blocks=0"], "bcd.blocks"),
    (["--set", "bcd.blocks=7"], "bcd.blocks"),
    (["--set", "bcd.sample_rate=0"], "bcd.sample_rate"),
    (["--set", "bcd.sample_rate=1.2"], "bcd.sample_rate"),
    (["--set", "data.seq_len=4096"], "data.seq_len"),
    (["--set", "bcd.bogus=1"], "bcd.bogus"),
    (["--set", "data.files=/nonexistent/dir/*.txt"], "data.files"),
    (["--set", "data.files=/nonexistent/file.txt"], "data.files"),
]


@pytest.mark.parametrize("extra,key", BAD, ids=[k for _, k in BAD])
def test_bad_input(tmp_path, capsys, extra, key):
    rc = main(["train", *_args(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and key in err, err
    assert not os.path.exists(tmp_path / "store" / "runs")


def test_empty_corpus(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    rc = main(["train", *_args(tmp_path), "--set", f"data.files={tmp_path / 'empty.txt'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "data.files" in err and "empty" in err
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.slow
def test_empty_corpus_whitespace_inside_flow(prefect_server, tmp_path, capsys):
    # not caught by the byte-size preflight: the data task raises, the CLI still exits 2, no run written
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    rc = main(["train", *_args(tmp_path), "--set", f"data.files={tmp_path / 'blank.txt'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "data.files" in err
    assert not os.path.exists(tmp_path / "store" / "runs")


def test_console_script_bad_input(tmp_path):
    """The installed entry point: one line on stderr, exit 2."""
    exe = os.path.join(os.path.dirname(sys.executable), "bcdflow")
    proc = subprocess.run([exe, "train", "--set", "bcd.order=sideways", "--store", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bcdflow: error: bcd.order: unknown order 'sideways' (choose from cyclic, reverse, random, greedy)"]


def test_status_unknown_run(tmp_path, capsys):
    assert main(["status", "nope", "--store", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err


def test_the_temporary_server_ends_when_the_cli_is_killed(tmp_path):
    """kill -9 of bcdflow left Prefect's temporary server (in its own session) running for ever (issue 17)."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import os, time\n"
              "from bcdflow.flows import cli\n"
              "cli._env_defaults()\n"
              "from bcdflow.flows.prefect_api import detach_temporary_server\n"
              "detach_temporary_server()\n"
              "from prefect.server.api.server import SubprocessASGIServer\n"
              "s = SubprocessASGIServer()\n"
              "s.start()\n"
              "print(s.server_process.pid, flush=True)\n"
              "time.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="600")
    cli = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    server = int(cli.stdout.readline())
    os.kill(server, 0)  # running
    cli.send_signal(signal.SIGKILL)
    cli.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(server, signal.SIGKILL)
    raise AssertionError(f"the temporary server (pid {server}) outlived the CLI")
