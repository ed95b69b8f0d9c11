"""One BCD visit as its own flow run (docs/DESIGN.md §2; paper Algorithm 1, lines 5-9): block ``block`` of version
``base_version`` trained to local convergence while every other block is frozen; it commits version
``base_version + 1``.

    lease -> pre-infer shards (paper §3.2.2) -> train block -> evaluate -> commit -> drop working objects

The same flow runs in-process (a subflow of ``bcd_train``) or as a run of the ``bcd-visit`` deployment on a GPU
work pool, picked up by any worker (docs/DESIGN.md §6): its parameters are ids and the run config, and everything
else a visit needs (the global step so far, the spend so far, the parent's MLflow run) is read from the run's
state.json, the store being all that workers share. A visit holds a lease of its own, so two workers handed the
same visit never train it at once; one that finds its visit committed already returns that record. What a
failed visit leaves for its dispatcher is ``outcome.json``: bad input and damaged artifacts are final, anything
else (a crash, a lost machine) is worth another try from the mid-visit checkpoint. Its flow run is named
``{run}/c{cycle}-b{block}`` (``visit_run_name``), so a list of several runs' visits reads.
"""
from __future__ import annotations

import dataclasses
import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from bcdflow.core import spend
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, open_act_store, open_store, resolve_device
from bcdflow.core.rules import visit_spec
from bcdflow.models.trainer import FINAL_LOSS_STEPS, stop_words
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.flows import artifacts
from bcdflow.storage import checkpoints, layout, overview, runs
from bcdflow.storage.lease import Lease, LeaseHeld, LeaseLost, this_process
from bcdflow.storage.runs import RunStateError, VisitRecord
from bcdflow.tasks.preinfer import plan_shards, preinfer_shard
from bcdflow.tasks.engine import EvalResult
from bcdflow.tasks.progress import Progress, preinfer_usd_per_s, visit_progress
from bcdflow.tasks.run import commit_visit
from bcdflow.tasks.train import evaluate_version, train_block
from bcdflow.tracking.describe import run_params, training_dataset
from bcdflow.tracking.tracker import TrackTarget, Tracker

# per-visit figures logged on the parent run as series over the run's global step (the visit's last step), named
# visit_<figure>: a "visit/" prefix made them a chart section of their own, which MLflow's UI shows above the losses
VISIT_SERIES = ("steps", "seconds", "preinfer_seconds", "train_seconds", "eval_seconds", "tokens_per_s", "gpu_hours",
                "spend_usd")
# a visit run's single values (its summary): tags bcdflow.<name>; its record's train_loss (the mean of its last steps)
# is tagged by what it is, apart from the train_loss metric (every step's loss, whose last point is one step's)
VISIT_SUMMARY = ("version", "steps", "stopped_by", "val_loss", "val_ppl", "tokens_per_s", "seconds",
                 "preinfer_seconds", "train_seconds", "eval_seconds", "gpu_hours", "spend_usd", "cum_spend_usd",
                 *(f"spend_{s}_usd" for s in spend.STAGES))
FINAL_TRAIN_LOSS = f"train_loss_last{FINAL_LOSS_STEPS}_mean"


def prefect_tags() -> dict:
    """MLflow tags pointing back at the Prefect flow run that does the work (``prefect.flow_run_url`` where the
    Prefect UI's address is known; else :func:`prefect_note` says so in the run's description)."""
    url = flow_run.get_flow_run_ui_url() or ""  # "None/flow-runs/..." where no UI is configured (the CLI's server)
    tags = {"prefect.flow_run_id": flow_run.get_id(), "prefect.flow_run_name": flow_run.get_name(),
            "prefect.flow_run_url": url if url.startswith(("http://", "https://")) else None}
    return {k: v for k, v in tags.items() if v}


