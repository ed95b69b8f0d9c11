"""``bcdflow status RUN`` and ``bcdflow runs``: what a store says about its runs (storage/overview.py), read without
running anything and without importing Prefect or torch.

    bcdflow status my-run [--json]     # its visits, and what it is doing now: running (whose lease), interrupted, done
    bcdflow runs [--store URL]         # every run of a store, most recently changed first
"""
from __future__ import annotations

import contextlib
import os

from bcdflow.core.spend import DEFAULT_KIND, priced_as
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.flows.store_admin import cli_store
from bcdflow.tracking.tables import strict_json


def existing_state(store, run_id: str):
    """The run's current state; bad input naming the store when it has no such run."""
    from bcdflow.storage import runs

    state = runs.read_state(store, run_id)
    if state is None:
        raise BadInput(f"run {run_id!r} not found in store {store.url}")
    return state


def stored_version(store, run_id: str, version: int | None):
    """(state, version): the run's state and ``version`` (None = its last) checked to exist and not be pruned, as
    ``bcdflow export`` and ``generate`` read it; bad input naming the run or ``--version`` otherwise."""
    from bcdflow.storage.prune import check_not_pruned

    state = existing_state(store, run_id)
    version = state.version if version is None else version
    if not 0 <= version <= state.version:
        raise BadInput(f"--version: run {run_id!r} has versions 0..{state.version}, got {version}")
    check_not_pruned(store, run_id, version)
    return state, version


def stored_run(store, run_id: str):
    """(record, settings): run ``run_id``'s config.json as stored (its plan, dataset, mode) and the settings it was
    trained with, read through ``RunConfig`` (core/config.stored_config: the defaults are its fields')."""
    from bcdflow.core.config import stored_config
    from bcdflow.storage import layout, runs

    record = runs.read_config(store, run_id)
    return record, stored_config(record, store.url_of(layout.config_key(run_id)), store.url)


def run_overview(store, run_id: str, record: dict | None = None, cfg=None) -> dict:
    """One run's row (storage/overview.overview) with what its settings say: the visits planned (``bcd.cycles`` of
    its blocks), a visit's step cap; a run without a config.json yet has none."""
    from bcdflow.storage import layout, overview

    if record is None and store.exists(layout.config_key(run_id)):
        record, cfg = stored_run(store, run_id)
    if cfg is None:
        return {**overview.overview(store, run_id), "mlflow_url": None}
    plan = record.get("plan") or {}  # the visits of a cycle: the stored blocks and any row blocks (bcd.vocab_blocks)
    per_cycle = len(plan.get("blocks") or ()) + len(plan.get("rows") or ()) or cfg.n_blocks
    row = overview.overview(store, run_id, cfg.bcd.cycles * per_cycle, cfg.bcd.max_steps, record.get("mode"))
    return {**row, "mlflow_url": mlflow_url(cfg, row["mlflow_run_id"])}


def mlflow_url(cfg, mlflow_run_id: str | None) -> str | None:
    """The run's page in MLflow's model-training view (tracking/tracker.run_link: MLflow 3 opens its GenAI view
    otherwise), None without an MLflow run. Read without MLflow and without a request: a SQLite backend's
    experiment from its file, read-only; a server's run by MLflow's direct route."""
    from bcdflow.tracking.tracker import run_link

    uri = cfg.resolved_tracking_uri()
    if not mlflow_run_id or not uri or uri.lower() == "none":
        return None
    try:
        return run_link(uri, _experiment_of(uri, mlflow_run_id), mlflow_run_id)
    except LookupError:  # its SQLite backend is gone or never had the run (another machine's, a moved store)
        return None


def _experiment_of(uri: str, mlflow_run_id: str) -> str | None:
    """The experiment of an MLflow run in a SQLite backend (``runs.experiment_id``), None where it cannot say.
    A SQLite file without the run (or no file) has no page to link: :class:`LookupError`."""
    import sqlite3
    from pathlib import Path

    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///")
    if not os.path.isfile(path):
        raise LookupError(path)
    try:
        with contextlib.closing(sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro", uri=True,
                                                timeout=1)) as db:
            row = db.execute("SELECT experiment_id FROM runs WHERE run_uuid = ?", (mlflow_run_id,)).fetchone()
    except sqlite3.Error:  # another schema, a locked or damaged file: the direct route still finds the run
        return None
    if row is None:
        raise LookupError(mlflow_run_id)
    return str(row[0])


