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


def test_artifact_keys_read_as_the_run():
    """Issue 45: a run's artifact keys carried an opaque hash of its store (``bcd-20250101-120000-1a2b-3f9a2c-visits``).
    A run id bcdflow generated is the key as it is; a hash joins only an id that could name another run: one the
    user chose (the same in two stores that share a Prefect server) or one that is not a key as it is."""
    import re

    from bcdflow.flows.params import new_run_id

    generated = new_run_id("bcd")
    assert RunArtifacts(generated, "file:///a/store", 4).key("visits") == f"{generated}-visits"
    assert RunArtifacts("full-20250101-120000-1a2b", "s3://b/p", 4).key("mlflow") == "full-20250101-120000-1a2b-mlflow"
    chosen = [RunArtifacts(r, url, 4).key("visits") for r in ("exp1", "Exp_1", "exp-1")
              for url in ("file:///a/store", "file:///b/store")]
    assert len(set(chosen)) == len(chosen)  # two stores, and ids equal once lowercased with dashes, stay apart
    assert all(k.startswith(("exp1-", "exp-1-")) and k.endswith("-visits") for k in chosen), chosen
    assert all(re.fullmatch(r"[a-z0-9-]+", k) for k in chosen)  # what Prefect accepts as a key


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

    # parameters as resolved (issue 37): no "None", the model's real sizes, the layers each block covers
    params = parent.data.params
    assert "None" not in params.values() and params["model.n_layer"] == "6" and int(params["model.params"]) > 0
    spans = [tuple(map(int, params[f"block.{b}.layers"].split("-"))) for b in range(2)]
    assert spans[0][0] == 0 and spans[1] == (spans[0][1] + 1, 5)
    # the training data as a dataset input, on the run and each visit
    for r in [parent, *children]:
        (ds,) = client.get_run(r.info.run_id).inputs.dataset_inputs
        assert ds.dataset.digest == parent.data.tags["bcdflow.dataset"] and ds.dataset.name.startswith("built-in")

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
        note = c.data.tags["mlflow.note.content"]
        assert f"committed version {v.version}" in note and "stopped by max_steps: reached its step cap" in note
        # the two train losses by name: every step's (the metric) and the mean of the last ones (the summary)
        assert "bcdflow.train_loss" not in c.data.tags
        assert float(c.data.tags["bcdflow.train_loss_last10_mean"]) == pytest.approx(v.train_loss, rel=1e-5)
        assert "the mean of its last 6 steps" in note
        assert c.data.params["base_version"] == str(v.version - 1)
    # and the per-visit figures as series over the run's global step on the parent (a visit's last step)
    spent = {m.step: m.value for m in client.get_metric_history(pid, "visit_spend_usd")}
    assert spent == pytest.approx({v.step_end: v.spend_usd for v in state.visits})

    # each committed version as a logged model pointing at the store's version: no weights copied
    models = {m.name: m for m in client.search_logged_models(experiment_ids=[exp.experiment_id])}
    assert sorted(models) == [f"t-v{v}" for v in (1, 2, 3, 4)]
    for v in state.visits:
        m = models[f"t-v{v.version}"]
        assert m.source_run_id == pid and m.tags["mlflow.external"] == "true"  # the run's models (Models column)
        assert m.tags["bcdflow.manifest"] == m.params["manifest"] == f"runs/t/versions/{v.version}.json"
        linked = {x.key: (x.step, x.value, x.run_id) for x in m.metrics}["val_loss"]
        assert linked == (v.step_end, pytest.approx(v.val_loss), by_version[v.version].info.run_id)  # the visit's
        assert [o.model_id for o in client.get_run(by_version[v.version].info.run_id).outputs.model_outputs] == [
            m.model_id]
        assert client.list_artifacts(by_version[v.version].info.run_id) == []
    assert sorted(o.model_id for o in client.get_run(pid).outputs.model_outputs) == sorted(
        m.model_id for m in models.values())

    # parent: cycle-level validation loss and cumulative spend (step = cycle), totals, system metrics
    cyc = client.get_metric_history(pid, "cycle_val_loss")
    ends = [state.visits[1].step_end, state.visits[3].step_end]  # at the global step where each cycle ended
    assert sorted(m.step for m in cyc) == ends
    assert {m.step: m.value for m in cyc}[ends[1]] == pytest.approx(state.visits[-1].val_loss)
    spend_by_cycle = {m.step: m.value for m in client.get_metric_history(pid, "cycle_cum_spend_usd")}
    assert spend_by_cycle[ends[1]] == pytest.approx(state.visits[-1].cum_spend_usd) and spend_by_cycle[ends[0]] > 0
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
    assert f"/#/experiments/{exp.experiment_id}/runs/{pid}?workflowType=machine_learning)" in link["data"]
    (table,) = arts["table"]
    assert table["key"] == key("visits")
    rows = json.loads(table["data"])
    assert [(r["cycle"], r["block"]) for r in rows] == [(c, b) for c in range(2) for b in range(2)]
    assert rows[-1]["total $"] == pytest.approx(state.visits[-1].cum_spend_usd, rel=1e-4)
    assert rows[0]["stopped by"] == "max_steps"  # and in words:
    assert "the run stopped (cycles): every planned cycle (bcd.cycles) is done" in table["description"]
    assert "A visit stopped by **max_steps**: reached its step cap (bcd.max_steps)." in table["description"]
    (progress,) = arts["progress"]
    assert progress["key"] == key("progress") and progress["data"] == 100

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
    assert sorted((r.name, sorted(r.tags)) for r in visits) == [  # named by their run too (issue 37)
        (f"t/c{c}-b{b}", sorted(["run:t", f"cycle:{c}", f"block:{b}"])) for c in range(2) for b in range(2)]
    assert sorted(r.parameters["base_version"] for r in visits) == [0, 1, 2, 3]
    assert len(tables) == 1


