"""Run state: the resolved config and the committed visits, as typed records (docs/DESIGN.md §2.5, §5, I7).

    runs/{run_id}/config.json                     the resolved run config (written once, before the first visit)
    runs/{run_id}/states/{seq:012d}.json          the RunState after the run's seq-th change: immutable, created
                                                  exclusively; the current state is the highest seq
    runs/{run_id}/state.json                      a copy of the current state, written after it (for readers; the
                                                  whole state of a run made before states/ existed)
    runs/{run_id}/visits/c{c}-b{b}/...            one visit's working objects (activations, mid-visit checkpoint)

Every change of the state is one conditional operation, :func:`advance`: the exclusive create of state
``seq + 1`` by a writer that read state ``seq``. Of two writers that read the same state exactly one wins, so a
run's version only moves forward by one per visit, and a commit is never lost or rolled back. Each state carries
the lease epochs (``fence``) of the writers that changed it: a process that takes a run or visit over writes its
epoch into the state first (:func:`fence`), and a writer whose epoch is below the state's for the same lease has
lost it and stops (``LeaseLost``) without writing: this is what makes a paused process that wakes up after a
takeover harmless (docs/DESIGN.md I7). A retried write that finds its own earlier object (same bytes) succeeds.
:class:`VisitRecord` and :class:`RunState` own the schema of the state objects: every field is declared (and
documented) here once, and a state that does not parse is a damaged artifact, not a run to continue.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bcdflow.errors import DamagedArtifact

from .layout import (RUNS, block_name, config_key, is_plain_name, is_run_id, parse_visit, state_key, state_seq,
                     states_key, visits_key)
from .lease import LeaseLost
from .store import Store


def _plain_dataset_id(cls, v: str | None) -> str | None:
    """A run record's ``dataset`` (the state's and the stored config's): a token dataset id, a plain name."""
    if v is not None and not is_plain_name(v):
        raise ValueError(f"{v!r:.80} is not a token dataset id")
    return v


class RunStateError(DamagedArtifact):
    """A run's config.json or state.json is missing, truncated or malformed."""


class _Record(BaseModel):
    # every number finite: a record is read by status, compare and the next visit, and JSON has no NaN
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


Count = Field(ge=0)  # a count, index or size: never below zero
Amount = Field(0.0, ge=0)  # seconds, GPU-hours or USD: 0 unless given, never below


