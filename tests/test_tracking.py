"""What a tiny run leaves in MLflow (read back through ``MlflowClient``) and in Prefect (artifacts):
nested runs, per-visit metrics at step = version, cycle-level metrics and system metrics on the parent,
tags linking MLflow and Prefect both ways, figures and the exported model as artifacts; a second call
continues the same MLflow run."""
from __future__ import annotations

import json
import os

import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from bcdflow.flows.artifacts import RunArtifacts


def _prefect_artifacts(flow_run_id: str) -> dict[str, list[dict]]:
    """The flow run's artifacts by type, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    out: dict[str, list[dict]] = {}
    for a in sorted(arts, key=lambda a: a.created):
        out.setdefault(a.type, []).append(a.model_dump(mode="json"))
    return out


@pytest.mark.slow
def test_mlflow_and_prefect_contents_of_a_tiny_run(tiny_cfg, prefect_server, tmp_path, monkeypatch):
    from bcdflow.flows.bcd import bcd_train

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    cfg = tiny_cfg("bcd.blocks=2", "bcd.cycles=2", "stop.patience_cycles=0", tracking=True)
    out = bcd_train(config=cfg, run_id="t")
    assert out["stop_reason"] == "cycles" and out["version"] == 4

    client = MlflowClient(cfg.tracking_uri)
    exp = client.get_experiment_by_name("bcdflow")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model-training view
    all_runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(all_runs) == 5 and len(children) == 4
    assert parent.info.run_id == out["mlflow_run_id"] and parent.info.status == "FINISHED"
    pid = parent.info.run_id

    # tags: MLflow -> Prefect, and the stop reason
    tags = parent.data.tags
    assert tags["bcdflow.run_id"] == "t" and tags["bcdflow.mode"] == "bcd"
    assert tags["bcdflow.stop_reason"] == "cycles"
    flow_run_id = tags["prefect.flow_run_id"]
    assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run_id}")
    assert all(c.data.tags["prefect.flow_run_id"] not in ("", flow_run_id) for c in children)

    # a visit's run: its training curve and validation loss as metrics, its single values as the run summary
    # (tags and description), not one-point charts
    from bcdflow.storage import runs
    from bcdflow.storage.store import Store

    state = runs.read_state(Store(cfg.store), "t")
    by_version = {int(c.data.tags["bcdflow.version"]): c for c in children}
    assert sorted(by_version) == [1, 2, 3, 4]
    for v in state.visits:
        c = by_version[v.version]
        assert set(c.data.metrics) == {"train_loss", "val_loss", "val_ppl"}
        assert len(client.get_metric_history(c.info.run_id, "train_loss")) == v.steps
        assert float(c.data.tags["bcdflow.spend_usd"]) == pytest.approx(v.spend_usd, rel=1e-5)
        assert {"bcdflow.gpu_hours", "bcdflow.cum_spend_usd", "bcdflow.spend_train_usd", "bcdflow.eval_seconds",
                "bcdflow.stopped_by"} <= set(c.data.tags)
        assert f"committed version {v.version}" in c.data.tags["mlflow.note.content"]
    # and the per-visit figures as series over versions on the parent
    spent = {m.step: m.value for m in client.get_metric_history(pid, "visit/spend_usd")}
    assert spent == pytest.approx({v.version: v.spend_usd for v in state.visits})

    # parent: cycle-level validation loss and cumulative spend (step = cycle), totals, system metrics
    cyc = client.get_metric_history(pid, "cycle_val_loss")
    assert sorted(m.step for m in cyc) == [0, 1]
    assert {m.step: m.value for m in cyc}[1] == pytest.approx(state.visits[-1].val_loss)
    spend_by_cycle = {m.step: m.value for m in client.get_metric_history(pid, "cycle_cum_spend_usd")}
    assert spend_by_cycle[1] == pytest.approx(state.visits[-1].cum_spend_usd) and spend_by_cycle[0] > 0
    assert float(parent.data.tags["bcdflow.spend_usd"]) == pytest.approx(out["spend_usd"], rel=1e-5)
    assert int(parent.data.tags["bcdflow.total_steps"]) == sum(v.steps for v in state.visits)
    assert not {"spend_usd", "gpu_hours", "wall_seconds", "total_steps"} & set(parent.data.metrics)
    system = {k for k in parent.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system

    # artifacts: three figures and the exported final model
    figs = {os.path.basename(a.path) for a in client.list_artifacts(pid, "figures")}
    assert figs == {"loss_over_steps.png", "val_loss_vs_spend.png", "spend_by_stage.png"}
    local = client.download_artifacts(pid, "model", str(tmp_path / "dl"))
    assert {"model.safetensors", "config.json"} <= set(os.listdir(local))
    assert json.load(open(os.path.join(local, "config.json")))["version"] == 4
    assert len(load_file(os.path.join(local, "model.safetensors"))) > 0
    with open(os.path.join(client.download_artifacts(pid, "figures/loss_over_steps.png", str(tmp_path / "f"))),
              "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # Prefect -> MLflow: a link (stored as markdown), one visits table updated in place, the progress bar at 100%
    arts = _prefect_artifacts(flow_run_id)
    key = RunArtifacts("t", Store(cfg.store).url, 4).key
    (link,) = arts["markdown"]
    assert link["key"] == key("mlflow") and pid in link["data"] and link["data"].startswith("[")
    (table,) = arts["table"]
    assert table["key"] == key("visits")
    rows = json.loads(table["data"])
    assert [(r["cycle"], r["block"]) for r in rows] == [(c, b) for c in range(2) for b in range(2)]
    assert rows[-1]["total $"] == pytest.approx(state.visits[-1].cum_spend_usd, rel=1e-4)
    (progress,) = arts["progress"]
    assert progress["key"] == key("progress") and float(progress["data"]) == 100.0

    # calling it again continues the same MLflow run: no second parent, the stop reason kept
    out2 = bcd_train(config=cfg, run_id="t")
    assert out2["mlflow_run_id"] == pid
    again = client.search_runs([exp.experiment_id])
    assert len(again) == 5
    assert client.get_run(pid).data.tags["bcdflow.stop_reason"] == "cycles"
    assert client.get_run(pid).info.status == "FINISHED"

    # Prefect: the parent flow run is named by the run id, each visit's flow run is tagged with run, cycle and
    # block, and the run keeps one visits table across its flow runs (the second call updated it in place)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter,
                                                FlowRunFilterParentFlowRunId, FlowRunFilterTags)

    with get_client(sync_client=True) as pc:
        assert pc.read_flow_run(flow_run_id).name == "t"
        visits = pc.read_flow_runs(flow_run_filter=FlowRunFilter(  # this test's parent (other tests use "t" too)
            tags=FlowRunFilterTags(all_=["run:t"]), parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        tables = pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key("visits")])))
    assert sorted((r.name, sorted(r.tags)) for r in visits) == [
        (f"c{c}-b{b}", sorted(["run:t", f"cycle:{c}", f"block:{b}"])) for c in range(2) for b in range(2)]
    assert len(tables) == 1


def test_tracker_off_is_a_no_op(tmp_path):
    from bcdflow.tracking.tracker import Tracker

    t = Tracker("none")
    assert t.start("x", system_metrics=True) is None
    assert t.history(None, "loss") == [] and t.run_url(None) is None
    t.metrics(None, {"a": 1.0}, 0)
    t.end(None)
