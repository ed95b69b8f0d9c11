"""What ``make ui-shots`` does up to the browser (benchmarks/ui_shots.py), and the figures its pictures show: a tiny
tracked run whose visits stop before their step cap (as the demo's do), its pictures listed from the store, the
Prefect API and MLflow, and each visit's final figures the same in the progress artifact, the log, the visits table
and MLflow (issue 45). No Chromium: CI has none."""
from __future__ import annotations

import re

import pytest

from tests.helpers import TINY, run_log


@pytest.fixture(scope="module")
def stopped_early(prefect_server, tmp_path_factory):
    """(config, log lines): a tracked 2-block run whose visits stop by a plateau at 6 of 12 steps, progress in log
    mode at the default period (so only the first step's line and the end's are due)."""
    from bcdflow.core.config import load_config
    from bcdflow.flows.bcd import bcd_train

    tmp = tmp_path_factory.mktemp("ui-shots")
    cfg = load_config(sets=TINY + [f"store={tmp / 'store'}", f"tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                   "bcd.blocks=2", "bcd.max_steps=12", "bcd.patience=2", "bcd.min_delta=100"])
    with pytest.MonkeyPatch.context() as mp, run_log() as lines:
        mp.setenv("BCDFLOW_PROGRESS", "log")
        mp.delenv("BCDFLOW_PROGRESS_SECONDS", raising=False)
        assert bcd_train(config=cfg, run_id="shots")["version"] == 2
    return cfg, lines


def test_ui_shots_lists_every_picture_of_a_run_without_a_browser(stopped_early, prefect_api_url, tmp_path):
    """Issue 45: ``make ui-shots`` crashed on a clean clone (it called storage.overview.overviews, moved to
    flows/status.py) and no test ran it. Everything it does before Chromium runs here."""
    from benchmarks import ui_shots
    from bcdflow.storage import runs
    from bcdflow.storage.store import Store

    cfg, _ = stopped_early
    store = Store(cfg.store)
    assert ui_shots.latest_run(store) == "shots"
    state = runs.read_state(store, "shots")
    shots = ui_shots.shot_list(store, "shots", prefect_api_url, cfg.tracking_uri, "http://ui:4200",
                               "http://ml:5000")
    urls = {name: url for name, url, *_ in shots}
    assert list(urls) == ["prefect-runs.png", "prefect-visit-progress.png", "prefect-visits-table.png",
                          "mlflow-runs.png", "mlflow-run.png", "mlflow-metrics.png", "mlflow-model.png"]
    assert urls["prefect-runs.png"] == "http://ui:4200/runs"
    assert re.fullmatch(r"http://ui:4200/artifacts/artifact/[0-9a-f-]{36}", urls["prefect-visit-progress.png"])
    assert urls["mlflow-run.png"].startswith("http://ml:5000/#/experiments/")
    assert urls["mlflow-run.png"].endswith(f"/runs/{state.mlflow_run_id}?workflowType=machine_learning")
    assert all(u.endswith("?workflowType=machine_learning") for n, u in urls.items() if n.startswith("mlflow"))
    with pytest.raises(SystemExit, match="make demo"):
        ui_shots.latest_run(Store(str(tmp_path)))  # a store without runs
    # `bcdflow status` links the run in MLflow's training view as the run itself did (from the SQLite file, read-only)
    from bcdflow.flows.status import status_dict
    from bcdflow.tracking.tracker import Tracker

    assert status_dict(store, "shots")["mlflow_url"] == Tracker(cfg.tracking_uri).run_url(state.mlflow_run_id)


def test_every_visits_final_figures_agree(stopped_early):
    """Issue 45: a visit stopped by its stop rule (the demo's: the adaptive budget) broke out of the step loop before
    its last progress call: its progress artifact kept the window before's loss (5.6349 against the visit's 5.6169)
    and the log had no last line for it. Now the artifact, the log's last line for the visit, the visits table and
    MLflow say the same train loss and steps."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from bcdflow.storage import runs
    from bcdflow.storage.store import Store
    from tests.test_tracking import _prefect_artifacts

    cfg, lines = stopped_early
    state = runs.read_state(Store(cfg.store), "shots")
    assert [(v.stopped_by, v.steps) for v in state.visits] == [("plateau", 6)] * 2
    with get_client(sync_client=True) as client:
        visit_runs = {fr.name: fr for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=["run:shots"])))}
    mlflow = MlflowClient(cfg.tracking_uri)
    children = {int(r.data.tags["bcdflow.version"]): r for r in mlflow.search_runs(
        [mlflow.get_run(state.mlflow_run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{state.mlflow_run_id}'")}
    for v in state.visits:
        label = f"c{v.cycle}-b{v.block} train"
        done = f"{label}: done, 6 of 12 steps (stopped by plateau"
        (art,) = _prefect_artifacts(str(visit_runs[f"shots/c{v.cycle}-b{v.block}"].id))["progress"]
        assert art["data"] == 100 and art["description"].startswith(done), art
        assert f"loss {v.train_loss:.4f}" in art["description"], (art["description"], v.train_loss)
        (last,) = [line for line in lines if line.startswith(done)]  # the log's last progress line: the same
        assert last == art["description"]
        assert float(children[v.version].data.tags["bcdflow.train_loss_last10_mean"]) == \
            pytest.approx(v.train_loss, rel=1e-6)