class VisitRecord(_Record):
    """One committed visit (cycle, block), as ``state.json`` stores it. Every field is checked for its type and range
    where a state is read (:func:`read_state`): a record out of range is damage, never a figure to print or act on."""
    cycle: int = Count
    block: int = Count
    version: int = Field(ge=1)
    """The version this visit committed (base version + 1)."""
    steps: int = Field(ge=1)
    """Optimizer steps of the visit."""
    step_end: int = Field(ge=1)
    """Global step at the end of the visit (steps of all committed visits up to and including it)."""
    resumed_at: int = Field(0, ge=0)
    """Step the visit continued from after an interruption (0 = ran in one go)."""
    stopped_by: str
    """What ended the local convergence loop: ``max_steps``, ``plateau`` (the loss stopped falling) or ``budget``
    (``bcd.budget=adaptive``: it fell more slowly than the other blocks' last visits)."""
    rows: int = Count
    """Training sequences the visit could reach (its sample cut to the step cap)."""
    tokens: int = Count
    first_loss: float
    train_loss: float
    """Mean training loss of the last 10 steps."""
    val_loss: float
    val_ppl: float = Field(ge=0)
    rate: float | None = None
    """Training loss lowered per step on average over the visit (the adaptive budget's measure of a block)."""
    moments: dict | None = None
    """``bcd.moments=keep``: the optimizer state the visit ended with (file, sha256, bytes), the next visit of
    the block starts from."""
    expanded: dict[int, float] = {}
    """``bcd.expand``: the suffix blocks the visit changed besides its own (its adapters merged in), each with the
    norm of its update as stored; empty: only its block changed."""
    val_points: list[tuple[int, float]] = []
    """(global step, validation loss) within the visit (the baseline validates every ``train.eval_every``)."""
    tokens_per_s: float = Field(ge=0)
    peak_mem_bytes: int | None = Field(None, ge=0)
    """Peak CUDA memory allocated by the training stage; None on the CPU."""
    peak_reserved_bytes: int | None = Field(None, ge=0)
    """Peak CUDA memory the caching allocator reserved in the training stage (what the card held); None on the CPU."""
    preinfer_seconds: float = Amount
    preinfer_why: str | None = None
    """``bcd.preinfer=auto``: why this visit pre-inferred or computed its prefix on the card (the run planner's
    figures, core/forecast.choose_preinfer); None otherwise."""
    train_seconds: float = Amount
    """Seconds of the step loop, every attempt's up to its last checkpoint (``tokens_per_s`` = tokens over these)."""
    eval_seconds: float = Amount
    seconds: float = Field(ge=0)
    """Wall seconds of the whole visit (its stages plus orchestration, commit and store I/O), over every attempt of
    an interrupted visit, ``lost_seconds`` included."""
    lost_seconds: float = Amount
    """Seconds of interrupted attempts after their last mid-visit checkpoint (work done again; for a kill -9, up to
    the last renewal of its visit lease): in ``seconds`` and the spend, not in ``train_seconds``."""
    gpu_hours_preinfer: float = Amount
    gpu_hours_train: float = Amount
    gpu_hours_eval: float = Amount
    gpu_hours: float = Amount
    spend_preinfer_usd: float = Amount
    spend_train_usd: float = Amount
    spend_eval_usd: float = Amount
    spend_usd: float = Amount
    cum_spend_usd: float = Amount
    """The run's spend up to and including this visit."""

    @field_validator("moments")
    @classmethod
    def _moments_name_a_block_file(cls, v: dict | None) -> dict | None:
        """The kept optimizer state is a content-addressed file of the run's ``blocks/`` (what ``bcdflow prune``
        keeps and the next visit loads): anything else is damage, so nothing is kept or loaded by a bad name."""
        if v is not None and (block_name(v.get("file")) is None or not isinstance(v.get("sha256"), str)
                              or type(v.get("bytes")) is not int or v["bytes"] < 0):
            raise ValueError(f"names no block file for the visit's kept moments ({v!r:.80})")
        return v

    @model_validator(mode="after")
    def _steps_add_up(self) -> "VisitRecord":
        if self.step_end < self.steps:
            raise ValueError(f"step_end {self.step_end} is below the visit's own {self.steps} steps")
        if any(s < 0 for s, _ in self.val_points):
            raise ValueError("a validation point at a negative step")
        return self


class RunState(_Record):
    """A run's committed progress: ``runs/{run_id}/state.json``. Its version is the last visit's (one committed
    version per visit, in order): a state whose version disagrees with its visits is damage."""
    run_id: str
    version: int = Field(0, ge=0)
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
    seq: int = Field(0, ge=0)
    """Which change of the run this state is: it is stored as ``states/{seq}.json`` (0 = the new run's state)."""
    fence: dict[str, int] = Field(default_factory=dict)
    """Lease epochs of the run's current holders (``run``, ``visit c{c}-b{b}``): a writer holding a lower epoch of
    the same lease has lost it and may change nothing (docs/DESIGN.md I7)."""

    _dataset_is_a_plain_name = field_validator("dataset")(_plain_dataset_id)

    @model_validator(mode="after")
    def _version_is_the_last_visits(self) -> "RunState":
        """Each visit commits the version after the one before it (``append_visit``), so the versions of the visits
        are 1, 2, ... and the run's is the last of them (0 with none). A number that disagrees names no manifest
        the visits made: ``prune``, ``export`` and ``resume`` would act on a version that is not the run's."""
        for i, v in enumerate(self.visits):
            if v.version != i + 1:
                raise ValueError(f"visit {i} (c{v.cycle}-b{v.block}) says version {v.version}, not {i + 1}")
        if self.version != len(self.visits):
            raise ValueError(f"the run is at version {self.version}, but its visits made {len(self.visits)}")
        return self

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