def overviews(store) -> list[dict]:
    """Every run of the store, most recently changed first. A local store that does not exist is bad input (a
    mistyped --store), not an empty list. A damaged run is listed too, beside the others, as ``damaged`` with what
    is wrong (``damage``: the line ``bcdflow status`` would exit with); it never hides the good runs."""
    from bcdflow.storage import layout, runs

    if store.is_local and not store.fs.exists(store.root):
        raise BadInput(f"store {store.url} does not exist (check --store)")
    rows = []
    for r in runs.list_runs(store):
        try:
            rows.append({**run_overview(store, r), "damage": None})
        except DamagedArtifact as e:
            rows.append({"run_id": r, "mode": None, "status": "damaged", "stop_reason": None, "version": None,
                         "visits_done": None, "visits_planned": None, "val_loss": None, "spend_usd": None,
                         "changed": store.modified(layout.state_key(r)) or store.modified(layout.config_key(r)),
                         "lease_owner": None, "training": None, "mlflow_run_id": None, "mlflow_url": None,
                         "damage": str(e)})
    return sorted(rows, key=lambda o: o["changed"] or 0, reverse=True)


def status_dict(store, run_id: str) -> dict:
    """The run's committed visits, and (``live``) what it is doing now: running (its lease's owner, the visit in
    training and its last checkpoint's step), interrupted or done (storage/overview.py)."""
    state = existing_state(store, run_id)
    record, cfg = stored_run(store, run_id)
    keep = {"cycle", "block", "version", "steps", "train_loss", "val_loss", "val_ppl", "seconds",
            "preinfer_seconds", "train_seconds", "lost_seconds", "tokens_per_s", "stopped_by", "spend_usd"}
    live = run_overview(store, run_id, record, cfg)
    if live.get("training"):
        live["training"]["acts_planned"] = planned_acts(store, record, cfg, live["training"]["block"])
    gpus, kind = priced_as(cfg)
    return {"run_id": run_id, "version": state.version, "status": state.status, "mode": state.mode,
            "blocks": (record.get("plan") or {}).get("blocks") or [],
            "visits": [v.model_dump(include=keep) for v in state.visits],
            "priced_as": f"{gpus}×{kind}", "default_price_kind": kind == DEFAULT_KIND,
            "mlflow_url": live["mlflow_url"], "mlflow_ui": mlflow_ui_command(cfg) if live["mlflow_url"] else None,
            "live": {k: live[k] for k in ("status", "visits_done", "visits_planned", "spend_usd", "changed",
                                          "lease_owner", "training")}}


def mlflow_ui_command(cfg) -> str | None:
    """What serves a file/SQLite backend's UI (a tracking server serves its own: None)."""
    uri = cfg.resolved_tracking_uri()
    return None if uri.startswith(("http://", "https://")) else f"mlflow ui --backend-store-uri {uri}"


def planned_acts(store, record: dict, cfg, block: int) -> int | None:
    """The activation bytes ``bcdflow plan`` says a visit of ``block`` writes (core/forecast: the visit's rows in the
    group layout storage/activations gives them), 0 for a visit that does not pre-infer, None where the stored run
    does not say (no dataset or model recorded)."""
    from bcdflow.core.rules import visit_row_count
    from bcdflow.storage import layout
    from bcdflow.storage.act_layout import group_layout

    d_model = (record.get("model_resolved") or {}).get("d_model")
    plan = record.get("plan") or {}
    blocks = (plan.get("blocks") or []) + (plan.get("rows") or [])  # a row block's index follows the layer blocks
    try:
        lo = int(blocks[block]["layers"][0])
    except (IndexError, KeyError, TypeError, ValueError):  # a record without the plan's layers
        lo = None
    meta_key = layout.dataset_key(record["dataset"], layout.DATASET_META) if record.get("dataset") else None
    if not d_model or lo is None or meta_key is None or not store.exists(meta_key):
        return None
    if cfg.bcd.preinfer is False or lo == 0:
        return 0
    n = visit_row_count(cfg, store.read_json(meta_key)["n_train"])
    return group_layout(n, cfg.data.seq_len, d_model, cfg.bcd.shard_rows, cfg.bcd.act_dtype).array_bytes


