"""Named crash points for the kill -9 tests (docs/DESIGN.md I4): ``BCDFLOW_FAILPOINTS=name[:n[:action]],...`` makes
the process SIGKILL itself (``kill``, the default) or SIGSTOP itself (``stop``: frozen until a SIGCONT, as a GC pause
or a suspended laptop freezes it) at the n-th (default first) time it reaches ``hit(name)``. Unset: a dict lookup.
With ``BCDFLOW_FAILPOINTS_ONCE=PATH`` only the first process to fire creates PATH and dies; the others (a Dask
worker started in its place, the other workers) go on.

Points: ``preinfer-computed`` (a shard computed, not yet written), ``preinfer-shard`` (a shard written),
``train-checkpoint`` (a mid-visit checkpoint written), ``before-commit`` (block file written, manifest and
state not yet), ``commit-checked`` (a commit's state read and its lease epochs checked, before its first write), ``after-commit``
(the visit's state created, its working objects not yet removed).
"""
from __future__ import annotations

import os
import signal
import threading

_counts: dict[str, int] = {}
_lock = threading.Lock()


def hit(name: str) -> None:
    spec = os.environ.get("BCDFLOW_FAILPOINTS")
    if not spec:
        return
    for item in spec.split(","):
        point, _, rest = item.partition(":")
        nth, _, action = rest.partition(":")
        if point == name:
            with _lock:
                _counts[name] = _counts.get(name, 0) + 1
                fire = _counts[name] == int(nth or 1) and _first()
            if fire:  # outside the lock: a stopped process resumes here on SIGCONT
                os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)


def _first() -> bool:
    once = os.environ.get("BCDFLOW_FAILPOINTS_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