class _Section(BaseModel):
    """A part of a stored run config's record: the keys read here are checked for type, the others are the run's
    settings (``core/config.stored_config`` reads them through ``RunConfig``)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _PlanBlock(_Section):
    index: int | None = Field(None, ge=0)


class _Plan(_Section):
    blocks: list[_PlanBlock] = Field(default_factory=list)


# the layout of a run's stored config and weights (its config.json's ``format``; 1 when absent); 2: LLaMA rotates q/k
# by halves (the Hugging Face convention). tasks/run.py writes it; a run of a newer format is not this bcdflow's to read
RUN_FORMAT = 2


class StoredConfig(_Section):
    """The run record's own keys of ``runs/{id}/config.json``, beside the settings the run was made with (those are
    ``core/config.RunConfig``'s, read back by ``core/config.stored_config``): each of these of the right type, else
    the config is damaged (:class:`RunStateError` naming the file and the key). ``prune``, ``rm``, ``export`` and
    ``generate`` read the plan and the dataset from here."""
    mode: Literal["bcd", "full"] | None = None
    dataset: str | None = None
    plan: _Plan | None = None
    model_resolved: dict | None = None
    hf: dict | None = None

    _dataset_is_a_plain_name = field_validator("dataset")(_plain_dataset_id)


def _what(e: ValidationError) -> str:
    """The first problem of a record that did not validate: where in it, and what."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return "not valid JSON (truncated?)"
    where = ".".join(map(str, err["loc"]))
    return f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}"[:300]


def read_config(store: Store, run_id: str) -> dict[str, Any]:
    """The run's stored config (a dict, as written), its keys that the store's readers use checked
    (:class:`StoredConfig`); RunStateError naming the file and the key when it is missing or damaged."""
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
    try:
        StoredConfig.model_validate(config)
    except ValidationError as e:
        raise RunStateError(f"run config {store.url_of(key)} is damaged ({_what(e)}); restore the object or start "
                            "a new run with another --run-id") from None
    return config


def _parse(store: Store, key: str, data: bytes) -> RunState:
    try:
        return RunState.model_validate_json(data)
    except ValidationError as e:
        raise RunStateError(f"run state {store.url_of(key)} is damaged ({_what(e)}); restore the object from a copy, "
                            "or start a new run with another --run-id") from None


def read_state(store: Store, run_id: str) -> RunState | None:
    """The run's current state (the highest state object), or None when the run does not exist.

    ``state.json`` is read too: it is the state of a run made before ``states/`` existed, and otherwise a copy of
    a state object, used when it is the current one (one read instead of two); a damaged copy is reported."""
    copy = None
    try:
        copy = _parse(store, state_key(run_id), store.read_bytes(state_key(run_id)))
    except FileNotFoundError:
        pass
    seqs = [q for n in store.listdir(states_key(run_id)) if (q := state_seq(n)) is not None]
    if not seqs or (copy is not None and copy.seq >= max(seqs)):
        return copy
    key = state_key(run_id, max(seqs))
    try:
        state = _parse(store, key, store.read_bytes(key))
    except FileNotFoundError:  # never deleted; a listing that raced a copy of the store
        raise RunStateError(f"run state {store.url_of(key)} was listed but cannot be read; restore it") from None
    if state.seq != max(seqs):
        raise RunStateError(f"run state {store.url_of(key)} is damaged (it says seq {state.seq})")
    return state


def check_fence(state: RunState | None, fence: dict[str, int], what: str) -> None:
    """LeaseLost unless every lease epoch in ``fence`` is at least the state's for the same lease."""
    for name, epoch in fence.items():
        if state is not None and state.fence.get(name, -1) > epoch:
            raise LeaseLost(f"{what}: this process held {name} lease epoch {epoch}, but run {state.run_id!r} was "
                            f"taken over (epoch {state.fence[name]}); it stops without changing the run")


