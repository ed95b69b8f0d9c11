"""The BCD run as Prefect flows (DESIGN §2; paper Algorithm 1).

``bcd_train`` (parent) prepares data, creates or resumes the run, and loops over cycles and blocks;
each visit is its own flow run ``c{cycle}-b{block}``: sample -> pre-infer shards -> train ->
evaluate -> commit. ``full_train`` is the full-parameter baseline: a one-block, one-cycle run at
sample rate 1 through the very same visit flow and step loop (invariant I3).

A run ends at the first global stop rule (``stop_reason``): target validation loss, no validation
improvement over whole cycles, budget (DESIGN §7) or all cycles done; the reason goes to state.json
(``stop_reason``) and the MLflow tag ``bcdflow.stop_reason``. Both flows take one flat parameter
model (``flows.params.RunParams``) so a deployment's run form in the Prefect UI is editable.
"""
from __future__ import annotations

import time

import numpy as np
from prefect import flow, get_run_logger, task, unmapped
from prefect.runtime import flow_run

from storage import runs
from flows.params import RunParams, new_run_id
from tasks import report, spend
from tasks.config import RunConfig
from tasks.data import prepare_data_task
from tasks.preinfer import plan_shards, preinfer_shard, visit_key
from tasks.run import commit_visit, init_run_task
from tasks.tracking import Tracker
from tasks.train import choose_greedy, evaluate, train_block
from tasks.retry import retrying


@flow(name="bcd-visit", flow_run_name="c{cycle}-b{block}")
def visit(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str,
          step_offset: int = 0, parent_mlflow_run: str | None = None,
          eval_every: int | None = None, spend_before: float = 0.0) -> dict:
    """One (cycle, block) visit: block ``block`` of version ``version`` trained to local convergence."""
    log = get_run_logger()
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    store = cfg.open_store()
    vkey = visit_key(run_id, cycle, block)
    # an interrupted visit continues its MLflow run instead of opening a second one
    known = store.read_json(vkey, "mlflow.json")["run_id"] if store.exists(vkey, "mlflow.json") else None
    mlrun = tracker.start(f"c{cycle}-b{block}", params={"cycle": cycle, "block": block, "base_version": version},
                          tags={**_prefect_tags(), "bcdflow.run_id": run_id},
                          parent=parent_mlflow_run, resume_id=known)
    if mlrun and not known:
        store.write_json({"run_id": mlrun}, vkey, "mlflow.json")
    t0 = time.perf_counter()
    preinfer_s = 0.0
    if cfg.bcd.preinfer and block > 0:  # paper §3.2.2
        shards = plan_shards(cfg, run_id, cycle, block, dataset_id)
        preinfer_shard.map(cfg=unmapped(cfg), run_id=run_id, cycle=cycle, block=block, version=version,
                           dataset_id=dataset_id, shard=shards).result()
        preinfer_s = time.perf_counter() - t0
    tr = train_block(cfg, run_id, cycle, block, version, dataset_id, step_offset=step_offset,
                     mlflow_runs=tuple(r for r in (mlrun, parent_mlflow_run) if r),
                     eval_every=eval_every)
    ev = evaluate(cfg, run_id, version, dataset_id, {block: tr["block_file"]})
    record = {
        "cycle": cycle, "block": block, "steps": tr["steps"], "train_loss": tr["train_loss"],
        "first_loss": tr["first_loss"], "val_loss": ev["val_loss"], "val_ppl": ev["val_ppl"],
        "stopped_by": tr["stopped_by"], "rows": tr["rows"], "tokens": tr["tokens"],
        "tokens_per_s": tr["tokens_per_s"], "preinfer_seconds": preinfer_s,
        "train_seconds": tr["train_seconds"], "eval_seconds": ev["eval_seconds"],
        "seconds": time.perf_counter() - t0, "peak_mem_bytes": tr["peak_mem_bytes"],
        "val_points": tr["val_points"], "step_end": step_offset + tr["steps"], "resumed_at": tr["resumed_at"],
    }
    record.update(spend.visit_spend(cfg.spend, record))  # DESIGN §7: per stage and total
    record["cum_spend_usd"] = spend_before + record["spend_usd"]
    record["version"] = commit_visit(cfg, run_id, version, block, tr["block_file"], record)
    store.rm(vkey)  # activations and mid-visit checkpoints are dead once committed
    metrics = {k: record[k] for k in ("steps", "train_loss", "val_loss", "val_ppl", "tokens_per_s",
                                      "preinfer_seconds", "train_seconds", "eval_seconds", "seconds",
                                      "gpu_hours", "spend_usd", "cum_spend_usd",
                                      *(f"spend_{s}_usd" for s in spend.STAGES))}
    tracker.metrics(mlrun, metrics, record["version"])
    tracker.metrics(parent_mlflow_run, {"val_loss": ev["val_loss"], "val_ppl": ev["val_ppl"],
                                        "cum_spend_usd": record["cum_spend_usd"]}, record["step_end"])
    tracker.end(mlrun)
    log.info("visit c%d-b%d: %d steps (%s), train %.4f, val %.4f, %.1fs, $%.4f", cycle, block, tr["steps"],
             tr["stopped_by"], tr["train_loss"], ev["val_loss"], record["seconds"], record["spend_usd"])
    return record


