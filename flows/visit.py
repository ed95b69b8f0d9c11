"""One BCD visit as its own flow run (DESIGN §2; paper Algorithm 1, lines 5-9): block ``block`` of version
``version`` trained to local convergence while every other block is frozen.

    sample -> pre-infer shards (paper §3.2.2) -> train block -> evaluate -> commit -> drop working objects

Everything else a visit needs (the global step so far, the spend so far, the parent's MLflow run) is read
from the run's state.json, so a visit can be started from its ids alone, in-process or as a deployment run.
"""
from __future__ import annotations

import time

from prefect import flow, get_run_logger, unmapped
from prefect.runtime import flow_run

from core import spend
from core.config import RunConfig
from storage import runs
from storage.runs import RunStateError, VisitRecord
from tasks.preinfer import plan_shards, preinfer_shard
from tasks.run import commit_visit
from tasks.train import evaluate, train_block
from tracking.tracker import TrackTarget, Tracker


# per-visit figures logged on the parent run as series over versions (step = version)
VISIT_SERIES = ("steps", "seconds", "preinfer_seconds", "train_seconds", "eval_seconds", "tokens_per_s", "gpu_hours",
                "spend_usd")
# a visit run's single values (its summary): tags bcdflow.<name>
VISIT_SUMMARY = ("version", "steps", "stopped_by", "train_loss", "val_loss", "val_ppl", "tokens_per_s", "seconds",
                 "preinfer_seconds", "train_seconds", "eval_seconds", "gpu_hours", "spend_usd", "cum_spend_usd",
                 *(f"spend_{s}_usd" for s in spend.STAGES))


def prefect_tags() -> dict:
    """MLflow tags pointing back at the Prefect flow run that does the work."""
    tags = {"prefect.flow_run_id": flow_run.get_id(), "prefect.flow_run_name": flow_run.get_name(),
            "prefect.flow_run_url": flow_run.get_flow_run_ui_url()}
    return {k: v for k, v in tags.items() if v}


@flow(name="bcd-visit", flow_run_name="c{cycle}-b{block}")
def visit(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str) -> VisitRecord:
    """One (cycle, block) visit on version ``version``; returns the committed visit record."""
    log = get_run_logger()
    store = cfg.open_store()
    state = runs.read_state(store, run_id)
    if state is None or state.version != version:
        raise RunStateError(f"visit c{cycle}-b{block} of run {run_id!r} was planned on version {version}, but the "
                            f"run is at version {state.version if state else 'none'}")
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    vkey = runs.visit_key(run_id, cycle, block)
    # an interrupted visit continues its MLflow run instead of opening a second one
    known = store.read_json(vkey, "mlflow.json")["run_id"] if store.exists(vkey, "mlflow.json") else None
    mlrun = tracker.start(f"c{cycle}-b{block}", params={"cycle": cycle, "block": block, "base_version": version},
                          tags={**prefect_tags(), "bcdflow.run_id": run_id}, parent=state.mlflow_run_id,
                          resume_id=known)
    if mlrun and not known:
        store.write_json({"run_id": mlrun}, vkey, "mlflow.json")
    track_runs = tuple(r for r in (mlrun, state.mlflow_run_id) if r)
    track = TrackTarget(tracker.uri, cfg.experiment, track_runs, state.steps) if track_runs else None

    t0 = time.perf_counter()
    preinfer_s = 0.0
    if cfg.bcd.preinfer and block > 0:  # paper §3.2.2
        shards = plan_shards(cfg, run_id, cycle, block, dataset_id)
        preinfer_shard.map(cfg=unmapped(cfg), run_id=run_id, cycle=cycle, block=block, version=version,
                           dataset_id=dataset_id, shard=shards).result()
        preinfer_s = time.perf_counter() - t0
    tr = train_block(cfg, run_id, cycle, block, version, dataset_id, track=track)
    ev = evaluate(cfg, run_id, version, dataset_id, {block: tr.block_file})
    seconds = time.perf_counter() - t0
    cost = spend.visit_spend(cfg.spend, {"preinfer": preinfer_s, "train": tr.seconds, "eval": ev.seconds}, seconds)
    record = VisitRecord(
        cycle=cycle, block=block, version=version + 1, steps=tr.steps, step_end=state.steps + tr.steps,
        resumed_at=tr.resumed_at, stopped_by=tr.stopped_by, rows=tr.rows, tokens=tr.tokens,
        first_loss=tr.first_loss, train_loss=tr.train_loss, val_loss=ev.val_loss, val_ppl=ev.val_ppl,
        val_points=[(state.steps + s, v) for s, v in tr.val_points], tokens_per_s=tr.tokens / max(tr.seconds, 1e-9),
        peak_mem_bytes=tr.peak_mem_bytes, preinfer_seconds=preinfer_s, train_seconds=tr.seconds,
        eval_seconds=ev.seconds, seconds=seconds, **cost, cum_spend_usd=state.spend_usd + cost["spend_usd"])
    commit_visit(cfg, run_id, record, tr.block_file)
    store.rm(vkey)  # activations and mid-visit checkpoints are dead once committed
    # curves: the validation loss at the global step, on the visit's run and the parent's; per-visit figures as
    # series over versions on the parent; the visit's own single values as its run summary
    curve = {"val_loss": record.val_loss, "val_ppl": record.val_ppl}
    tracker.metrics(mlrun, curve, record.step_end)
    tracker.metrics(state.mlflow_run_id, {**curve, "cum_spend_usd": record.cum_spend_usd}, record.step_end)
    tracker.metrics(state.mlflow_run_id, {f"visit/{k}": getattr(record, k) for k in VISIT_SERIES}, record.version)
    tracker.summary(mlrun, record.model_dump(include=set(VISIT_SUMMARY)),
                    f"Visit c{cycle}-b{block} of run `{run_id}` committed version {record.version}: {record.steps} "
                    f"steps ({record.stopped_by}), train loss {record.train_loss:.4f}, val loss {record.val_loss:.4f}, "
                    f"{record.seconds:.1f} s, ${record.spend_usd:.4f}.")
    tracker.end(mlrun)
    log.info("visit c%d-b%d: %d steps (%s), train %.4f, val %.4f, %.1fs, $%.4f", cycle, block, record.steps,
             record.stopped_by, record.train_loss, record.val_loss, record.seconds, record.spend_usd)
    return record


def visit_with_workers(cfg: RunConfig):
    """The visit flow with a task runner sized for pre-inference on this device."""
    import torch
    from prefect.task_runners import ThreadPoolTaskRunner

    n = cfg.bcd.preinfer_workers or (2 if cfg.train.device != "cpu" and torch.cuda.is_available() else 1)
    return visit.with_options(task_runner=ThreadPoolTaskRunner(max_workers=n))