def advance(store: Store, base: RunState | None, new: RunState, fence: dict[str, int] | None = None,
            drop: tuple[str, ...] = ()) -> RunState:
    """Make ``new`` the run's state: the one conditional operation that changes a run (docs/DESIGN.md §2.5).

    ``base`` is the state the writer read (None for a new run); ``new`` is stored as state ``base.seq + 1`` (0),
    created only if absent, with ``fence`` (the writer's lease epochs) merged into the base's (``drop``: fence
    entries that end here, a committed visit's). LeaseLost when the writer's epochs are stale or another writer
    made that state first; an object already there with exactly these bytes is this writer's own earlier write
    (a retry whose reply was lost), which is success."""
    fence = fence or {}
    check_fence(base, fence, f"run {new.run_id!r}")
    merged = {k: v for k, v in {**(base.fence if base else {}), **fence}.items() if k not in drop}
    out = new.model_copy(update={"seq": base.seq + 1 if base else 0, "fence": merged})
    data = out.model_dump_json(indent=2).encode()
    key = state_key(new.run_id, out.seq)
    if not store.create(data, key):
        try:
            mine = store.read_bytes(key) == data
        except FileNotFoundError:
            mine = False
        if not mine:
            raise LeaseLost(f"run {new.run_id!r}: another process changed the run first (it made "
                            f"{store.url_of(key)}); this one stops without changing it")
    store.write_bytes(data, state_key(new.run_id))  # the copy for readers; a stale copy is never the current one
    return out


def fence(store: Store, run_id: str, fence: dict[str, int]) -> RunState:
    """Write this holder's lease epochs into the run's state before it changes anything (a takeover is complete
    once this returns: no earlier holder can change the run after it). LeaseLost if a later holder fenced first."""
    while True:
        state = read_state(store, run_id)
        if state is None:
            raise RunStateError(f"run {run_id!r} has no state to fence")
        check_fence(state, fence, f"run {run_id!r}")
        if all(state.fence.get(k) == e for k, e in fence.items()):
            return state
        try:
            return advance(store, state, state, fence)
        except LeaseLost:  # another writer changed the state meanwhile: read it again and check our epochs
            continue


def write_state(store: Store, state: RunState, fence: dict[str, int] | None = None) -> RunState:
    """Set run-level fields: ``state`` becomes the state after the current one (a new run: state 0)."""
    return advance(store, read_state(store, state.run_id), state, fence)


def append_visit(store: Store, run_id: str, visit: VisitRecord, fence: dict[str, int] | None = None,
                 base: RunState | None = None, drop: tuple[str, ...] = ()) -> RunState:
    """Record a committed visit and move the run to its version; returns the new state.

    The visit's version must be the run's version + 1, so a visit is never recorded twice, and the state it moves
    from is named (``base``, else the current one), so two writers never both commit the same version."""
    base = base or read_state(store, run_id)
    state = base or RunState(run_id=run_id)
    if visit.version != state.version + 1:
        raise RunStateError(f"visit c{visit.cycle}-b{visit.block} would commit version {visit.version}, but run "
                            f"{run_id!r} is at version {state.version}: another process committed in between")
    new = state.model_copy(update={"version": visit.version, "visits": [*state.visits, visit]})
    return advance(store, base, new, fence, drop)


def drop_committed_visits(store: Store, state: RunState) -> list[str]:
    """Remove the working objects (``visits/c{c}-b{b}/``: activations, mid-visit checkpoint, lease, outcome) of
    every visit ``state`` holds committed; returns the folders' names. A visit drops its own after its commit
    (flows/visit.py), so only a process that died in between leaves them, and nothing reads them again (a resume
    skips a committed visit). A folder of a visit the state does not hold is never touched: it may be training
    on a worker of the fleet, or hold the mid-visit checkpoint its next attempt resumes from (docs/DESIGN.md §2.6)."""
    done = state.done_visits
    names = [n for n in store.listdir(visits_key(state.run_id)) if parse_visit(n) in done]
    for name in names:
        store.rm(visits_key(state.run_id), name)
    return names


def _has_states(store: Store, run_id: str) -> bool:
    return bool(store.listdir(states_key(run_id)))


def run_exists(store: Store, run_id: str) -> bool:
    return store.exists(config_key(run_id)) or store.exists(state_key(run_id)) or _has_states(store, run_id)


def list_runs(store: Store) -> list[str]:
    return [r for r in store.listdir(RUNS) if is_run_id(r) and run_exists(store, r)]
