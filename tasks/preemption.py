"""What a preempted visit does once its checkpoint is written: the Prefect half of ``core/stop_signals.py``.

A spot rental's SIGTERM reaches the flow-run process a Prefect worker started (``python -m prefect.engine``).
Prefect 3.8.8 does not reschedule that process's run on its own (``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR`` is
read only by the ``prefect flow-run execute`` supervisor, which SIGKILLs an engine whose SIGTERM handler is ours),
so the visit does it: it proposes ``AwaitingRetry`` for the run the worker started (``PREFECT__FLOW_RUN_ID``: the
visit's own run, or the parent's when visits are subflows), ``fleet.reschedule_delay_s`` ahead so the worker of
the machine going away does not take it back, and raises ``Pause``, which the engine turns into a clean exit
without a state of its own. Any worker on the pool then runs it again, and it resumes from the checkpoint. A run
being cancelled is not rescheduled; outside a worker the signal is handed on (exit 143).
"""
from __future__ import annotations

import os
import signal
from datetime import datetime, timedelta, timezone
from uuid import UUID

from bcdflow.core import stop_signals


def after_checkpoint(delay_s: float) -> None:
    """Call once the loop stopped on a signal and its checkpoint is written; never returns."""
    sig = stop_signals.signal_received()
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run_id:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import Pause
        from prefect.states import AwaitingRetry
        from prefect.utilities.engine import propose_state_sync

        with get_client(sync_client=True) as client:
            current = client.read_flow_run(UUID(flow_run_id)).state
            if current is not None and not (current.is_cancelling() or current.is_final()):
                when = datetime.now(timezone.utc) + timedelta(seconds=delay_s)
                state = propose_state_sync(client, AwaitingRetry(
                    scheduled_time=when, message="preempted (SIGTERM); continues from its checkpoint"),
                    flow_run_id=UUID(flow_run_id))
                if state.is_scheduled():
                    raise Pause(state=state)
    stop_signals.hand_on()
