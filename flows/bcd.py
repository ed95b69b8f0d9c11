"""The BCD run as Prefect flows (docs/DESIGN.md §2; paper Algorithm 1).

``bcd_train`` (parent) prepares data, creates or resumes the run, and loops over cycles and blocks; each
visit is its own flow run (``flows/visit.py``). ``full_train`` is the full-parameter baseline: a one-block,
one-cycle run at sample rate 1 through the very same visit flow and step loop (invariant I3).

A run ends at the first global stop rule (``core/rules.stop_reason``): target validation loss, no validation
improvement over whole cycles, budget (docs/DESIGN.md §7) or all cycles done; the reason goes to state.json
(``stop_reason``) and the MLflow tag ``bcdflow.stop_reason``. As deployments both flows take one flat parameter
model (``flows.params.RunParams``) so a deployment's run form in the Prefect UI is editable; the CLI runs the same
flows with its ``RunConfig`` (``bcd_train_config``, ``full_train_config``).
"""
from __future__ import annotations

import time

from prefect import flow, get_run_logger, tags
from prefect.runtime import flow_run

from bcdflow.core import spend
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, open_act_store, open_store, preflight
from bcdflow.core.rules import blocks_to_visit, end_reason, stop_reason, stop_words
from bcdflow.flows import artifacts
from bcdflow.flows.params import RunParams, new_run_id
from bcdflow.flows.fleet import dispatch_visit
from bcdflow.flows.visit import prefect_note, prefect_tags, visit
from bcdflow.storage import checkpoints, layout, overview, runs
from bcdflow.storage.lease import Lease, this_process
from bcdflow.storage.layout import check_run_id
from bcdflow.storage.runs import RunState
from bcdflow.tasks.data import prepare_data
from bcdflow.tasks.report import report_run
from bcdflow.tasks.run import init_run, note_state
from bcdflow.tasks.train import choose_block
from bcdflow.tracking.describe import run_params, training_dataset
from bcdflow.tracking.tracker import Tracker, check_reachable


def run_bcd(cfg: RunConfig, run_id: str, mode: str) -> dict:
    """The run, holding its lease throughout (docs/DESIGN.md I7): a second process on the same run id stops at once,
    naming this one; if this one dies, the lease expires and another may take the run over."""
    get_run_logger().info("bcdflow run %s (%s) on store %s", run_id, mode, cfg.store)
    check_run_id(run_id)
    preflight(cfg, in_flow=True)  # done already when the CLI started this flow; a deployment's run checks here
    check_reachable(cfg.resolved_tracking_uri())  # an MLflow server that does not answer: refused before any write
    store = open_store(cfg)
    dataset_id = prepare_data(cfg, store)  # shared and content-addressed: needs no lease (bad data: no run)
    lease = Lease(store, layout.run_key(run_id), f"run {run_id!r}", ttl=cfg.fleet.lease_seconds,
                  owner=this_process(flow_run.get_id()))
    with lease.held():
        try:
            return _run(cfg, store, lease, run_id, mode, dataset_id)
        except BaseException:
            _drop_if_unborn(store, run_id, lease)
            raise


def _drop_if_unborn(store, run_id: str, lease: Lease) -> None:
    """A run refused before its first state leaves nothing behind: not its lease, nor a version-0 file
    (docs/DESIGN.md §8). A run that exists keeps everything; a store fault here leaves the objects (the next start
    of the run reuses or replaces them) and the failure that brought us here is the one reported."""
    try:
        if runs.read_state(store, run_id) is None:
            lease.drop()
    except Exception:  # noqa: BLE001
        pass


