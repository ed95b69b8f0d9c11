"""The one seam to MLflow (docs/CONVENTIONS.md 6). ``Tracker("none")`` is a no-op.

One MLflow run per training run, a nested run per visit (tag ``mlflow.parentRunId``). Metrics are
batched (``log_batch``) so a SQLite backend never sits on the training hot path per step. A run started
with ``system_metrics=True`` samples CPU, memory, disk, network (and NVIDIA GPUs when ``pynvml`` is
installed: the ``gpu`` extra) into ``system/*`` metrics every ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
seconds (default 10) until ``end``.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# the MLflow UI opens an experiment of this kind in its model-training view (not the GenAI one)
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# ... but MLflow 3.17's UI takes the view of a page it opens from the URL's ``workflowType`` (else the browser's last
# choice, else GenAI), not from the experiment: every link bcdflow gives says it (its JS: ``mlflow.workflowType``)
TRAINING_VIEW = "workflowType=machine_learning"


def ui_base(uri: str) -> str:
    """Where the MLflow UI of tracking ``uri`` answers: the tracking server itself, or for a file/SQLite backend the
    ``mlflow ui`` address in ``BCDFLOW_MLFLOW_UI`` (default http://127.0.0.1:5000)."""
    base = uri if uri.startswith(("http://", "https://")) else \
        os.environ.get("BCDFLOW_MLFLOW_UI", "http://127.0.0.1:5000")
    return base.rstrip("/")


def run_link(uri: str, experiment_id: str | None, run_id: str) -> str:
    """Run ``run_id``'s page in the MLflow UI of ``uri``, in its model-training view. Without the experiment
    (a reader that did not ask the server), MLflow's direct route ``#/runs/ID``, which finds it."""
    where = f"experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"runs/{run_id}"
    return f"{ui_base(uri)}/#/{where}?{TRAINING_VIEW}"


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = str(v)[:6000]
    return out


class Tracker:
    def __init__(self, uri: str, experiment: str = "bcdflow", artifact_root: str | None = None):
        self.enabled = bool(uri) and uri.lower() != "none"
        self.uri = uri
        self._monitors: dict[str, Any] = {}
        if not self.enabled:
            return
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri.removeprefix("sqlite:///")) or ".", exist_ok=True)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            if artifact_root is None and uri.startswith("sqlite:///"):
                artifact_root = os.path.join(os.path.dirname(uri.removeprefix("sqlite:///")), "mlartifacts")
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_root,
                                                               tags={EXPERIMENT_KIND: MODEL_TRAINING})
        else:
            self.experiment_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND) is None:
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)

    def start(self, name: str, params: dict | None = None, tags: dict | None = None,
              parent: str | None = None, resume_id: str | None = None,
              system_metrics: bool = False) -> str | None:
        """Start (or continue, with ``resume_id``) a run; returns its id. A ``resume_id`` this tracking backend does
        not hold (the run continues on another machine, or from another directory, whose backend never saw it) opens a
        new run that says which one it continues (tag ``bcdflow.continues``), with a one-line warning."""
        if not self.enabled:
            return None
        if resume_id and not self._has_run(resume_id):
            log.warning("MLflow run %s is not in the tracking backend %s (the run was tracked elsewhere): a new MLflow "
                        "run continues it", resume_id, self.uri)
            tags = {**(tags or {}), "bcdflow.continues": resume_id}
            resume_id = None
        if resume_id:
            self.client.update_run(resume_id, status="RUNNING")
            self.tags(resume_id, tags or {})  # e.g. the Prefect flow run that continues it
            if system_metrics:
                self._monitor(resume_id, resume=True)
            return resume_id
        all_tags = dict(tags or {})
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        if params:
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in _flat(params).items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(run.info.run_id, params=items[i:i + 100])
        if system_metrics:
            self._monitor(run.info.run_id)
        return run.info.run_id

    def _has_run(self, run_id: str) -> bool:
        """Whether this backend holds run ``run_id`` (and has not deleted it)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage != "deleted"
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _monitor(self, run_id: str, resume: bool = False) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        try:
            mon = SystemMetricsMonitor(run_id, resume_logging=resume, tracking_uri=self.uri)
        except Exception as e:  # psutil missing or an unsupported platform: train without them
            log.warning("system metrics off: %s", e)
            return
        mon.start()
        self._monitors[run_id] = mon

    def metrics(self, run_id: str | None, values: dict[str, float], step: int) -> None:
        self.metric_series(run_id, {k: [(step, v)] for k, v in values.items()})

    def metric_series(self, run_id: str | None, series: dict[str, list[tuple[int, float]]]) -> None:
        """Log many (step, value) points per metric in batches of 1000."""
        if not self.enabled or run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(s)) for k, pts in series.items() for s, v in pts]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def tags(self, run_id: str | None, tags: dict[str, Any]) -> None:
        if self.enabled and run_id and tags:
            from mlflow.entities import RunTag

            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def summary(self, run_id: str | None, values: dict[str, Any], note: str) -> None:
        """A run's single-valued results: tags ``bcdflow.<name>`` (columns of the runs table) and the run's
        description (its page in the UI), not one-point metric charts."""
        fmt = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in values.items()}
        self.tags(run_id, {**{f"bcdflow.{k}": v for k, v in fmt.items()}, "mlflow.note.content": note})

    def artifact(self, run_id: str | None, path: str, artifact_path: str | None = None) -> None:
        if self.enabled and run_id:
            if os.path.isdir(path):
                self.client.log_artifacts(run_id, path, artifact_path)
            else:
                self.client.log_artifact(run_id, path, artifact_path)

    def history(self, run_id: str | None, key: str) -> list[tuple[int, float]]:
        """A metric's (step, value) points in step order; a step logged twice (a resumed visit) keeps
        its last value."""
        if not self.enabled or run_id is None:
            return []
        last = {m.step: m.value for m in sorted(self.client.get_metric_history(run_id, key),
                                                key=lambda m: m.timestamp)}
        return sorted(last.items())

    def run_url(self, run_id: str | None) -> str | None:
        """The run's page in the MLflow UI, in its model-training view: the tracking server itself, or for a
        file/SQLite backend the ``mlflow ui`` address in ``BCDFLOW_MLFLOW_UI`` (default http://127.0.0.1:5000)."""
        if not self.enabled or run_id is None:
            return None
        return run_link(self.uri, self.experiment_id, run_id)

    def dataset(self, run_id: str | None, name: str, digest: str, source_type: str, source: str,
                profile: dict | None = None, context: str = "training") -> None:
        """The data ``run_id`` trained on as an MLflow dataset input (the runs table's Dataset column): ``name`` and
        ``digest`` (logged again, it is the same input), where it came from, its figures (``profile``)."""
        if not (self.enabled and run_id):
            return
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag

        ds = Dataset(name=name, digest=digest, source_type=source_type, source=json.dumps({"uri": source}),
                     profile=json.dumps(profile or {}))
        self.client.log_inputs(run_id, [DatasetInput(ds, [InputTag("mlflow.data.context", context)])])

    def external_model(self, run_id: str | None, name: str, tags: dict[str, Any], params: dict[str, Any],
                       metrics: dict[str, float], step: int, source_run_id: str | None = None,
                       dataset: tuple[str, str] | None = None, outputs_of: tuple[str, ...] = ()) -> str | None:
        """A logged model whose weights stay outside MLflow (tag ``mlflow.external``: nothing is copied), with
        ``params``, and ``metrics`` of ``run_id`` at ``step`` linked to it (measured on ``dataset``: its name and
        digest); its source run is ``source_run_id`` (default ``run_id``: the runs table's Models column lists a
        run's models by it) and it is an output of the runs ``outputs_of`` (their pages' Logged models); returns its
        id."""
        if not (self.enabled and run_id):
            return None
        from mlflow.entities import LoggedModelOutput, Metric

        model = self.client.create_logged_model(self.experiment_id, name=name, source_run_id=source_run_id or run_id,
                                                tags={"mlflow.external": "true", **{k: str(v) for k, v in tags.items()}},
                                                params={k: str(v) for k, v in params.items()})
        self.client.finalize_logged_model(model.model_id, "READY")
        now = int(time.time() * 1000)
        name_digest = dict(zip(("dataset_name", "dataset_digest"), dataset or ()))
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, step, model_id=model.model_id, **name_digest)
                                               for k, v in metrics.items()])
        for rid in outputs_of:
            self.client.log_outputs(rid, [LoggedModelOutput(model.model_id, step)])
        return model.model_id

    def end(self, run_id: str | None, status: str = "FINISHED") -> None:
        if self.enabled and run_id:
            mon = self._monitors.pop(run_id, None)
            if mon is not None:
                mon.finish()  # flush the last samples while the run is still RUNNING
            self.client.set_terminated(run_id, status=status)


