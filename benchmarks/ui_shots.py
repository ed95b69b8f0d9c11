"""Screenshots of what a user sees in the Prefect and MLflow UIs after ``make demo`` (docs/guide/watching.md).

Starts ``prefect server start`` (on the demo's Prefect database: ``PREFECT_HOME``) and ``mlflow ui`` (on the store's
``mlflow.db``) on loopback ports, opens their pages in headless Chromium (Debian's ``chromium``: ``apt-get install -y
chromium``) with a fresh profile, writes one PNG per page (reduced to a 256-colour palette, so they stay small) and
stops both servers. Not a test: a look at the real UIs, kept in ``docs/ui/``.

    make demo && make ui-shots                        # = .venv/bin/python benchmarks/ui_shots.py
    python benchmarks/ui_shots.py --store ./bcdflow-store --run-id RUN --out docs/ui [--chromium PATH]

The pages: Prefect's flow runs (the visits named by their run), a visit's progress artifact at its real end, the
run's visits table (why each visit stopped, in words); MLflow's runs of the experiment in its model-training view
(dataset and models columns), the run's overview (parameters as resolved, description), its model metrics (charts
against the global step) and the logged model of the last committed version (pointing at the store).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BIN = os.path.dirname(sys.executable)
# MLflow's UI on another loopback address than 127.0.0.1: on "localhost" or 127.0.0.1 it opens its AI assistant panel
# over a third of the page on a first visit (a user closes it once; a fresh profile per shot never has)
MLFLOW_HOST = "127.0.0.2"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1", "--run-all-compositor-stages-before-draw"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, seconds: float = 180.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {seconds:.0f} s")


def post(url: str, body: dict) -> list | dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def start(cmd: list[str], env: dict, log: str) -> subprocess.Popen:
    """A server in its own session (stopped with its children by :func:`stop`)."""
    return subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def shoot(chromium: str, url: str, path: str, size: tuple[int, int], wait_ms: int, tries: int = 3) -> None:
    """One page as a PNG, in a fresh profile (nothing remembered between shots: a new user's first look). Virtual
    time lets a page's scripts run ahead of the clock; a Chromium that never finishes (now and then on a busy
    machine) is stopped, all its processes, and tried again."""
    for attempt in range(1, tries + 1):
        if os.path.exists(path):
            os.remove(path)
        with tempfile.TemporaryDirectory(prefix="ui-shots-profile-", ignore_cleanup_errors=True) as profile:
            proc = subprocess.Popen([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                     f"--window-size={size[0]},{size[1]}", f"--virtual-time-budget={wait_ms}",
                                     f"--screenshot={path}", url], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                if proc.wait(timeout=180) == 0 and os.path.exists(path):
                    break
            except subprocess.TimeoutExpired:
                pass
            finally:
                stop(proc)
        print(f"  {os.path.basename(path)}: Chromium did not finish (attempt {attempt} of {tries})")
    else:
        raise SystemExit(f"no screenshot of {url}")
    from PIL import Image

    Image.open(path).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    print(f"  {os.path.relpath(path, ROOT)}  {os.path.getsize(path) / 1024:.0f} KiB  <- {url}")


def latest_run(store) -> str:
    from bcdflow.flows.status import overviews

    rows = overviews(store)
    if not rows:
        raise SystemExit(f"no run in store {store.url}: run `make demo` first")
    return rows[0]["run_id"]


def shot_list(store, run_id: str, prefect_api: str, mlflow_uri: str, prefect_ui: str | None = None,
              mlflow_ui: str | None = None) -> list[tuple]:
    """The pictures of run ``run_id`` as ``(file name, page URL, window size[, wait factor])``, without a browser:
    the run's state from ``store``, its flow runs and artifacts from the Prefect API at ``prefect_api`` (``.../api``),
    its MLflow experiment and last logged model from ``mlflow_uri`` (the store's ``sqlite:///.../mlflow.db``); pages
    on the UIs at ``prefect_ui`` (default: the API's server) and ``mlflow_ui`` (default: ``mlflow ui``'s address).
    ``tests/test_ui_shots.py`` runs this on a tiny run, so what ``make ui-shots`` calls stays where it is."""
    from mlflow.tracking import MlflowClient

    from bcdflow.flows.artifacts import RunArtifacts
    from bcdflow.storage import runs
    from bcdflow.tracking.tracker import TRAINING_VIEW

    state = runs.read_state(store, run_id)
    if state is None or not state.mlflow_run_id:
        raise SystemExit(f"run {run_id!r} has no state or no MLflow run in {store.url}")
    papi = prefect_api.rstrip("/")
    pui = (prefect_ui or papi.removesuffix("/api")).rstrip("/")
    mui = (mlflow_ui or "http://127.0.0.1:5000").rstrip("/")
    client = MlflowClient(mlflow_uri)
    exp = client.get_run(state.mlflow_run_id).info.experiment_id
    ml = TRAINING_VIEW
    shots = [
        ("prefect-runs.png", f"{pui}/runs", (1400, 900)),
        ("mlflow-runs.png", f"{mui}/#/experiments/{exp}/runs?{ml}", (1600, 800)),
        ("mlflow-run.png", f"{mui}/#/experiments/{exp}/runs/{state.mlflow_run_id}?{ml}", (1400, 1100)),
        ("mlflow-metrics.png", f"{mui}/#/experiments/{exp}/runs/{state.mlflow_run_id}/model-metrics?{ml}",
         (1400, 1000), 3),  # 14 charts, each its own requests: three times the wait
    ]
    models = client.search_logged_models(experiment_ids=[exp], max_results=1,
                                         order_by=[{"field_name": "creation_time", "ascending": False}])
    if models:  # the last committed version's model: where it points, its metrics, its source run
        shots.append(("mlflow-model.png", f"{mui}/#/experiments/{exp}/models/{models[0].model_id}?{ml}",
                      (1400, 900)))
    flow_runs = post(f"{papi}/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"run:{run_id}"]}},
                                                  "sort": "START_TIME_ASC"})
    if flow_runs:  # a visit that stopped before its step cap: its progress artifact at the visit's real end
        early = next((v for v in state.visits if v.stopped_by != "max_steps"), state.visits[-1])
        visit_fr = next((fr for fr in flow_runs if fr["name"].endswith(f"c{early.cycle}-b{early.block}")),
                        flow_runs[-1])
        progress = post(f"{papi}/artifacts/filter", {"artifacts": {
            "flow_run_id": {"any_": [visit_fr["id"]]}, "type": {"any_": ["progress"]}}})
        if progress:
            shots.insert(1, ("prefect-visit-progress.png", f"{pui}/artifacts/artifact/{progress[0]['id']}",
                             (1400, 520)))
    table = post(f"{papi}/artifacts/filter", {"artifacts": {"key": {"any_": [
        RunArtifacts(run_id, store.url, 1).key("visits")]}}, "sort": "CREATED_DESC", "limit": 1})
    if table:
        shots.insert(2, ("prefect-visits-table.png", f"{pui}/artifacts/artifact/{table[0]['id']}", (1700, 760)))
    return shots


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="./bcdflow-store")
    ap.add_argument("--run-id", help="the run to show (default: the store's most recently changed run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "ui"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    ap.add_argument("--wait-ms", type=int, default=12000, help="virtual time each page gets to load")
    ap.add_argument("--only", help="only the pictures whose name starts with this (prefect, mlflow-run, ...)")
    args = ap.parse_args(argv)

    from bcdflow.storage.store import Store

    store = Store(args.store)
    run_id = args.run_id or latest_run(store)
    db = os.path.join(os.path.abspath(args.store), "mlflow.db")
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "MLFLOW_ENABLE_TELEMETRY": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("PREFECT_API_URL", None)
    pport, mport = free_port(), free_port()
    logs = tempfile.mkdtemp(prefix="ui-shots-logs-")
    print(f"run {run_id}: Prefect UI on :{pport} (PREFECT_HOME={env.get('PREFECT_HOME', '~/.prefect')}), "
          f"MLflow UI on :{mport} ({db}); server logs in {logs}")
    prefect = start([os.path.join(BIN, "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(pport)],
                    {**env, "PREFECT_UI_API_URL": f"http://127.0.0.1:{pport}/api"}, os.path.join(logs, "prefect.log"))
    mlflow = start([os.path.join(BIN, "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{db}", "--host",
                    MLFLOW_HOST, "--port", str(mport), "--workers", "1", "--allowed-hosts",
                    f"{MLFLOW_HOST}:{mport},{MLFLOW_HOST}", "--cors-allowed-origins", f"http://{MLFLOW_HOST}:{mport}"],
                   env, os.path.join(logs, "mlflow.log"))
    try:
        papi, mui = f"http://127.0.0.1:{pport}", f"http://{MLFLOW_HOST}:{mport}"
        wait_for(f"{papi}/api/health")
        wait_for(f"{mui}/health")
        shots = shot_list(store, run_id, f"{papi}/api", f"sqlite:///{db}", papi, mui)
        for name, url, size, *slow in shots:
            if args.only and not name.startswith(args.only):
                continue
            shoot(args.chromium, url, os.path.join(args.out, name), size, args.wait_ms * (slow[0] if slow else 1))
    finally:
        stop(prefect)
        stop(mlflow)
    return 0


if __name__ == "__main__":
    sys.exit(main())