def test_tracker_off_is_a_no_op(tmp_path):
    from bcdflow.tracking.tracker import Tracker

    t = Tracker("none")
    assert t.start("x", system_metrics=True) is None
    assert t.history(None, "loss") == [] and t.run_url(None) is None
    t.metrics(None, {"a": 1.0}, 0)
    t.end(None)


def test_a_replaced_attempt_is_marked_crashed_with_its_task_runs(prefect_server):
    """Issue 37: a visit killed mid-training left its train task Running for ever (its flow run was marked Crashed when
    the visit was taken over, its task runs were not), and its progress artifact on the dead attempt. The attempt that
    takes the visit over marks all of them, naming itself."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.states import Completed, Running

    from bcdflow.flows.artifacts import crash_previous

    @flow(name="bcd-visit")
    def dead():
        pass

    @task(name="train-block")
    def train():
        pass

    @task(name="plan-shards")
    def planned():
        pass

    with get_client(sync_client=True) as client:  # what a kill -9 mid-training leaves: all Running
        old = client.create_flow_run(dead, name="r/c0-b1", state=Running())
        busy = client.create_task_run(train, old.id, "train-block-1", state=Running())
        done = client.create_task_run(planned, old.id, "plan-shards-1", state=Completed())
        client.create_artifact(ArtifactCreate(type="progress", data=48, description="c0-b1 train: steps 29/60 (48%)",
                                              flow_run_id=old.id))

    @flow(name="bcd-visit", flow_run_name="r/c0-b1 again")
    def takeover():
        from prefect.runtime import flow_run

        return crash_previous({"owner": {"flow_run_id": str(old.id)}}, "visit c0-b1 of 'r'"), flow_run.get_id()

    marked, me = takeover()
    assert marked == str(old.id)
    with get_client(sync_client=True) as client:
        fr, tr = client.read_flow_run(old.id), client.read_task_run(busy.id)
        assert client.read_task_run(done.id).state.is_completed()  # a finished task keeps its state
        (art,) = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[old.id])))
    assert fr.state.is_crashed() and tr.state.is_crashed()
    for message in (fr.state.message, tr.state.message, art.description):
        assert "visit c0-b1 of 'r'" in message and f"replaced by flow run 'r/c0-b1 again' ({me})" in message
    assert art.description.startswith("c0-b1 train: steps 29/60 (48%)")
    assert takeover()[0] is None  # final now: left alone


def test_run_parameters_are_the_resolved_values_never_none(tiny_cfg):
    """Issue 37: about 40 of 102 logged parameters were "None" (unset keys), while the model's real sizes and the
    layers each block covers were not logged at all."""
    from bcdflow.core.context import block_plan, model_config
    from tests.helpers import count_params
    from bcdflow.tracking.describe import run_params

    cfg = tiny_cfg("bcd.blocks=3")
    mcfg = model_config(cfg)
    plan = block_plan(cfg, mcfg)
    p = run_params(cfg, "bcd", mcfg, plan)
    assert all(isinstance(v, str) for v in p.values()) and "None" not in p.values()
    assert (p["model.n_layer"], p["model.d_model"], p["model.n_head"]) == ("6", "64", "4")
    assert int(p["model.d_ff"]) == mcfg.ffn_dim and p["model.n_ctx"] == str(mcfg.n_ctx)
    assert p["model.params"] == str(count_params(mcfg))
    covered = [tuple(map(int, p[f"block.{b}.layers"].split("-"))) for b in range(3)]
    assert covered == [(lo, hi - 1) for lo, hi in (blk.layers for blk in plan.blocks)]
    assert covered[0][0] == 0 and covered[-1][1] == 5
    assert sum(int(p[f"block.{b}.params"]) for b in range(3)) == count_params(mcfg)
    assert p["optim.lr"] == "0.003" and p["bcd.blocks"] == "3" and p["mode"] == "bcd"
    assert "store" not in p and "tracking_uri" not in p


def test_links_open_the_training_view_of_the_installed_mlflow_ui(tmp_path):
    """Issue 37: a fresh browser opened MLflow 3 in its GenAI view. The installed UI (3.17) reads the view from the
    URL's ``workflowType`` (else the browser's last choice, GenAI by default) and an experiment's default from its
    ``mlflow.experimentKind`` tag: the links bcdflow prints carry the first, the experiment the second."""
    import glob

    import mlflow

    from bcdflow.tracking.tracker import EXPERIMENT_KIND, MODEL_TRAINING, TRAINING_VIEW, Tracker

    js = "".join(open(f, encoding="utf-8").read() for f in glob.glob(os.path.join(
        os.path.dirname(mlflow.__file__), "server", "js", "build", "static", "js", "main.*.js")))
    assert 'get("workflowType")' in js and 'MACHINE_LEARNING="machine_learning"' in js  # what the UI reads
    assert f'"{EXPERIMENT_KIND}"' in js and f'CUSTOM_MODEL_DEVELOPMENT="{MODEL_TRAINING}"' in js
    assert TRAINING_VIEW == "workflowType=machine_learning"
    t = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "e")
    run = t.start("r")
    assert t.run_url(run) == f"http://127.0.0.1:5000/#/experiments/{t.experiment_id}/runs/{run}?{TRAINING_VIEW}"
    assert MlflowClient(t.uri).get_experiment(t.experiment_id).tags[EXPERIMENT_KIND] == MODEL_TRAINING


def test_a_dataset_input_and_an_external_model_per_version(tmp_path):
    """The tracker's two MLflow 3 records of a run: the data it trained on (name, digest: the Dataset column) and a
    committed version as a model whose weights stay in the store (mlflow.external), its metrics linked to it."""
    from bcdflow.tracking.tracker import Tracker

    t = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "e")
    parent = t.start("r")
    child = t.start("c0-b0", parent=parent)
    for _ in range(2):  # logged again (a resumed run): still one input
        t.dataset(parent, "files /x/*.txt", "0123456789abcdef", "local", "/x/*.txt", {"train_rows": 9})
    mid = t.external_model(child, "r-v1", {"bcdflow.version": 1}, {"manifest": "runs/r/versions/1.json"},
                           {"val_loss": 4.5}, 12, source_run_id=parent, dataset=("files /x/*.txt", "0123456789abcdef"),
                           outputs_of=(child, parent))
    c = MlflowClient(t.uri)
    (ds,) = c.get_run(parent).inputs.dataset_inputs
    assert (ds.dataset.name, ds.dataset.digest, json.loads(ds.dataset.profile)) == (
        "files /x/*.txt", "0123456789abcdef", {"train_rows": 9})
    model = c.get_logged_model(mid)
    assert (model.name, model.source_run_id, str(model.status)) == ("r-v1", parent, "READY")
    assert model.tags["mlflow.external"] == "true" and model.tags["bcdflow.version"] == "1"
    assert model.params == {"manifest": "runs/r/versions/1.json"}
    assert [(m.key, m.value, m.step, m.run_id, m.dataset_digest) for m in model.metrics] == [
        ("val_loss", 4.5, 12, child, "0123456789abcdef")]
    assert [o.model_id for o in c.get_run(parent).outputs.model_outputs] == [mid]
    assert c.list_artifacts(child) == []  # nothing copied


def test_val_loss_vs_spend_has_a_legend_for_its_block_colours():
    """Issue 37: the run's val_loss_vs_spend figure coloured its points by block without saying which is which."""
    import matplotlib.pyplot as plt

    from bcdflow.core.spend import curve
    from bcdflow.tracking.figures import _block_colors, val_loss_axes
    from tests.helpers import visit_record
    from bcdflow.core.config import load_config

    sp = load_config(sets=[]).spend
    visits = [visit_record(sp, c, b, train=1.0, val=5.0 - c - b / 10, version=2 * c + b + 1, step_end=10 * (2 * c + b + 1))
              for c in range(2) for b in range(2)]
    fig, ax = plt.subplots()
    val_loss_axes(ax, {"": curve(visits)}, "spend_usd", block_colors=_block_colors(visits))
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["after a visit of block 0", "after a visit of block 1"]
    plt.close(fig)