def prefect_note() -> str:
    """A line for an MLflow run's description when its flow run has no lasting address (Prefect's temporary server,
    which the CLI starts when no ``PREFECT_API_URL`` is set, ends with the command): where to find it; "" when the
    ``prefect.flow_run_url`` tag links it."""
    fr = flow_run.get_id()
    if not fr or "prefect.flow_run_url" in prefect_tags():
        return ""
    return (f"\n\nPrefect: flow run `{flow_run.get_name()}` ({fr}) ran on Prefect's temporary server, which has no "
            "lasting address (no PREFECT_API_URL was set), so there is no `prefect.flow_run_url` tag: with the same "
            f"PREFECT_HOME, `prefect server start` shows it at http://127.0.0.1:4200/runs/flow-run/{fr}")


def short_run_id(run_id: str, width: int = 24) -> str:
    """A run id cut for a name in a list: as it is up to ``width`` characters (a generated id, bcd-20250101-120000-1a2b,
    is 24), else its start and its end around an ellipsis."""
    return run_id if len(run_id) <= width else f"{run_id[:width - 9]}…{run_id[-8:]}"


def visit_run_name(run_id: str, cycle: int, block: int) -> str:
    """A visit's flow run name: ``{run}/c{cycle}-b{block}``, so the visits of several runs tell apart in a list."""
    return f"{short_run_id(run_id)}/c{cycle}-b{block}"


def _visit_run_name() -> str:
    p = flow_run.get_parameters()
    return visit_run_name(p["run_id"], p["cycle"], p["block"])


def visit_lease(cfg: RunConfig, store, run_id: str, cycle: int, block: int) -> Lease:
    return Lease(store, layout.visit_key(run_id, cycle, block), f"visit c{cycle}-b{block} of run {run_id!r}",
                 ttl=cfg.fleet.lease_seconds, owner=this_process(flow_run.get_id(), flow_run.get_run_count()))


def committed(state, cycle: int, block: int) -> VisitRecord | None:
    return next((v for v in state.visits if (v.cycle, v.block) == (cycle, block)), None)


@flow(name="bcd-visit", flow_run_name=_visit_run_name)
def visit(run_id: str, cycle: int, block: int, base_version: int, dataset_id: str,
          config: RunConfig = RunConfig(), run_epoch: int | None = None) -> VisitRecord:
    """One (cycle, block) visit of a BCD run on version ``base_version``; returns the committed visit record (of
    version ``base_version + 1``).

    Args:
        run_id: The bcdflow run.
        cycle: The cycle of the visit.
        block: The block it trains.
        base_version: The version it starts from (the run's last committed version when it was planned); it commits
            the next one.
        dataset_id: The run's token dataset.
        config: The run's settings, as its parent flow validated them (a dispatched visit's run validates the
            same object again from its JSON).
        run_epoch: The epoch of the run lease its parent holds: the visit commits only while no later process
            has taken the run over (docs/DESIGN.md I7).
    """
    cfg = config
    store = open_store(cfg)
    lease = visit_lease(cfg, store, run_id, cycle, block)
    try:
        with lease.held():
            record = _visit(cfg, store, lease, run_id, cycle, block, base_version, dataset_id, run_epoch)
        store.rm(layout.visit_key(run_id, cycle, block))  # activations, checkpoints, lease: dead once committed
        if cfg.bcd.act_store:  # the activations' own store
            open_act_store(cfg).rm(layout.acts_key(run_id, cycle, block))
        return record
    except LeaseLost:  # another process holds the visit or the run now: this one writes nothing more (I7)
        raise
    except (BadInput, DamagedArtifact) as e:  # final: the dispatcher must not resubmit it (LeaseHeld: the visit is busy)
        kind = "busy" if isinstance(e, LeaseHeld) else "bad_input" if isinstance(e, BadInput) else "damaged"
        store.write_json({"kind": kind, "message": str(e), "flow_run_id": flow_run.get_id()},
                         layout.outcome_key(run_id, cycle, block))
        raise