# the tracking URI schemes MLflow itself serves (its tracking store registry; plugins add theirs by entry point)
_SCHEMES = {"http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc"}


def check_reachable(uri: str, setting: str = "tracking_uri") -> None:
    """BadInput (exit 2, before anything is written, and before MLflow retries for minutes) when ``uri`` cannot work
    as the run's tracking backend; ``setting`` names where the URI came from. Nothing is created or written here:
    an unknown scheme (none of MLflow's, nor a plugin's); a folder or ``file:`` URI (MLflow 3's file store, refused
    by MLflow unless ``MLFLOW_ALLOW_FILE_STORE`` is set); a SQLite path that is a folder, below a file, not a SQLite
    database or not writable; an http(s) address that does not answer, or answers but not as an MLflow tracking
    server (its REST API, asked for an experiment by name). Network databases (postgresql, ...) are left to MLflow."""
    if not uri or uri.lower() == "none":
        return
    from urllib.parse import urlparse

    from bcdflow.errors import BadInput

    shown = uri if len(uri) <= 200 else uri[:200] + "..."

    def refuse(why: str) -> None:
        raise BadInput(f"{setting}: {why}; set tracking_uri=sqlite:///PATH/mlflow.db, http(s)://SERVER, or none to "
                       "train without tracking")

    try:
        scheme = urlparse(uri).scheme.lower()
    except ValueError as e:  # a malformed address (an unclosed IPv6 bracket)
        refuse(f"{shown!r} is not a URI ({e})")
    scheme = "" if len(scheme) == 1 else scheme.split("+", 1)[0]  # a Windows drive; a database's driver
    if uri in ("databricks", "databricks-uc", "uc"):
        return
    if scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            refuse(f"{shown!r} is a folder (MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE"
                   "=true)")
        _check_writable(uri.removeprefix("file://"), refuse, shown, folder=True)
        return
    if scheme not in _SCHEMES:
        from importlib.metadata import entry_points

        if scheme not in {e.name for e in entry_points(group="mlflow.tracking_store")}:
            refuse(f"{shown!r} has a scheme MLflow does not track to ({scheme!r}; it knows "
                   f"{', '.join(sorted(_SCHEMES))})")
        return
    if scheme == "sqlite":
        path = uri.split("?", 1)[0][len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            _check_sqlite(path, refuse, shown)
        return
    if scheme in ("http", "https"):
        _check_server(uri, refuse, shown)


def _check_writable(path: str, refuse, shown: str, folder: bool) -> str | None:
    """``path`` (a SQLite file, or with ``folder`` a file store's folder) can be made or written: it is there and of
    its kind (returned), or the nearest folder above it that is there can be written (None)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        if os.path.isdir(path) != folder:
            refuse(f"{shown!r} is {'a file, not a folder' if folder else 'a folder, not a SQLite file'}")
        return path
    at = os.path.dirname(path)
    while not os.path.exists(at) and at != os.path.dirname(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        refuse(f"{shown!r} is below {at}, a file")
    if not os.access(at, os.W_OK | os.X_OK):
        refuse(f"{shown!r} cannot be made: its folder {at} is not writable")
    return None


def _check_sqlite(path: str, refuse, shown: str) -> None:
    """A SQLite tracking file: a folder or below a file is refused, and one that is there must be a SQLite database
    this process can write (a write transaction begun and rolled back: nothing changes)."""
    import sqlite3

    if (found := _check_writable(path, refuse, shown, folder=False)) is None:
        return
    try:
        con = sqlite3.connect(f"file:{found}?mode=rw", uri=True, timeout=5.0)
    except sqlite3.Error as e:
        refuse(f"{shown!r} cannot be opened for writing ({e})")
    try:
        con.execute("PRAGMA schema_version").fetchone()  # reads the header: a file that is no database says so
        con.execute("BEGIN IMMEDIATE")  # takes the write lock, as MLflow's first write would
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" not in str(e) and "busy" not in str(e):  # another writer now (an MLflow server): it is writable
            refuse(f"{shown!r} cannot be written ({e})")
    except sqlite3.DatabaseError as e:
        refuse(f"{shown!r} is not a SQLite database ({e})")
    finally:
        con.close()


def _check_server(uri: str, refuse, shown: str) -> None:
    """An MLflow tracking server answers its REST API (a lookup of an experiment by name: JSON, found or not); any
    other answer is another server. An answer that asks for credentials (401, 403) cannot be told apart: passed."""
    import httpx

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name"
    try:
        r = httpx.get(url, params={"experiment_name": "bcdflow"}, timeout=5.0)
    except httpx.TransportError as e:
        refuse(f"the MLflow tracking server {shown} does not answer ({type(e).__name__}): start it")
    except httpx.HTTPError as e:  # an address httpx cannot ask (a malformed host or port)
        refuse(f"{shown!r} is not an address a tracking server answers on ({type(e).__name__})")
    if r.status_code in (401, 403):
        return
    try:
        body = r.json()
        ok = isinstance(body, dict) and ("experiment" in body or "error_code" in body)
    except ValueError:
        ok = False
    if not ok:
        kind = r.headers.get("content-type", "").split(";")[0] or "no content type"
        refuse(f"{shown} answers, but not as an MLflow tracking server (its REST API answered HTTP {r.status_code}, "
               f"{kind})")


@dataclass(frozen=True)
class TrackTarget:
    """Where a visit logs its training curve: MLflow runs (the visit's own and its parent's) on one tracking
    server, at global steps ``step_offset + local step``. A task takes one of these (or None: untracked)
    instead of a URI, an experiment, run ids and an offset."""
    uri: str
    experiment: str
    run_ids: tuple[str, ...]
    step_offset: int = 0
    _tracker: list = field(default_factory=list, repr=False, compare=False)

    @property
    def tracker(self) -> Tracker:
        if not self._tracker:
            self._tracker.append(Tracker(self.uri, self.experiment))
        return self._tracker[0]

    def series(self, key: str, points: list[tuple[int, float]]) -> None:
        """(local step, value) points to every target run."""
        pts = [(self.step_offset + s, v) for s, v in points]
        for rid in self.run_ids:
            self.tracker.metric_series(rid, {key: pts})
