"""``bcdflow runs`` and the live part of ``bcdflow status`` (storage/overview.py): a finished run, a running one
(its lease held, a visit mid-way with a checkpoint) and an interrupted one (its process gone), in one store
written the way a run writes it."""
from __future__ import annotations

import json

import torch

from bcdflow.flows.cli import main
from bcdflow.storage import layout, runs, trainckpt
from bcdflow.storage.lease import Lease, this_process
from bcdflow.storage.runs import RunState, VisitRecord
from bcdflow.storage.store import Store


def _visit(cycle: int, block: int, version: int, val: float, usd: float) -> VisitRecord:
    return VisitRecord(cycle=cycle, block=block, version=version, steps=10, step_end=10 * version,
                       stopped_by="max_steps", rows=80, tokens=2560, first_loss=5.0, train_loss=val + 0.1,
                       val_loss=val, val_ppl=2.0, tokens_per_s=1000.0, seconds=3.0, spend_usd=usd, cum_spend_usd=usd * version)


def _run(store: Store, run_id: str, n_visits: int, status: str = "running", mode: str = "bcd") -> None:
    runs.write_config(store, run_id, {"mode": mode, "bcd": {"cycles": 2, "max_steps": 10},
                                      "plan": {"n_layer": 6, "blocks": [{}, {}, {}]}})
    visits = [_visit(v // 3, v % 3, v + 1, 4.0 - v * 0.5, 0.01) for v in range(n_visits)]
    runs.write_state(store, RunState(run_id=run_id, version=n_visits, status=status, mode=mode, visits=visits,
                                     stop_reason="cycles" if status == "done" else None))


def test_runs_lists_a_finished_a_running_and_an_interrupted_run(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    _run(store, "fin", 6, status="done")
    _run(store, "live", 2)
    _run(store, "dead", 4)
    # the live run: its lease held by this process, visit c0-b2 checkpointed at step 4 of 10
    vkey = layout.visit_key("live", 0, 2)
    trainckpt.save(store, vkey, 4, {"w": torch.zeros(2)}, {}, {"loop": {}})
    run_lease = Lease(store, layout.run_key("live"), "run 'live'", owner=this_process("flow-run-1"))
    visit_lease = Lease(store, vkey, "visit", owner=this_process("flow-run-2"))
    # the interrupted run: a lease whose process is gone (released), and a checkpoint of its visit c1-b1
    dead = Lease(store, layout.run_key("dead"), "run 'dead'").acquire()
    dead.release()
    trainckpt.save(store, layout.visit_key("dead", 1, 1), 7, {"w": torch.zeros(2)}, {}, {"loop": {}})
    with run_lease.held(), visit_lease.held():
        assert main(["runs", "--store", str(tmp_path / "store"), "--json"]) == 0
        rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
        assert main(["runs", "--store", str(tmp_path / "store")]) == 0
        table = capsys.readouterr().out
        assert main(["status", "live", "--store", str(tmp_path / "store")]) == 0
        status = capsys.readouterr().out
        assert main(["status", "live", "--store", str(tmp_path / "store"), "--json"]) == 0
        live_json = json.loads(capsys.readouterr().out)["live"]
    assert set(rows) == {"fin", "live", "dead"}
    fin, live, dead_ = rows["fin"], rows["live"], rows["dead"]
    assert (fin["status"], fin["visits_done"], fin["visits_planned"], fin["version"]) == ("done", 6, 6, 6)
    assert fin["val_loss"] == 1.5 and abs(fin["spend_usd"] - 0.06) < 1e-9 and fin["training"] is None
    assert (live["status"], live["visits_done"], live["visits_planned"]) == ("running", 2, 6)
    assert live["lease_owner"]["flow_run_id"] == "flow-run-1"
    assert live["training"]["visit"] == "c0-b2" and live["training"]["step"] == 4
    assert live["training"]["lease_owner"]["flow_run_id"] == "flow-run-2"
    assert (dead_["status"], dead_["visits_done"], dead_["lease_owner"]) == ("interrupted", 4, None)
    assert dead_["training"]["visit"] == "c1-b1" and dead_["training"]["step"] == 7
    assert all(r["changed"] for r in rows.values())
    lines = {ln.split()[0]: ln for ln in table.splitlines()[1:]}
    assert "done" in lines["fin"] and "6/6" in lines["fin"] and "1.5000" in lines["fin"]
    assert "running (c0-b2)" in lines["live"] and "2/6" in lines["live"]
    assert "interrupted" in lines["dead"] and "4/6" in lines["dead"]
    assert "training visit c0-b2: step 4/10 at its last checkpoint" in status and "flow run flow-run-1" in status
    assert live_json["status"] == "running" and live_json["training"]["step"] == 4
    # once the lease is released the same run reads as interrupted
    assert main(["status", "live", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "interrupted" in out and "bcdflow resume live" in out


def test_runs_of_a_store_that_does_not_exist_or_is_empty(tmp_path, capsys):
    assert main(["runs", "--store", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "nowhere" in err[0]
    (tmp_path / "empty").mkdir()
    assert main(["runs", "--store", str(tmp_path / "empty")]) == 0
    assert "no runs in store" in capsys.readouterr().out


def test_status_says_why_each_visit_stopped_and_both_commands_give_the_mlflow_link(tmp_path, capsys, monkeypatch):
    """Issue 45: ``bcdflow status`` had no "stopped by" column (60/30/30 steps looked arbitrary), and neither command
    said where the run is in MLflow, whose first screen is its GenAI view: each run with an MLflow run now gets its
    page in the model-training view (the experiment read from a SQLite backend's file, read-only)."""
    import sqlite3

    store_dir = tmp_path / "store"
    store = Store(str(store_dir))
    _run(store, "fin", 3, status="done")
    state = runs.read_state(store, "fin")
    visits = [v.model_copy(update={"stopped_by": why}) for v, why in zip(state.visits, ("max_steps", "budget",
                                                                                        "plateau"))]
    runs.write_state(store, state.model_copy(update={"visits": visits, "mlflow_run_id": "abc123", "seq": 1}))
    _run(store, "nomlflow", 1)
    with sqlite3.connect(store_dir / "mlflow.db") as db:  # the table and columns MLflow's SQLite schema has
        db.execute("CREATE TABLE runs (run_uuid TEXT, experiment_id INTEGER)")
        db.execute("INSERT INTO runs VALUES ('abc123', 7)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("BCDFLOW_MLFLOW_UI", "http://ui:5000")
    link = "http://ui:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"
    assert main(["status", "fin", "--store", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert f"  MLflow: {link} (served by mlflow ui --backend-store-uri sqlite:///{store_dir}/mlflow.db)" in out
    head, *rows = [ln for ln in out.splitlines() if ln.lstrip().startswith(("cycle", "0 "))]
    assert "stopped by" in head and [r.split()[4] for r in rows] == ["max_steps", "budget", "plateau"]
    assert main(["status", "fin", "--store", str(store_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mlflow_url"] == link
    assert main(["runs", "--store", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert f"  fin                      {link}" in out and "nomlflow " not in out.split("in MLflow")[1]
    assert main(["status", "nomlflow", "--store", str(store_dir)]) == 0
    assert "MLflow:" not in capsys.readouterr().out  # no MLflow run: no link
    # a tracking server: its own address, MLflow's direct route to the run (no request made to find its experiment)
    from bcdflow.flows.status import mlflow_url
    from bcdflow.core.config import load_config

    assert mlflow_url(load_config(sets=["tracking_uri=http://mlflow.lan:5000/"]), "abc123") == \
        "http://mlflow.lan:5000/#/runs/abc123?workflowType=machine_learning"
    assert mlflow_url(load_config(sets=["tracking_uri=none"]), "abc123") is None