def _visit(cfg: RunConfig, store, lease: Lease, run_id: str, cycle: int, block: int, version: int,
           dataset_id: str, run_epoch: int | None = None) -> VisitRecord:
    log = get_run_logger()
    state = runs.read_state(store, run_id)
    if state is not None and (done := committed(state, cycle, block)):
        log.info("visit c%d-b%d of run %s is committed already (version %d)", cycle, block, run_id, done.version)
        return done
    if state is None or state.version != version:
        raise RunStateError(f"visit c{cycle}-b{block} of run {run_id!r} was planned on version {version}, but the "
                            f"run is at version {state.version if state else 'none'}")
    fence = {f"visit c{cycle}-b{block}": lease.epoch, **({"run": run_epoch} if run_epoch is not None else {})}
    state = runs.fence(store, run_id, fence)  # from here no earlier holder of this visit can commit it (I7)
    if state.version != version:
        raise RunStateError(f"visit c{cycle}-b{block} of run {run_id!r} was planned on version {version}, but the "
                            f"run is at version {state.version}")
    checkpoints.drop_uncommitted(store, run_id, version)  # a dead earlier attempt's half-commit (fenced out above)
    artifacts.crash_previous(overview.previous_owner(store, layout.visit_key(run_id, cycle, block), lease.epoch),
                             f"visit c{cycle}-b{block} of {run_id!r}")
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    store.rm(layout.outcome_key(run_id, cycle, block))
    # an interrupted visit continues its MLflow run instead of opening a second one
    mlkey = layout.mlflow_key(run_id, cycle, block)
    known = (store.read_json(mlkey) if store.exists(mlkey) else {}).get("run_id")
    mlrun = tracker.start(f"c{cycle}-b{block}", params={"cycle": cycle, "block": block, "base_version": version},
                          tags={**prefect_tags(), "bcdflow.run_id": run_id,
                                "mlflow.note.content": f"Visit c{cycle}-b{block} of run `{run_id}`: training block "
                                                       f"{block} from version {version}.{prefect_note()}"},
                          parent=state.mlflow_run_id, resume_id=known if isinstance(known, str) else None)
    if mlrun and mlrun != known:  # a new run (or a new one continuing a run this tracking backend lacks)
        store.write_json({"run_id": mlrun}, mlkey)
    track_runs = tuple(r for r in (mlrun, state.mlflow_run_id) if r)
    track = TrackTarget(tracker.uri, cfg.experiment, track_runs, state.steps) if track_runs else None

    ctx = RunContext.of(cfg, run_id, dataset_id)  # handed to every task of the visit
    # the flow run's parameters are the config as stored (unset keys null, what a dispatched visit runs); what the
    # visit resolved them to, as MLflow's parameters show, is its settings artifact
    artifacts.publish_settings(run_id, cycle, block, run_params(cfg, state.mode, ctx.model_cfg, ctx.plan))
    if mlrun and not known:  # what it trains on (rows sampled from it: bcd.sample_rate)
        tracker.dataset(mlrun, **training_dataset(cfg.data, ctx.dataset))
    # what this visit's earlier attempts spent (an interrupted visit is billed for them: core/spend.py)
    earlier = spend.earlier_attempts(*overview.visit_spent(store, run_id, cycle, block, version, lease.epoch))
    before_usd = state.spend_usd + spend.earlier_usd(cfg.spend, earlier, spend.gpus_used(cfg))
    t0, since = time.perf_counter(), time.time()
    store.write_json({**dataclasses.asdict(earlier), "at": since}, layout.spent_key(run_id, cycle, block))
    preinfer_s = 0.0
    if ctx.from_acts(block):  # paper §3.2.2
        preinfer(ctx, cycle, block, version, before_usd)
        preinfer_s = time.perf_counter() - t0
    # the live line and the visit run's progress artifact while it trains (tasks/progress.py)
    spent = before_usd + preinfer_s * preinfer_usd_per_s(cfg)
    live = visit_progress(cfg, run_id, cycle, block, spend_before=spent, log=log, artifact=True)
    # what the committed state hands the visit: its global step, the budget's bar, the block's kept moments, the clock
    tr = train_block(ctx, visit_spec(cfg, state, cycle, block, earlier.clock(preinfer_s, since)), track=track,
                     progress=live)
    why = f"stopped by {tr.stopped_by}: {stop_words(tr.stopped_by, state.mode)}"  # a baseline's: train.steps
    live.finish(tr.steps, why)  # its artifact's last word: the visit's real end, not the last throttled update
    if tr.val_loss is None:  # the visit could not validate the new version itself: the whole model, from the store
        ev = evaluate_version(ctx, version, tr.files(block))
    else:
        ev = EvalResult.of(tr.val_loss, tr.eval_seconds)
    seconds = earlier.wall + time.perf_counter() - t0
    preinfer_s += earlier.preinfer
    cost = spend.visit_spend(cfg.spend, {"preinfer": preinfer_s, "train": tr.seconds, "eval": ev.seconds}, seconds,
                             spend.gpus_used(cfg))
    record = VisitRecord(
        cycle=cycle, block=block, version=version + 1, steps=tr.steps, step_end=state.steps + tr.steps,
        resumed_at=tr.resumed_at, stopped_by=tr.stopped_by, rows=tr.rows, tokens=tr.tokens,
        first_loss=tr.first_loss, train_loss=tr.train_loss, val_loss=ev.val_loss, val_ppl=ev.val_ppl, rate=tr.rate,
        moments=tr.moments_file, expanded=tr.suffix_norms,
        val_points=[(state.steps + s, v) for s, v in tr.val_points], tokens_per_s=tr.tokens / max(tr.seconds, 1e-9),
        peak_mem_bytes=tr.peak_mem_bytes, peak_reserved_bytes=tr.peak_reserved_bytes, preinfer_seconds=preinfer_s,
        preinfer_why=ctx.preinfer_why(block),
        train_seconds=tr.seconds, eval_seconds=ev.seconds, seconds=seconds, lost_seconds=earlier.lost, **cost,
        cum_spend_usd=state.spend_usd + cost["spend_usd"])
    lease.check()  # still ours: nobody took this visit over while it trained
    commit_visit(cfg, run_id, record, tr.files(block), fence)
    # curves at the run's global step: the validation loss on the visit's run (linked to the version it committed,
    # a logged model of the run pointing at the store: no weights copied) and the parent's; per-visit figures as
    # series on the parent; the visit's own single values as its run summary
    curve = {"val_loss": record.val_loss, "val_ppl": record.val_ppl}
    data = training_dataset(cfg.data, ctx.dataset)  # the val_loss is of its validation rows
    tracker.external_model(mlrun, model_name(run_id, record.version), version_tags(run_id, record),
                           version_params(run_id, record), curve, record.step_end, source_run_id=state.mlflow_run_id,
                           dataset=(data["name"], data["digest"]),
                           outputs_of=tuple(r for r in (mlrun, state.mlflow_run_id) if r))
    tracker.metrics(state.mlflow_run_id, {**curve, "cum_spend_usd": record.cum_spend_usd}, record.step_end)
    tracker.metrics(state.mlflow_run_id, {f"visit_{k}": getattr(record, k) for k in VISIT_SERIES}, record.step_end)
    tracker.summary(mlrun, {**record.model_dump(include=set(VISIT_SUMMARY)), FINAL_TRAIN_LOSS: record.train_loss},
                    f"Visit c{cycle}-b{block} of run `{run_id}` committed version {record.version} (from version "
                    f"{version}): {record.steps} steps, {why}. Train loss {record.train_loss:.4f} (the mean of its last "
                    f"{min(FINAL_LOSS_STEPS, record.steps)} steps; the train_loss chart is every step's), val loss "
                    f"{record.val_loss:.4f}, {record.seconds:.1f} s, ${record.spend_usd:.4f}.{prefect_note()}")
    tracker.end(mlrun)
    log.info("visit c%d-b%d: %d steps, %s; train %.4f (mean of the last %d steps), val %.4f, %.1fs, $%.4f", cycle,
             block, record.steps, why, record.train_loss, min(FINAL_LOSS_STEPS, record.steps), record.val_loss,
             record.seconds, record.spend_usd)
    return record


