"""Run state: the resolved config and the committed visits, as typed records (docs/DESIGN.md §2 step 5, §5).

    runs/{run_id}/config.json                     the resolved run config (written once, before the first visit)
    runs/{run_id}/state.json                      a RunState: version, status, the VisitRecord of each visit
    runs/{run_id}/visits/c{c}-b{b}/...            one visit's working objects (activations, mid-visit checkpoint)

``state.json`` is the commit point of a visit: it is written last, after the block file and the version
manifest, and each write replaces the whole object atomically (``Store.write_bytes``). A crash before it leaves
the run at the previous version; a resumed run reads it to know which visits are done (docs/DESIGN.md §3 I4).
:class:`VisitRecord` and :class:`RunState` own the schema of ``state.json``: every field is declared (and
documented) here once, and a state that does not parse is a damaged artifact, not a run to continue.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bcdflow.errors import DamagedArtifact

from .layout import RUNS, config_key, is_run_id, state_key
from .store import Store


class RunStateError(DamagedArtifact):
    """A run's config.json or state.json is missing, truncated or malformed."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class VisitRecord(_Record):
    """One committed visit (cycle, block), as ``state.json`` stores it."""
    cycle: int
    block: int
    version: int
    """The version this visit committed (base version + 1)."""
    steps: int
    """Optimizer steps of the visit."""
    step_end: int
    """Global step at the end of the visit (steps of all committed visits up to and including it)."""
    resumed_at: int = 0
    """Step the visit continued from after an interruption (0 = ran in one go)."""
    stopped_by: str
    """What ended the local convergence loop: ``max_steps`` or ``plateau``."""
    rows: int
    """Training sequences the visit could reach (its sample cut to the step cap)."""
    tokens: int
    first_loss: float
    train_loss: float
    """Mean training loss of the last 10 steps."""
    val_loss: float
    val_ppl: float
    val_points: list[tuple[int, float]] = []
    """(global step, validation loss) within the visit (the baseline validates every ``train.eval_every``)."""
    tokens_per_s: float
    peak_mem_bytes: int | None = None
    """Peak CUDA memory allocated by the training stage; None on the CPU."""
    preinfer_seconds: float = 0.0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    seconds: float
    """Wall seconds of the whole visit (its stages plus orchestration, commit and store I/O)."""
    gpu_hours_preinfer: float = 0.0
    gpu_hours_train: float = 0.0
    gpu_hours_eval: float = 0.0
    gpu_hours: float = 0.0
    spend_preinfer_usd: float = 0.0
    spend_train_usd: float = 0.0
    spend_eval_usd: float = 0.0
    spend_usd: float = 0.0
    cum_spend_usd: float = 0.0
    """The run's spend up to and including this visit."""


class RunState(_Record):
    """A run's committed progress: ``runs/{run_id}/state.json``."""
    run_id: str
    version: int = 0
    """The last committed version (0 = the initial model)."""
    status: Literal["running", "done"] = "running"
    mode: Literal["bcd", "full"] = "bcd"
    dataset: str | None = None
    created: float | None = None
    mlflow_run_id: str | None = None
    stop_reason: str | None = None
    """Why the run ended: cycles, target_val_loss, no_improvement or budget."""
    stop_detail: str | None = None
    visits: list[VisitRecord] = Field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(v.steps for v in self.visits)

    @property
    def spend_usd(self) -> float:
        return sum(v.spend_usd for v in self.visits)

    @property
    def done_visits(self) -> set[tuple[int, int]]:
        return {(v.cycle, v.block) for v in self.visits}


def write_config(store: Store, run_id: str, config: dict[str, Any]) -> None:
    store.write_json(config, config_key(run_id))


def read_config(store: Store, run_id: str) -> dict[str, Any]:
    key = config_key(run_id)
    if not store.exists(key):
        raise RunStateError(f"run config {store.url_of(key)} is missing: the run cannot be continued from this "
                            "store (restore the object, or start a new run with another --run-id)")
    try:
        config = json.loads(store.read_bytes(key))
    except ValueError as e:
        raise RunStateError(f"run config {store.url_of(key)} is damaged (not valid JSON: {e}); restore the object "
                            "or start a new run with another --run-id") from None
    if not isinstance(config, dict):
        raise RunStateError(f"run config {store.url_of(key)} is damaged (not a JSON object)")
    return config


def read_state(store: Store, run_id: str) -> RunState | None:
    """The run's state, or None when the run does not exist."""
    key = state_key(run_id)
    try:
        data = store.read_bytes(key)
    except FileNotFoundError:
        return None
    try:
        return RunState.model_validate_json(data)
    except ValidationError as e:
        err = e.errors()[0]
        what = "not valid JSON (truncated?)" if err["type"] == "json_invalid" else \
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
        raise RunStateError(f"run state {store.url_of(key)} is damaged ({what}); restore the object from a copy, "
                            "or start a new run with another --run-id") from None


def write_state(store: Store, state: RunState) -> None:
    store.write_bytes(state.model_dump_json(indent=2).encode(), state_key(state.run_id))


def append_visit(store: Store, run_id: str, visit: VisitRecord) -> RunState:
    """Record a committed visit and move the run to its version; returns the new state.

    The visit's version must be the run's version + 1, so a visit is never recorded twice."""
    state = read_state(store, run_id) or RunState(run_id=run_id)
    if visit.version != state.version + 1:
        raise RunStateError(f"visit c{visit.cycle}-b{visit.block} would commit version {visit.version}, but run "
                            f"{run_id!r} is at version {state.version}: another process committed in between")
    state = state.model_copy(update={"version": visit.version, "visits": [*state.visits, visit]})
    write_state(store, state)
    return state


def run_exists(store: Store, run_id: str) -> bool:
    return store.exists(config_key(run_id)) or store.exists(state_key(run_id))


def list_runs(store: Store) -> list[str]:
    return [r for r in store.listdir(RUNS) if is_run_id(r) and run_exists(store, r)]
