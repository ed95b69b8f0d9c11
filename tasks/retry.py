"""Prefect retry policy for tasks that touch the store or a device: exponential backoff with jitter for
transient faults (a flaky object store, a lost connection). Bad input and damaged artifacts are never
retried, since waiting cannot fix them (``bcdflow.errors``). ``BCDFLOW_RETRY_BACKOFF`` (seconds, default 2)
scales the delays: 2, 4, 8, ... s."""
from __future__ import annotations

import os

from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from bcdflow.errors import BadInput, DamagedArtifact


def _transient(task, task_run, state) -> bool:
    return not isinstance(state.data, (BadInput, DamagedArtifact, SystemExit, KeyboardInterrupt))


def retrying(retries: int = 3) -> dict:
    """Keyword arguments for ``@task``: retries with backoff, no result cache (the store is the cache)."""
    backoff = float(os.environ.get("BCDFLOW_RETRY_BACKOFF", "2"))
    return {"retries": retries, "retry_delay_seconds": exponential_backoff(backoff_factor=backoff),
            "retry_jitter_factor": 0.5, "retry_condition_fn": _transient, "cache_policy": NO_CACHE}