def model_name(run_id: str, version: int) -> str:
    """A committed version's MLflow model name, ``{run}-v{version}`` (MLflow refuses a ``.`` in one)."""
    return f"{run_id.replace('.', '_')}-v{version}"


def version_params(run_id: str, record: VisitRecord) -> dict:
    """A committed version's logged model's parameters: which run and version it is, where the store keeps it
    (``manifest``, a key in the run's store), and the visit that made it."""
    return {"run_id": run_id, "version": record.version, "manifest": layout.manifest_key(run_id, record.version),
            "block": record.block, "visit": f"c{record.cycle}-b{record.block}", "step": record.step_end}


def version_tags(run_id: str, record: VisitRecord) -> dict:
    """A committed version's logged model points at the store's version (``bcdflow.manifest``, a key in the run's
    store; tags to search by) and says how to get its weights; the weights stay in the store."""
    return {"bcdflow.run_id": run_id, "bcdflow.version": record.version,
            "bcdflow.manifest": layout.manifest_key(run_id, record.version),
            "mlflow.note.content": f"Version {record.version} of run `{run_id}` (block {record.block} trained in "
                                   f"visit c{record.cycle}-b{record.block}), kept in the run's store at "
                                   f"`{layout.manifest_key(run_id, record.version)}`: `bcdflow export {run_id} OUT "
                                   f"--version {record.version}` writes its weights."}


