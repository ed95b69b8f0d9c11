"""Visits as deployment runs on a GPU work pool (``fleet.visit_pool``; docs/DESIGN.md §6).

The parent submits the visit as a run of the deployment ``bcd-visit/{pool}`` (prefect.yaml) with the visit's ids
and the flat config form, waits for it, and reads the committed record from the store: any worker on the pool
may run it, and the store is all they share. A run that crashed or failed for a machine reason (its worker was
killed, its box vanished) is submitted again, up to ``fleet.visit_retries`` times, and continues from its
mid-visit checkpoint; one that failed on bad input or a damaged artifact is not (the visit says which in its
``outcome.json``). A run rescheduled after SIGTERM (tasks/preemption.py) is simply still running for this wait:
another worker picks it up. A run left Running by a machine that vanished without a word (no worker left to mark
it crashed) is recognised by its visit lease, which stops being renewed.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Crashed

from bcdflow.core.config import RunConfig
from bcdflow.core.context import open_store
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.flows.visit import committed, visit_lease, visit_run_name
from bcdflow.storage import layout, runs
from bcdflow.storage.runs import VisitRecord


class VisitFailed(RuntimeError):
    """A visit kept failing for machine reasons through its resubmissions."""


def deployment_name(pool: str) -> str:
    return f"bcd-visit/{pool}"


def dispatch_visit(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str,
                   run_epoch: int | None = None) -> VisitRecord:
    log = get_run_logger()
    store = open_store(cfg)
    fleet = cfg.fleet
    params = {"run_id": run_id, "cycle": cycle, "block": block, "base_version": version, "dataset_id": dataset_id,
              "config": cfg.model_dump(mode="json"), "run_epoch": run_epoch}
    last = None
    for attempt in range(fleet.visit_retries + 1):
        fr = run_deployment(deployment_name(fleet.visit_pool), parameters=params,
                            job_variables=json.loads(fleet.job_variables) or None, flow_run_name=visit_run_name(run_id, cycle, block),
                            tags=[f"run:{run_id}", f"cycle:{cycle}", f"block:{block}"], timeout=0, as_subflow=True)
        fr = _wait_for(cfg, store, run_id, cycle, block, fr.id)
        state = runs.read_state(store, run_id)
        if state is not None and (rec := committed(state, cycle, block)):
            # done, also when it committed just before its machine went away: then its working objects are left,
            # and its flow run, which is final, will not remove them (docs/DESIGN.md §2.6)
            store.rm(layout.visit_key(run_id, cycle, block))
            return rec
        outcome = _outcome(store, run_id, cycle, block, str(fr.id))
        if outcome and outcome["kind"] == "bad_input":
            raise BadInput(outcome["message"])
        if outcome and outcome["kind"] == "damaged":
            raise DamagedArtifact(outcome["message"])
        if fr.state is not None and fr.state.is_cancelled():
            raise KeyboardInterrupt(f"visit c{cycle}-b{block} was cancelled")
        last = outcome["message"] if outcome else f"{fr.state.type.value if fr.state else '?'}: " \
                                                   f"{fr.state.message if fr.state else ''}"
        if attempt == fleet.visit_retries:
            break
        # a crashed holder's lease may still be live (another machine): wait it out, then submit again
        wait = visit_lease(cfg, store, run_id, cycle, block).expires_in()
        log.warning("visit c%d-b%d (flow run %s) did not commit (%s); submitting it again%s (%d of %d)", cycle,
                    block, fr.id, last, f" in {wait:.0f} s, when its lease expires" if wait else "", attempt + 1,
                    fleet.visit_retries)
        time.sleep(wait)
    raise VisitFailed(f"visit c{cycle}-b{block} of run {run_id!r} did not commit in {fleet.visit_retries + 1} "
                      f"attempts (last: {last})")


def _wait_for(cfg: RunConfig, store, run_id: str, cycle: int, block: int, flow_run_id):
    """The visit's flow run once it is final. Scheduled or pending, it waits for a worker however long that takes;
    rescheduled after SIGTERM, it is simply scheduled again. Running, it is alive while it keeps its lease: a run
    whose lease stopped being renewed (its process or machine is gone, and no worker is left to say so) or that
    never took one within a few leases of starting is marked crashed, so it can be submitted again."""
    lease = visit_lease(cfg, store, run_id, cycle, block)
    ttl = cfg.fleet.lease_seconds
    seen: set[int] = set()  # attempts seen holding the lease: its disappearance later is the commit's cleanup
    with get_client(sync_client=True) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            if fr.state is None or fr.state.is_final():
                return fr
            if fr.state.is_running():
                cur = lease.current() or {}
                owner = cur.get("owner", {})
                ours = owner.get("flow_run_id") == str(flow_run_id) and owner.get("attempt") == fr.run_count
                running = (datetime.now(timezone.utc) - fr.state.timestamp).total_seconds()  # this attempt's
                if ours:
                    seen.add(fr.run_count)
                # judged by our own clock: no change of its lease object for a ttl (0: released, the attempt is ending)
                stale = ours and cur["expires"] != 0 and lease.unrenewed_for(cur) >= ttl
                if stale or (not ours and fr.run_count not in seen and running > 3 * ttl + 120):
                    client.set_flow_run_state(flow_run_id, Crashed(
                        message=f"no lease renewal for {ttl:.0f} s: its process or machine is gone"), force=True)
                    continue
            time.sleep(cfg.fleet.poll_seconds)


def _outcome(store, run_id: str, cycle: int, block: int, flow_run_id: str) -> dict | None:
    """What this visit run said about its failure, if it said anything (crashes say nothing)."""
    key = layout.outcome_key(run_id, cycle, block)
    try:
        outcome = store.read_json(key)
    except FileNotFoundError:
        return None
    return outcome if outcome.get("flow_run_id") == flow_run_id else None
