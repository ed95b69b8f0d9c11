"""Run state: the resolved config and the list of committed visits (DESIGN §2 step 5, §5).

    runs/{run_id}/config.json   the resolved run config (written once, before the first visit)
    runs/{run_id}/state.json    {"run_id", "version", "status", "visits": [{cycle, block, version, ...}], ...}

``state.json`` is the commit point of a visit: it is written last, after the block file and the version
manifest, and each write replaces the whole object atomically (``Store.write_bytes``). A crash before it leaves
the run at the previous version; a resumed run reads it to know which visits are done (DESIGN §3 I4).
"""
from __future__ import annotations

from typing import Any

from .store import Store

VISIT_KEYS = ("cycle", "block", "version")


def _key(run_id: str, name: str) -> str:
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"run_id must be a non-empty name without '/', got {run_id!r}")
    return f"runs/{run_id}/{name}"


def write_config(store: Store, run_id: str, config: dict[str, Any]) -> None:
    store.write_json(config, _key(run_id, "config.json"))


def read_config(store: Store, run_id: str) -> dict[str, Any]:
    key = _key(run_id, "config.json")
    if not store.exists(key):
        raise FileNotFoundError(f"run config {store.url_of(key)} not found")
    return store.read_json(key)


def new_state(run_id: str, **extra: Any) -> dict[str, Any]:
    """The state of a run with no committed visit: version 0 is the initial model."""
    return {"run_id": run_id, "version": 0, "status": "running", "visits": [], **extra}


def read_state(store: Store, run_id: str) -> dict[str, Any] | None:
    key = _key(run_id, "state.json")
    return store.read_json(key) if store.exists(key) else None


def write_state(store: Store, run_id: str, state: dict[str, Any]) -> None:
    if state.get("run_id", run_id) != run_id:
        raise ValueError(f"state belongs to run {state['run_id']!r}, not {run_id!r}")
    store.write_json({**state, "run_id": run_id}, _key(run_id, "state.json"))


def append_visit(store: Store, run_id: str, visit: dict[str, Any]) -> dict[str, Any]:
    """Record a committed visit and move the run to its version; returns the new state.

    The visit's version must be newer than the run's, so a visit is never recorded twice."""
    missing = [k for k in VISIT_KEYS if k not in visit]
    if missing:
        raise ValueError(f"visit is missing {', '.join(missing)} (required: {', '.join(VISIT_KEYS)})")
    state = read_state(store, run_id) or new_state(run_id)
    if int(visit["version"]) <= int(state["version"]):
        raise ValueError(f"visit version {visit['version']} is not newer than run {run_id!r} "
                         f"version {state['version']}")
    state = {**state, "version": int(visit["version"]), "visits": [*state.get("visits", []), dict(visit)]}
    write_state(store, run_id, state)
    return state


def run_exists(store: Store, run_id: str) -> bool:
    return store.exists(_key(run_id, "config.json")) or store.exists(_key(run_id, "state.json"))


def list_runs(store: Store) -> list[str]:
    return [r for r in store.listdir("runs") if run_exists(store, r)]