def shard_runner(cfg: RunConfig):
    """Where pre-inference shards run: threads of this process (1 on CPU, where torch already uses every core per
    shard; 2 on a GPU, so one shard's I/O overlaps the next one's compute), or a Dask cluster (``fleet.preinfer``)."""
    if cfg.fleet.preinfer == "dask":
        from prefect_dask import DaskTaskRunner

        if cfg.fleet.dask_address:
            return DaskTaskRunner(address=cfg.fleet.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": cfg.fleet.dask_workers, "threads_per_worker": 1,
                                              "processes": True, "resources": {"GPU": 1}})
    n = cfg.bcd.preinfer_workers or (2 if resolve_device(cfg.train.device).type == "cuda" else 1)
    return ThreadPoolTaskRunner(max_workers=n)


def preinfer(ctx: RunContext, cycle: int, block: int, version: int, spend_before: float = 0.0) -> None:
    """The visit's shards still to compute, each a task on the shard runner; complete ones are skipped (a
    shard whose Dask worker dies is run again elsewhere, and costs only that shard). Shards done of those are shown
    as the training steps are (tasks/progress.py)."""
    cfg = ctx.cfg
    shards = plan_shards(ctx, cycle, block)
    if not shards:
        return
    live = Progress(f"c{cycle}-b{block} pre-infer", len(shards), "shards", spend_before=spend_before,
                    usd_per_s=preinfer_usd_per_s(cfg), log=get_run_logger())
    runner = shard_runner(cfg)
    params = {"ctx": ctx, "cycle": cycle, "block": block, "version": version}  # a context pickles as its ids
    with runner:
        if cfg.fleet.preinfer == "dask":
            import dask

            with dask.annotate(resources={"GPU": 1}):  # one shard per GPU worker at a time
                futures = [runner.submit(preinfer_shard, {**params, "shard": s}) for s in shards]
        else:
            futures = [runner.submit(preinfer_shard, {**params, "shard": s}) for s in shards]
        with live:
            live.update(0)
            for i, f in enumerate(futures):
                f.result()
                live.update(i + 1)