def _run(cfg: RunConfig, store, lease: Lease, run_id: str, mode: str, dataset_id: str) -> dict:
    log = get_run_logger()
    init_run(cfg, run_id, dataset_id, mode)
    artifacts.crash_previous(overview.previous_owner(store, layout.run_key(run_id), lease.epoch), f"run {run_id!r}")
    run_fence = {"run": lease.epoch}
    # the takeover is complete once our epoch is in the state: no earlier holder can commit after this, so what
    # lies above the state's version now is a dead writer's half-commit, never a committed version (I7)
    state: RunState = runs.fence(store, run_id, run_fence)
    if state.status == "done":  # continued with more cycles or a larger budget: running until it stops again
        state = note_state(cfg, run_id, run_fence, status="running", stop_reason=None, stop_detail=None)
    if dropped := checkpoints.drop_uncommitted(store, run_id, state.version):
        log.warning("dropped manifests of versions %s: written by a commit that crashed before its state", dropped)
    if gone := runs.drop_committed_visits(store, state):  # a visit not yet committed keeps its folder (§2.6)
        if cfg.bcd.act_store:  # and their activations on the activations' own store
            act = open_act_store(cfg)
            for name in gone:
                act.rm(layout.visits_key(run_id), name)
        log.info("removed the working objects of committed visits %s: left by a process that ended between a "
                 "commit and its cleanup", ", ".join(gone))
    ctx = RunContext.of(cfg, run_id, dataset_id)
    n_visits = len(ctx.plan.visits)
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    parent = tracker.start(run_id, params=run_params(cfg, mode, ctx.model_cfg, ctx.plan) if tracker.enabled else None,
                           tags={**prefect_tags(), "bcdflow.run_id": run_id,
                                 "bcdflow.mode": mode, "bcdflow.dataset": dataset_id,
                                 "mlflow.note.content": f"Run `{run_id}` ({mode}): training; its visits are the "
                                                        f"child runs.{prefect_note()}"},
                           resume_id=state.mlflow_run_id, system_metrics=True)
    if parent and parent != state.mlflow_run_id:  # a new run, or one continuing a run this backend lacks
        state = note_state(cfg, run_id, run_fence, mlflow_run_id=parent)
        tracker.dataset(parent, **training_dataset(cfg.data, ctx.dataset))
    visits = list(state.visits)
    art = artifacts.RunArtifacts(run_id, store.url, cfg.bcd.cycles * n_visits, mode)
    art.link(tracker.run_url(parent), f"MLflow run of {run_id}")
    art.progress(len(visits))
    done = state.done_visits
    version, steps = state.version, state.steps
    t0 = time.perf_counter()
    stop = None
    try:
        for cycle in range(cfg.bcd.cycles):
            todo = blocks_to_visit(cfg, n_visits, cycle, done)
            while todo and not (stop := stop_reason(cfg, visits, n_visits)):
                b = (choose_block(RunContext.of(cfg, run_id, dataset_id), version, cycle, todo)
                     if cfg.bcd.order == "greedy" and len(todo) > 1 else todo[0])
                if stop := stop_reason(cfg, visits, n_visits, next_block=b):
                    break
                todo.remove(b)
                if cfg.fleet.visit_pool:  # a run of the bcd-visit deployment on the GPU pool
                    rec = dispatch_visit(cfg, run_id, cycle, b, version, dataset_id, lease.epoch)
                else:
                    with tags(f"run:{run_id}", f"cycle:{cycle}", f"block:{b}"):  # tell two runs' c0-b0 apart
                        rec = visit(run_id, cycle, b, version, dataset_id, cfg, run_epoch=lease.epoch)
                visits.append(rec)
                version, steps = rec.version, steps + rec.steps
                art.progress(len(visits))
                art.visits(visits)
                if not todo:  # cycle-level curve on the parent run, at the global step where the cycle ended
                    tracker.metrics(parent, {"cycle_val_loss": rec.val_loss,
                                             "cycle_cum_spend_usd": rec.cum_spend_usd}, rec.step_end)
            if stop:
                break
        stop = stop or end_reason(cfg, visits, n_visits, mode)
    except BaseException:
        tracker.end(parent, "FAILED")
        raise
    reason, detail = stop
    lease.check()
    note_state(cfg, run_id, run_fence, status="done", stop_reason=reason, stop_detail=detail)
    total_usd = spend.total_spend(visits)
    gpu_hours, wall = sum(v.gpu_hours for v in visits), time.perf_counter() - t0
    tracker.summary(parent, {"stop_reason": reason, "stop_detail": detail, "version": version, "total_steps": steps,
                             "wall_seconds": wall, "spend_usd": total_usd, "gpu_hours": gpu_hours,
                             "val_loss": visits[-1].val_loss if visits else None},
                    f"Run `{run_id}` ({mode}) stopped ({reason}): {stop_words(reason, mode)} ({detail}). "
                    f"Version {version} "
                    f"after {len(visits)} visits: {steps} steps, val loss "
                    f"{visits[-1].val_loss if visits else float('nan'):.4f}, ${total_usd:.4f}, {gpu_hours:.4f} GPU-h "
                    f"(this session {wall:.0f} s). Each visit is a child run; each committed version a logged model "
                    f"(Models), kept in the run's store.{prefect_note()}")
    if parent:
        try:
            report_run(cfg, run_id, parent, version)
        except Exception as e:  # the trained model is safe in the store (`bcdflow export`)
            log.warning("figures/model not logged to MLflow: %s: %s", type(e).__name__, e)
    tracker.end(parent)
    art.progress(len(visits), note=f"the run stopped ({reason}): {stop_words(reason, mode)} ({detail})", finished=True)
    art.visits(visits, stop_reason=reason)
    summary = {"run_id": run_id, "version": version, "steps": steps, "mlflow_run_id": parent,
               "val_loss": visits[-1].val_loss if visits else None, "spend_usd": total_usd,
               "stop_reason": reason}
    log.info("run %s done, stopped by %s: %s (%s); version %d, val loss %s, $%.4f", run_id, reason,
             stop_words(reason, mode), detail, version,
             "-" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}", total_usd)
    return summary


