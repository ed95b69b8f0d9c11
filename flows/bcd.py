"""The BCD run as Prefect flows (DESIGN §2; paper Algorithm 1).

``bcd_train`` (parent) prepares data, creates or resumes the run, and loops over cycles and blocks;
each visit is its own flow run ``c{cycle}-b{block}``: sample -> pre-infer shards -> train ->
evaluate -> commit. ``full_train`` is the full-parameter baseline: a one-block, one-cycle run at
sample rate 1 through the very same visit flow and step loop (invariant I3).
"""
from __future__ import annotations

import time

import numpy as np
from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from storage import runs
from tasks import preempt
from tasks.config import RunConfig, parse_config
from tasks.data import prepare_data_task
from tasks.preinfer import plan_shards, preinfer_shard, visit_key
from tasks.run import commit_visit, init_run_task
from tasks.tracking import Tracker
from tasks.train import choose_greedy, evaluate, train_block


@flow(name="bcd-visit", flow_run_name="c{cycle}-b{block}")
def visit(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str,
          step_offset: int = 0, parent_mlflow_run: str | None = None, max_steps: int | None = None,
          eval_every: int | None = None) -> dict:
    """One (cycle, block) visit: block ``block`` of version ``version`` trained to local convergence."""
    log = get_run_logger()
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    store = cfg.open_store()
    vkey = visit_key(run_id, cycle, block)
    # an interrupted visit continues its MLflow run instead of opening a second one
    known = store.read_json(vkey, "mlflow.json")["run_id"] if store.exists(vkey, "mlflow.json") else None
    mlrun = tracker.start(f"c{cycle}-b{block}", params={"cycle": cycle, "block": block, "base_version": version},
                          tags={"prefect.flow_run_id": flow_run.get_id(), "bcdflow.run_id": run_id},
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
    tr = train_block(cfg, run_id, cycle, block, version, dataset_id, max_steps=max_steps,
                     step_offset=step_offset, mlflow_runs=tuple(r for r in (mlrun, parent_mlflow_run) if r),
                     eval_every=eval_every)
    ev = evaluate(cfg, run_id, version, dataset_id, {block: tr["block_file"]})
    record = {
        "cycle": cycle, "block": block, "steps": tr["steps"], "train_loss": tr["train_loss"],
        "first_loss": tr["first_loss"], "val_loss": ev["val_loss"], "val_ppl": ev["val_ppl"],
        "stopped_by": tr["stopped_by"], "rows": tr["rows"], "tokens": tr["tokens"],
        "tokens_per_s": tr["tokens_per_s"], "preinfer_seconds": preinfer_s,
        "train_seconds": tr["train_seconds"], "eval_seconds": ev["eval_seconds"],
        "seconds": time.perf_counter() - t0, "peak_mem_bytes": tr["peak_mem_bytes"],
        "val_points": tr["val_points"], "step_end": step_offset + tr["steps"],
    }
    record["version"] = commit_visit(cfg, run_id, version, block, tr["block_file"], record)
    store.rm(vkey)  # activations and mid-visit checkpoints are dead once committed
    metrics = {k: record[k] for k in ("steps", "train_loss", "val_loss", "val_ppl", "tokens_per_s",
                                      "preinfer_seconds", "train_seconds", "seconds")}
    tracker.metrics(mlrun, metrics, record["version"])
    tracker.metrics(parent_mlflow_run, {"val_loss": ev["val_loss"], "val_ppl": ev["val_ppl"]}, record["step_end"])
    tracker.end(mlrun)
    log.info("visit c%d-b%d: %d steps (%s), train %.4f, val %.4f, %.1fs", cycle, block, tr["steps"],
             tr["stopped_by"], tr["train_loss"], ev["val_loss"], record["seconds"])
    return record


@task(name="note-state", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[2, 10])
def note_state(cfg: RunConfig, run_id: str, **fields) -> None:
    store = cfg.open_store()
    state = runs.read_state(store, run_id)
    runs.write_state(store, run_id, {**state, **fields})


def cycle_order(cfg: RunConfig, n_blocks: int, cycle: int) -> list[int]:
    """Fixed orders; ``greedy`` is chosen visit by visit instead."""
    if cfg.bcd.order == "reverse":
        return list(range(n_blocks - 1, -1, -1))
    if cfg.bcd.order == "random":
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, cycle, 7919]))
        return [int(b) for b in rng.permutation(n_blocks)]
    return list(range(n_blocks))