def _prefect_tags() -> dict:
    """MLflow tags pointing back at the Prefect flow run that does the work."""
    tags = {"prefect.flow_run_id": flow_run.get_id(), "prefect.flow_run_name": flow_run.get_name(),
            "prefect.flow_run_url": flow_run.get_flow_run_ui_url()}
    return {k: v for k, v in tags.items() if v}


@task(name="note-state", **retrying())
def note_state(cfg: RunConfig, run_id: str, **fields) -> None:
    store = cfg.open_store()
    state = runs.read_state(store, run_id)
    runs.write_state(store, run_id, {**state, **fields})


def visit_with_workers(cfg: RunConfig):
    """The visit flow with a task runner sized for pre-inference on this device."""
    import torch
    from prefect.task_runners import ThreadPoolTaskRunner

    n = cfg.bcd.preinfer_workers or (2 if cfg.train.device != "cpu" and torch.cuda.is_available() else 1)
    return visit.with_options(task_runner=ThreadPoolTaskRunner(max_workers=n))


def cycle_order(cfg: RunConfig, n_blocks: int, cycle: int) -> list[int]:
    """Fixed orders; ``greedy`` is chosen visit by visit instead."""
    if cfg.bcd.order == "reverse":
        return list(range(n_blocks - 1, -1, -1))
    if cfg.bcd.order == "random":
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, cycle, 7919]))
        return [int(b) for b in rng.permutation(n_blocks)]
    return list(range(n_blocks))


def stale_cycles(visits: list[dict], n_blocks: int, min_delta: float = 0.0) -> int:
    """How many of the latest completed cycles in a row brought no new best validation loss."""
    by_cycle: dict[int, list[float]] = {}
    for v in visits:
        by_cycle.setdefault(v["cycle"], []).append(v["val_loss"])
    best, stale = float("inf"), 0
    for c in sorted(by_cycle):
        if len(by_cycle[c]) < n_blocks:  # the cycle in progress does not count yet
            break
        stale = 0 if min(by_cycle[c]) < best - min_delta else stale + 1
        best = min(best, *by_cycle[c])
    return stale


def stop_reason(cfg: RunConfig, visits: list[dict], n_blocks: int,
                next_block: int | None = None) -> tuple[str, str] | None:
    """The global stop rule that holds now, as (reason, detail), or None to go on (DESIGN §2).

    Checked between visits, so whichever rule is met first ends the run; when several hold at once the
    precedence is: ``target_val_loss`` (the goal is reached), ``no_improvement`` (``stop.patience_cycles``
    completed cycles without a new best), ``budget`` (the visit of ``next_block`` would overspend)."""
    st = cfg.stop
    best = min((v["val_loss"] for v in visits), default=float("inf"))
    if st.target_val_loss is not None and best <= st.target_val_loss:
        return "target_val_loss", f"validation loss {best:.4f} <= target {st.target_val_loss:g}"
    if st.patience_cycles and (n := stale_cycles(visits, n_blocks, st.min_delta)) >= st.patience_cycles:
        return "no_improvement", f"{n} whole cycle(s) without a validation loss below {best:.4f}"
    if next_block is not None and (why := spend.over_budget(cfg.spend, visits, next_block)):
        return "budget", why
    return None


