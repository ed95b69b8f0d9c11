"""Run-level tasks: create a run (version 0) or check a resumed run's config, and commit a visit.

Version 0 is fresh weights from the run seed, or with ``model.from_hf`` the checkpoint converted block by
block (core/hf_import.py); such a run also keeps a copy of the checkpoint's config and tokenizer files under
``runs/{run_id}/hf/`` (so ``bcdflow export --format hf`` needs only the store) and its fingerprint, so a
resume from a checkpoint that changed under the same path is refused.

The commit is the single atomic point of a visit (docs/DESIGN.md §2.5): block file first (content-addressed,
already written by training), then the new version manifest (copy-on-write), then the run state.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from prefect import task

from bcdflow.core import failpoints, hf_import
from bcdflow.core.config import RunConfig, identity_keys, with_former_defaults
from bcdflow.core.context import RunContext, open_store
from bcdflow.models import build_model
from bcdflow.models.errors import ConfigError
from bcdflow.models.plan import block_tensors
from bcdflow.storage import checkpoints, layout, runs
from bcdflow.storage.hf_checkpoint import Checkpoint
from bcdflow.storage.runs import RUN_FORMAT, RunState, VisitRecord
from bcdflow.tasks.retry import retrying

# keys that define what a run computes; a resumed run must match them exactly: the config fields marked SAME
# (core/config.Resume: each field says, with the reasons on FREE; tests/test_config.py fails on a field with no
# mark), and what the run records beside its config: ``mode`` (bcd or full), the run ``format``, a from_hf
# checkpoint's ``hf.fingerprint``, and ``dataset``, the token dataset's content id (the same data.files glob holding
# new contents is another run).
IDENTITY = (*identity_keys(), "mode", "format", "hf.fingerprint", "dataset")
# what the command line checks before a run starts (flows/cli.py): the settings; the data's id has its own check
# there (_check_same_data), and the checkpoint's fingerprint needs the checkpoint opened (init_run)
SETTINGS_IDENTITY = tuple(k for k in IDENTITY if k not in ("dataset", "hf.fingerprint"))


def _pick(d: dict, dotted: str):
    for p in dotted.split("."):
        d = d.get(p, {}) if isinstance(d, dict) else None
    return d


def _normalized(stored: dict) -> dict:
    """A stored config with the fields a newer bcdflow added filled with their defaults, so a key that did not
    exist when the run started does not count as a difference."""
    try:
        sections = RunConfig.model_validate({k: v for k, v in stored.items() if k in RunConfig.model_fields})
    except ValueError:
        return stored  # a field since removed: compared raw, so it shows up as a difference
    return {**stored, **sections.model_dump(exclude={"store"})}


def check_same_identity(stored: dict, resolved: dict, run_id: str, hf_dir: str | None = None,
                        keys: tuple[str, ...] = IDENTITY) -> dict:
    """Refuse to continue run ``run_id`` (its stored config ``stored``) as ``resolved`` when one of ``keys`` differs:
    one ConfigError line naming the keys. Returns the stored config, normalized (:func:`_normalized`). The command
    line calls it before anything is written (``SETTINGS_IDENTITY``, flows/cli.py), ``init_run`` again (a
    deployment's run)."""
    old = _normalized(with_former_defaults(stored))
    old.setdefault("format", 1)
    diff = [k for k in keys if _pick(old, k) != _pick(resolved, k)]
    if "format" in diff:
        raise ConfigError(f"run {run_id!r} was made by an older bcdflow (run format {old['format']}, this one "
                          f"writes {RUN_FORMAT}: LLaMA rotary embeddings changed); start a new --run-id")
    if diff == ["dataset"]:  # the CLI refuses this before anything is written (flows/cli._check_same_data)
        raise ConfigError(f"data.files: the data of run {run_id!r} changed since it started (token dataset "
                          f"{old['dataset']}, now {resolved['dataset']}); restore it or use a new --run-id")
    if diff == ["hf.fingerprint"]:
        raise ConfigError(f"model.from_hf: the checkpoint at {hf_dir!r} changed since run {run_id!r} started "
                          "from it (its files' fingerprint differs); use a new --run-id")
    if diff:
        raise ConfigError(f"run {run_id!r} exists with a different config: {', '.join(diff)} "
                          "differ (use a new --run-id)")
    return old


@task(name="init-run", **retrying())
def init_run(cfg: RunConfig, run_id: str, dataset_id: str, mode: str = "bcd") -> RunState:
    """Create version 0 of a new run, or check an existing run's config and return its state."""
    ctx = RunContext.of(cfg, run_id, dataset_id)
    store, mcfg, plan = ctx.store, ctx.model_cfg, ctx.plan
    resolved = {**cfg.model_dump(), "mode": mode, "dataset": dataset_id, "format": RUN_FORMAT,
                "model_resolved": mcfg.to_dict(), "plan": plan.to_dict()}
    resolved.pop("store", None)  # a run can move between stores; credentials never go in here
    ck = None
    if cfg.model.from_hf:
        ck = Checkpoint.open(cfg.model.from_hf)
        resolved["hf"] = hf_import.record(ck, mcfg)
    state = runs.read_state(store, run_id)
    if state is not None:
        old = check_same_identity(runs.read_config(store, run_id), resolved, run_id, ck.dir if ck else None)
        checkpoints.check_version(store, run_id, state.version)  # the weights to continue from are all there
        if _pick(old, "optim.lr") != cfg.optim.lr:
            runs.write_config(store, run_id, {**old, "optim": {**old["optim"], "lr": cfg.optim.lr}})
        return state
    if ck is not None:  # version 0: the checkpoint, one block at a time
        blocks = hf_import.write_version0(store, run_id, ck, mcfg, plan)
        for name, data in ck.sidecars().items():
            store.write_bytes(data, layout.hf_key(run_id, name))
    else:  # version 0: fresh weights, one block at a time (no process ever holds the whole model for this)
        blocks = {b.index: checkpoints.save_block(store, run_id, initial_block(mcfg, plan, b.index, cfg.seed))
                  for b in plan.blocks}
    checkpoints.write_manifest(store, run_id, 0, blocks)
    runs.write_config(store, run_id, resolved)
    state = RunState(run_id=run_id, mode=mode, dataset=dataset_id, created=time.time())
    runs.write_state(store, state)
    return state


def initial_block(mcfg, plan, b: int, seed: int) -> dict[str, torch.Tensor]:
    """Block ``b``'s initial tensors: its part of the model built alone (embeddings with block 0, the head with
    the last) and initialised from a generator seeded by (run seed, block)."""
    blk, last = plan.visits[b], len(plan.blocks) - 1
    torch.manual_seed(int(np.random.SeedSequence([seed, b]).generate_state(1)[0]))
    part = build_model(mcfg, layers=blk.layers, embed=b == 0, head=b == last)
    return block_tensors(part, plan, b)


@task(name="commit", **retrying())
def commit_visit(cfg: RunConfig, run_id: str, record: VisitRecord, files: dict[int, dict],
                 fence: dict[str, int] | None = None) -> RunState:
    """Publish version ``record.version`` = the version before it with the stored blocks in ``files`` replaced by
    their new files (``TrainResult.files``: the visit's own block, or the one a row block's matrix lives in, and,
    ``bcd.expand``, the suffix blocks it changed), then create the run's next state with the record (the commit
    point, docs/DESIGN.md §2.5).

    ``fence``: the lease epochs this visit holds (``run``, ``visit c{c}-b{b}``); a state fenced by a later holder
    means this process lost its lease, and it changes nothing (LeaseLost). A retry that finds its own record
    committed (its reply was lost) returns the state."""
    store = open_store(cfg)
    fence = fence or {}
    failpoints.hit("before-commit")
    state = runs.read_state(store, run_id)
    if state is not None and record in state.visits:  # our own commit, made by an attempt whose reply was lost
        return state
    runs.check_fence(state, fence, f"visit c{record.cycle}-b{record.block} of run {run_id!r}")
    if state.version != record.version - 1:  # checked before the manifest is written (docs/DESIGN.md I7)
        raise runs.RunStateError(f"visit c{record.cycle}-b{record.block} was trained on version {record.version - 1}, "
                                 f"but run {run_id!r} is at version {state.version}: another process committed")
    failpoints.hit("commit-checked")  # the window a paused process sits in: the state create below fences it
    checkpoints.commit_version(store, run_id, record.version - 1, record.version, files)
    state = runs.append_visit(store, run_id, record, fence, base=state,
                              drop=tuple(k for k in fence if k.startswith("visit ")))
    failpoints.hit("after-commit")  # committed; the visit's working objects not yet dropped (flows/visit.visit)
    return state


@task(name="note-state", **retrying())
def note_state(cfg: RunConfig, run_id: str, fence: dict[str, int] | None = None, **fields) -> RunState:
    """Set run-level fields of the run state (status, stop reason, MLflow run id), as the holder of ``fence``."""
    store = open_store(cfg)
    state = runs.read_state(store, run_id)
    if all(getattr(state, k) == v for k, v in fields.items()):
        return state  # already so (a retry whose reply was lost)
    return runs.advance(store, state, state.model_copy(update=fields), fence)