def status_table(st: dict) -> str:
    from bcdflow.storage.overview import ago, owner_text

    live = st.get("live") or {}
    lines = [f"run {st['run_id']}: version {st['version']} ({live.get('status', st['status'])}, {st['mode']})"]
    if live.get("status") == "running":
        lines.append(f"  lease: {owner_text(live['lease_owner'])}")
    if tr := live.get("training"):
        where = "not checkpointed yet" if tr["step"] is None else \
            f"step {tr['step']}/{tr['max_steps']} at its last checkpoint ({ago(tr['checkpoint_at'])})"
        doing = "training" if tr["lease_owner"] else "interrupted in"
        lines.append(f"  {doing} visit {tr['visit']}: {where}")
        if tr.get("acts_bytes") or tr.get("acts_planned"):
            plan = f" of {tr['acts_planned'] / 1e9:.3f} GB planned" if tr.get("acts_planned") is not None else ""
            lines.append(f"  activations in the store: {tr['acts_bytes'] / 1e9:.3f} GB{plan} (removed at its commit)")
    if live.get("status") == "interrupted":
        lines.append(f"  no process holds the run: continue it with bcdflow resume {st['run_id']}")
    note = " (the default price kind: set spend.train_device to the GPU you rent)" if st["default_price_kind"] else ""
    lines.append(f"  spend ${live.get('spend_usd', 0.0):.4f}, priced as {st['priced_as']}{note}")
    if st.get("mlflow_url"):
        serve = f" (served by {st['mlflow_ui']})" if st.get("mlflow_ui") else ""
        lines.append(f"  MLflow: {st['mlflow_url']}{serve}")
    # why each visit stopped: its step cap, a plateau, the adaptive budget (the visits table's legend says it in words)
    lines.append(f"{'cycle':>5} {'block':>5} {'ver':>4} {'steps':>6} {'stopped by':<11} {'train':>8} {'val':>8} "
                 f"{'secs':>7} {'lost s':>7} {'spend $':>9}")
    for v in st["visits"]:
        lines.append(f"{v['cycle']:>5} {v['block']:>5} {v['version']:>4} {v['steps']:>6} {v['stopped_by']:<11} "
                     f"{v['train_loss']:>8.4f} {v['val_loss']:>8.4f} {v['seconds']:>7.1f} {v['lost_seconds']:>7.1f} "
                     f"{v['spend_usd']:>9.4f}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    st = status_dict(cli_store(args.store, args, write=False), args.run_id)
    print(strict_json(st) if args.json else status_table(st))
    return 0


def runs_table(rows: list[dict]) -> str:
    from bcdflow.storage.overview import ago

    head = f"{'run':<24} {'mode':<4} {'status':<16} {'ver':>4} {'visits':>7} {'val loss':>9} {'spend $':>9}  changed"
    lines = [head]
    for o in rows:
        if o.get("damage"):
            lines.append(f"{o['run_id']:<24} {'–':<4} {'damaged (below)':<16} {'–':>4} {'–':>7} {'–':>9} {'–':>9}  "
                         f"{ago(o['changed'])}")
            continue
        status = o["status"] + (f" ({o['training']['visit']})" if o["status"] == "running" and o["training"] else "")
        visits = f"{o['visits_done']}/{o['visits_planned'] or '?'}"
        val = "–" if o["val_loss"] is None else f"{o['val_loss']:.4f}"
        lines.append(f"{o['run_id']:<24} {o['mode']:<4} {status:<16} {o['version']:>4} {visits:>7} {val:>9} "
                     f"{o['spend_usd']:>9.4f}  {ago(o['changed'])}")
    lines += [f"{o['run_id']}: damaged: {o['damage']}" for o in rows if o.get("damage")]
    links = [o for o in rows if o.get("mlflow_url")]
    if links:  # MLflow 3 opens its GenAI view unless the link says the training view: these do
        lines += ["", "in MLflow (the model-training view; `bcdflow status RUN` says what serves it):"]
        lines += [f"  {o['run_id']:<24} {o['mlflow_url']}" for o in links]
    return "\n".join(lines)


def cmd_runs(args) -> int:
    """Every run of the store: mode, status (done / running / interrupted), version, visits done of planned, last
    validation loss, spend and when it last changed."""
    store = cli_store(args.store, args, write=False)
    rows = overviews(store)
    if args.json:
        print(strict_json(rows))
    else:
        print(runs_table(rows) if rows else f"no runs in store {store.url}")
    return 0
