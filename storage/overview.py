"""What a store says about its runs, read without running anything: ``bcdflow runs`` and ``bcdflow status``.

    o = overview(store, run_id, planned=6, max_steps=200)   # the run's settings say how many visits, how many steps
    o["status"], o["visits_done"], o["training"]

A run's status is what its objects say (docs/DESIGN.md §5, I7): ``done`` (state.json says so), ``running`` (its run
lease is held by a live process: the lease names the owner), ``interrupted`` (neither: the process died or was
stopped; ``bcdflow resume`` continues it), ``new`` (config written, no state yet). The visit in training is the
one whose visit lease is held, or failing that the one with a mid-visit checkpoint; how far it is comes from that
checkpoint's pointer (storage/trainckpt.py), so it moves every ``checkpoint.every_steps`` steps (or less often:
``checkpoint.max_share``).
:func:`visit_spent` reads what an interrupted visit had spent (core/spend.earlier_attempts); :func:`previous_owner`
names the process a lease was taken over from. Nothing here imports torch: ``runs`` and ``status`` answer at once.
"""
from __future__ import annotations

import time

from bcdflow.errors import DamagedArtifact

from . import layout, runs
from .ckpt_pointer import POINTER as CKPT_POINTER, read_pointer
from .lease import Lease, read_lease
from .store import Store


def _holder(store: Store, key: str) -> dict | None:
    return Lease(store, key, key).holder()


def previous_owner(store: Store, key: str, epoch: int | None) -> dict | None:
    """The lease object a holder of epoch ``epoch`` of ``key``'s lease took over from (kept one epoch), or None."""
    if not epoch or not store.exists(layout.lease_key(key, epoch - 1)):
        return None
    try:
        return read_lease(store, key, layout.lease_key(key, epoch - 1).rsplit("/", 1)[-1])
    except (FileNotFoundError, DamagedArtifact):  # gone, or names no process: nothing to mark crashed
        return None


def visit_spent(store: Store, run_id: str, cycle: int, block: int, version: int,
                epoch: int | None) -> tuple[dict | None, dict | None, float | None]:
    """What visit (cycle, block) on ``version`` had spent before the attempt holding lease epoch ``epoch``, as
    ``core/spend.earlier_attempts`` takes it: the ``spent`` of its mid-visit checkpoint (one on ``version``), what
    the previous attempt knew when it started, and the last write of that attempt's lease (epoch seconds)."""
    vkey = layout.visit_key(run_id, cycle, block)
    try:
        pointer = read_pointer(store, vkey)
    except DamagedArtifact:  # the visit's checkpoint loader says so in its one line and starts over
        pointer = None
    meta = (pointer or {}).get("meta") or {}
    ckpt = meta.get("spent") if meta.get("base_version") == version else None
    skey = layout.spent_key(run_id, cycle, block)
    started = store.read_json(skey) if store.exists(skey) else None
    end = store.modified(layout.lease_key(vkey, epoch - 1)) if epoch else None
    return ckpt, started, end


def training_visit(store: Store, run_id: str, max_steps: int | None = None) -> dict | None:
    """The visit of ``run_id`` in training (or interrupted mid-visit): ``visit`` (c0-b1), ``step`` of its last
    checkpoint (None before the first), ``max_steps``, ``checkpoint_at`` (epoch seconds), ``lease_owner`` and
    ``acts_bytes``: what its activation group holds in the store so far."""
    found = []
    for name in store.listdir(layout.visits_key(run_id)):
        if (cb := layout.parse_visit(name)) is None:
            continue
        vkey = layout.visit_key(run_id, *cb)
        owner = _holder(store, vkey)
        pointer = read_pointer(store, vkey)  # damaged: one line naming it (a resume starts the visit over)
        if owner is None and pointer is None:
            continue
        at = store.modified(layout.train_ckpt_key(vkey), CKPT_POINTER) if pointer else None
        found.append({"visit": name, "cycle": cb[0], "block": cb[1], "step": pointer["step"] if pointer else None,
                      "max_steps": max_steps, "checkpoint_at": at,
                      "lease_owner": owner.get("owner") if owner else None,
                      "acts_bytes": store.size(layout.acts_key(run_id, *cb))})
    # the live one first, then the latest checkpoint
    found.sort(key=lambda v: (v["lease_owner"] is not None, v["checkpoint_at"] or 0), reverse=True)
    return found[0] if found else None


def overview(store: Store, run_id: str, planned: int | None = None, max_steps: int | None = None,
             mode: str | None = None) -> dict:
    """One run's row: mode, status, version, visits done of ``planned``, last validation loss, spend, last change
    (epoch seconds: state.json or the latest mid-visit checkpoint), the run lease's owner and the visit in training
    (of ``max_steps``). What the run's settings say (visits planned, a visit's step cap, its mode before it has a
    state) comes from the caller, who reads them through ``core/config.stored_config`` (flows/status.py)."""
    state = runs.read_state(store, run_id)
    owner = _holder(store, layout.run_key(run_id))
    if state is None:
        status = "running" if owner else "new"
    elif state.status == "done":
        status = "done"
    else:
        status = "running" if owner else "interrupted"
    training = training_visit(store, run_id, max_steps) if status != "done" else None
    changed = [t for t in (store.modified(layout.state_key(run_id)), store.modified(layout.config_key(run_id)),
                           (training or {}).get("checkpoint_at")) if t]
    visits = state.visits if state else []
    return {"run_id": run_id, "mode": (state.mode if state else mode) or "bcd", "status": status,
            "stop_reason": state.stop_reason if state else None, "version": state.version if state else 0,
            "visits_done": len(visits), "visits_planned": planned or None,
            "val_loss": visits[-1].val_loss if visits else None, "spend_usd": state.spend_usd if state else 0.0,
            "changed": max(changed) if changed else None, "lease_owner": owner.get("owner") if owner else None,
            "training": training, "mlflow_run_id": state.mlflow_run_id if state else None}


def ago(t: float | None, now: float | None = None) -> str:
    """``t`` (epoch seconds) as how long ago: 12 s, 5 min, 3 h, 2 d."""
    if t is None:
        return "–"
    s = max(0.0, (now or time.time()) - t)
    for div, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if s >= div:
            return f"{s / div:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def owner_text(owner: dict | None) -> str:
    if not owner:
        return "–"
    run = f", flow run {owner['flow_run_id']}" if owner.get("flow_run_id") else ""
    return f"{owner.get('host', '?')} pid {owner.get('pid', '?')}{run}"