def run_bcd(cfg: RunConfig, run_id: str, mode: str,
            eval_every: int | None = None) -> dict:
    log = get_run_logger()
    dataset_id = prepare_data_task(cfg, cfg.open_store())
    state = init_run_task(cfg, run_id, dataset_id, mode)
    n_blocks = len(runs.read_config(cfg.open_store(), run_id)["plan"]["blocks"])
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    parent = tracker.start(run_id, params={**cfg.model_dump(exclude={"store", "tracking_uri"}), "mode": mode},
                           tags={**_prefect_tags(), "bcdflow.run_id": run_id,
                                 "bcdflow.mode": mode, "bcdflow.dataset": dataset_id},
                           resume_id=state.get("mlflow_run_id"), system_metrics=True)
    if parent and not state.get("mlflow_run_id"):
        note_state(cfg, run_id, mlflow_run_id=parent)
    report.publish_link(run_id, tracker.run_url(parent), f"MLflow run of {run_id}")
    visits = list(state["visits"])
    progress = report.Progress(run_id, cfg.bcd.cycles * n_blocks, len(visits))
    done = {(v["cycle"], v["block"]) for v in visits}
    version = state["version"]
    steps = sum(v["steps"] for v in visits)
    t0 = time.perf_counter()
    stop = None
    try:
        for cycle in range(cfg.bcd.cycles):
            todo = [b for b in cycle_order(cfg, n_blocks, cycle) if (cycle, b) not in done]
            while todo and not (stop := stop_reason(cfg, visits, n_blocks)):
                b = (choose_greedy(cfg, run_id, version, dataset_id, cycle, todo)
                     if cfg.bcd.order == "greedy" and len(todo) > 1 else todo[0])
                if stop := stop_reason(cfg, visits, n_blocks, next_block=b):
                    break
                todo.remove(b)
                rec = visit_with_workers(cfg)(cfg, run_id, cycle, b, version, dataset_id, step_offset=steps,
                            parent_mlflow_run=parent, eval_every=eval_every,
                            spend_before=spend.total_spend(cfg.spend, visits))
                visits.append(rec)
                version, steps = rec["version"], steps + rec["steps"]
                progress.update(len(visits))
                report.publish_visits(run_id, visits)
                if not todo:  # cycle-level curve on the parent run: step = cycle
                    tracker.metrics(parent, {"cycle_val_loss": rec["val_loss"],
                                             "cycle_cum_spend_usd": rec["cum_spend_usd"]}, cycle)
            if stop:
                break
        stop = stop or stop_reason(cfg, visits, n_blocks) or ("cycles", f"{cfg.bcd.cycles} cycle(s) done")
    except BaseException:
        tracker.end(parent, "FAILED")
        raise
    reason, detail = stop
    note_state(cfg, run_id, status="done", stop_reason=reason, stop_detail=detail)
    total_usd = spend.total_spend(cfg.spend, visits)
    tracker.tags(parent, {"bcdflow.stop_reason": reason, "bcdflow.stop_detail": detail})
    tracker.metrics(parent, {"total_steps": steps, "wall_seconds": time.perf_counter() - t0,
                             "spend_usd": total_usd,
                             "gpu_hours": sum(v.get("gpu_hours") or 0.0 for v in visits)}, version)
    if parent:
        try:
            report.report_run(cfg, run_id, parent, version)
        except Exception as e:  # the trained model is safe in the store (`bcdflow export`)
            log.warning("figures/model not logged to MLflow: %s: %s", type(e).__name__, e)
    tracker.end(parent)
    progress.update(len(visits), note=f"stopped: {reason} ({detail})", finished=True)
    report.publish_visits(run_id, visits, stop_reason=reason)
    summary = {"run_id": run_id, "version": version, "steps": steps, "mlflow_run_id": parent,
               "val_loss": visits[-1]["val_loss"] if visits else None, "spend_usd": total_usd,
               "stop_reason": reason}
    log.info("run %s done (%s: %s): version %d, val loss %s, $%.4f", run_id, reason, detail,
             version, summary["val_loss"], total_usd)
    return summary


@flow(name="bcd_train")
def bcd_train(config: RunParams = RunParams(), run_id: str | None = None) -> dict:
    """Train with block coordinate descent. An existing ``run_id`` resumes that run; none starts a new one."""
    return run_bcd(config.to_config(), run_id or new_run_id("bcd"), "bcd")


def full_config(cfg: RunConfig) -> RunConfig:
    """The baseline as a BCD run: one block, one cycle, every row, ``train.steps`` steps (I3)."""
    bcd = cfg.bcd.model_copy(update={"blocks": 1, "boundaries": None, "cycles": 1, "sample_rate": 1.0,
                                     "preinfer": False, "max_steps": cfg.train.steps})
    return cfg.model_copy(update={"bcd": bcd})


@flow(name="full_train")
def full_train(config: RunParams = RunParams(), run_id: str | None = None) -> dict:
    """Full-parameter baseline with the same sampler and step loop as a one-block visit: the bcd_* fields are
    overridden (one block, one cycle, every row); it trains `train_steps` steps, validating every `train_eval_every`."""
    cfg = full_config(config.to_config())
    return run_bcd(cfg, run_id or new_run_id("full"), "full",
                   eval_every=cfg.train.eval_every)