def run_bcd(cfg: RunConfig, run_id: str, mode: str, max_steps: int | None = None,
            eval_every: int | None = None) -> dict:
    log = get_run_logger()
    preempt.install()
    dataset_id = prepare_data_task(cfg, cfg.open_store())
    state = init_run_task(cfg, run_id, dataset_id, mode)
    n_blocks = len(runs.read_config(cfg.open_store(), run_id)["plan"]["blocks"])
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    parent = tracker.start(run_id, params={**cfg.model_dump(exclude={"store", "tracking_uri"}), "mode": mode},
                           tags={"prefect.flow_run_id": flow_run.get_id(), "bcdflow.run_id": run_id,
                                 "bcdflow.mode": mode, "bcdflow.dataset": dataset_id},
                           resume_id=state.get("mlflow_run_id"))
    if parent and not state.get("mlflow_run_id"):
        note_state(cfg, run_id, mlflow_run_id=parent)
    done = {(v["cycle"], v["block"]) for v in state["visits"]}
    version = state["version"]
    steps = sum(v["steps"] for v in state["visits"])
    t0 = time.perf_counter()
    try:
        for cycle in range(cfg.bcd.cycles):
            todo = [b for b in cycle_order(cfg, n_blocks, cycle) if (cycle, b) not in done]
            while todo:
                b = (choose_greedy(cfg, run_id, version, dataset_id, cycle, todo)
                     if cfg.bcd.order == "greedy" and len(todo) > 1 else todo[0])
                todo.remove(b)
                rec = visit(cfg, run_id, cycle, b, version, dataset_id, step_offset=steps,
                            parent_mlflow_run=parent, max_steps=max_steps, eval_every=eval_every)
                version, steps = rec["version"], steps + rec["steps"]
    except BaseException:
        tracker.end(parent, "FAILED")
        raise
    note_state(cfg, run_id, status="done")
    tracker.metrics(parent, {"total_steps": steps, "wall_seconds": time.perf_counter() - t0}, version)
    tracker.end(parent)
    final = runs.read_state(cfg.open_store(), run_id)
    summary = {"run_id": run_id, "version": final["version"], "steps": steps, "mlflow_run_id": parent,
               "val_loss": final["visits"][-1]["val_loss"] if final["visits"] else None}
    log.info("run %s done: version %d, val loss %s", run_id, summary["version"], summary["val_loss"])
    return summary


@flow(name="bcd_train")
def bcd_train(config: dict, run_id: str) -> dict:
    """Train with block coordinate descent; resumes an existing run with the same id."""
    return run_bcd(parse_config(config), run_id, "bcd")


def full_config(cfg: RunConfig) -> RunConfig:
    """The baseline as a BCD run: one block, one cycle, every row, ``train.steps`` steps (I3)."""
    bcd = cfg.bcd.model_copy(update={"blocks": 1, "boundaries": None, "cycles": 1, "sample_rate": 1.0,
                                     "preinfer": False, "max_steps": cfg.train.steps})
    return cfg.model_copy(update={"bcd": bcd})


@flow(name="full_train")
def full_train(config: dict, run_id: str) -> dict:
    """Full-parameter baseline with the same sampler and step loop as a one-block visit."""
    cfg = full_config(parse_config(config))
    return run_bcd(cfg, run_id, "full", max_steps=cfg.train.steps, eval_every=cfg.train.eval_every)