def _run_id(mode: str) -> str:
    """This flow run's bcdflow run id: its ``run_id`` parameter, or one made from the flow run's scheduled start
    and id, so the flow run's name (resolved first) and its body agree on it."""
    return flow_run.get_parameters().get("run_id") or new_run_id(mode, flow_run.get_scheduled_start_time(),
                                                                  flow_run.get_id())


@flow(name="bcd_train", flow_run_name=lambda: _run_id("bcd"))
def bcd_train(run_id: str | None = None, config: RunParams = RunParams()) -> dict:
    """Train with block coordinate descent (paper Algorithm 1).

    Args:
        run_id: The bcdflow run id (letters, digits, _ . -). The id of an existing run resumes it with the same
            settings; empty starts a new run, named like bcd-20250101-120000-1a2b (the flow run's name).
        config: The run's settings, one field per config key (section.key -> section_key); the same keys and
            defaults as `bcdflow train --set section.key=value`.
    """
    return run_bcd(config.to_config(), run_id or _run_id("bcd"), "bcd")


BASELINE_VAL_POINTS = 25


def baseline_eval_every(train) -> int:
    """How often the baseline validates: ``train.eval_every``, else ``train.steps`` / 25, so the step where its
    curve crosses L* is bracketed within 4% of the run (``bcdflow compare`` states that bracket)."""
    return train.eval_every or max(1, train.steps // BASELINE_VAL_POINTS)


def baseline_bcd(cfg: RunConfig) -> dict:
    """The ``bcd`` keys a baseline sets itself, whatever it was given: one block, one cycle, every row,
    ``train.steps`` steps (unless ``train.patience`` asks for the plateau rule), validating every
    ``baseline_eval_every`` steps (I3)."""
    return {"blocks": 1, "boundaries": None, "cycles": 1, "sample_rate": 1.0, "preinfer": False,
            "max_steps": cfg.train.steps, "eval_every": baseline_eval_every(cfg.train), "patience": cfg.train.patience,
            "budget": "fixed", "lr_scales": None, "moments": "reset", "expand": "off", "vocab_blocks": 1}


# their names: what a baseline's stored settings hold of its own, not of what it was given (flows/like.py)
BASELINE_BCD = tuple(baseline_bcd(RunConfig()))


def full_config(cfg: RunConfig) -> RunConfig:
    """The baseline as a BCD run: ``cfg`` with the ``bcd`` keys of :func:`baseline_bcd`."""
    return cfg.model_copy(update={"bcd": cfg.bcd.model_copy(update=baseline_bcd(cfg))})


@flow(name="full_train", flow_run_name=lambda: _run_id("full"))
def full_train(run_id: str | None = None, config: RunParams = RunParams()) -> dict:
    """Full-parameter baseline with the same sampler and step loop as a one-block visit.

    Args:
        run_id: The bcdflow run id; an existing one resumes that run, empty starts a new run (full-...).
        config: The run's settings; the bcd_* fields are overridden (one block, one cycle, every row), and it
            trains `train_steps` steps, validating every `train_eval_every` (empty: train_steps / 25).
    """
    return run_bcd(full_config(config.to_config()), run_id or _run_id("full"), "full")


# What `bcdflow train` / `baseline` / `resume` run: the same flows (by name, so their runs read alike in the UI), with
# the RunConfig the CLI resolved as it is. The flat form above is the deployments' only: the UI's parameters,
# converted once (``RunParams.to_config``) where a deployment's run starts.

@flow(name="bcd_train", flow_run_name=lambda: _run_id("bcd"))
def bcd_train_config(config: RunConfig, run_id: str | None = None) -> dict:
    """`bcdflow train`: :func:`bcd_train` with the config resolved by the CLI."""
    return run_bcd(config, run_id or _run_id("bcd"), "bcd")


@flow(name="full_train", flow_run_name=lambda: _run_id("full"))
def full_train_config(config: RunConfig, run_id: str | None = None) -> dict:
    """`bcdflow baseline`: :func:`full_train` with the config resolved by the CLI."""
    return run_bcd(full_config(config), run_id or _run_id("full"), "full")
