"""Run-level tasks: create a run (version 0), check a resumed run's config, commit a visit.

The commit is the single atomic point of a visit (DESIGN §2.5): block file first (content-addressed,
already written by training), then the new version manifest (copy-on-write), then the run state.
"""
from __future__ import annotations

import time

import torch
from prefect import task

from models import build_model, make_plan
from models.errors import ConfigError
from storage import checkpoints, runs
from storage.tokens import TokenDataset
from tasks import failpoints
from tasks.config import RunConfig
from tasks.weights import block_tensors
from tasks.retry import retrying

# keys that define what a run computes; a resumed run must match them exactly
IDENTITY = ("model", "data", "bcd.blocks", "bcd.boundaries", "bcd.split", "bcd.order", "bcd.sample_rate",
            "bcd.preinfer", "bcd.max_steps", "bcd.patience", "bcd.min_delta", "bcd.window",
            "optim", "train.batch_size", "seed", "mode")


def _pick(d: dict, dotted: str):
    for p in dotted.split("."):
        d = d.get(p, {}) if isinstance(d, dict) else None
    return d


def plan_for(cfg: RunConfig, vocab_size: int):
    mcfg = cfg.model_cfg(vocab_size)
    sizes = param_sizes(mcfg)
    names = sizes if cfg.bcd.split == "params" else list(sizes)
    return mcfg, make_plan(names, mcfg.n_layer, cfg.bcd.blocks, cfg.bcd.boundaries)


def param_sizes(mcfg) -> dict[str, int]:
    """Parameter name -> element count, from a meta-device model (no memory, no init)."""
    from models.gpt import GPT
    from models.llama import LLaMA

    with torch.device("meta"):
        model = {"gpt": GPT, "llama": LLaMA}[mcfg.family](mcfg)
    return {n: p.numel() for n, p in model.named_parameters()}


def init_run(cfg: RunConfig, run_id: str, dataset_id: str, mode: str = "bcd") -> dict:
    """Create version 0 of a new run, or check an existing run's config and return its state."""
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    mcfg, plan = plan_for(cfg, ds.vocab_size)
    resolved = {**cfg.model_dump(), "mode": mode, "dataset": dataset_id,
                "model_resolved": mcfg.to_dict(), "plan": plan.to_dict()}
    resolved.pop("store", None)  # a run can move between stores; credentials never go in here
    state = runs.read_state(store, run_id)
    if state is not None:
        old = runs.read_config(store, run_id)
        diff = [k for k in IDENTITY if _pick(old, k) != _pick(resolved, k)]
        if diff:
            raise ConfigError(f"run {run_id!r} exists with a different config: {', '.join(diff)} "
                              "differ (use a new --run-id)")
        return state
    torch.manual_seed(cfg.seed)
    model = build_model(mcfg)  # version 0: fresh weights from the run seed
    blocks = {b.index: checkpoints.save_block(store, run_id, block_tensors(model, plan, b.index))
              for b in plan.blocks}
    checkpoints.write_manifest(store, run_id, 0, blocks)
    runs.write_config(store, run_id, resolved)
    state = {"run_id": run_id, "version": 0, "visits": [], "status": "running", "mode": mode,
             "dataset": dataset_id, "created": time.time()}
    runs.write_state(store, run_id, state)
    return state


init_run_task = task(init_run, name="init-run", **retrying())


@task(name="commit", **retrying())
def commit_visit(cfg: RunConfig, run_id: str, base_version: int, block: int, block_file: dict,
                 visit: dict) -> int:
    """Publish version base+1 = version base with ``block`` replaced; append the visit to the state."""
    store = cfg.open_store()
    failpoints.hit("before-commit")
    new_version = base_version + 1
    checkpoints.commit_version(store, run_id, base_version, new_version, {block: block_file})
    runs.append_visit(store, run_id, {**visit, "version": new_version})
    return new_version
