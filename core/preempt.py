"""Spot preemption: on SIGTERM the trainer finishes its current step, writes a checkpoint and exits.

While a training loop runs (``with training():``), a SIGTERM handler is chained in front of whatever
was installed (Prefect's own handler, which reschedules the run when a worker runs it with
``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule``). It only raises a flag that the loop polls
after each step; after the checkpoint, ``finish()`` hands the signal on to the previous handler, or
exits with 143 when there is none. Outside training (pre-inference shards are atomic and reused) the
previous handler sees the signal directly. Prefect runs sync flows and tasks on the main thread,
the only thread that may install signal handlers.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_requested = threading.Event()
_previous = None


class Preempted(SystemExit):
    """Raised after the checkpoint when no other SIGTERM handler takes over."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _handler(signum, frame) -> None:
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


@contextmanager
def training():
    global _previous
    main = threading.current_thread() is threading.main_thread()
    if main:
        _previous = signal.signal(signal.SIGTERM, _handler)
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, _previous)


def finish() -> None:
    """Call after the interruption checkpoint is written: hand SIGTERM on."""
    _requested.clear()
    prev = _previous
    if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
        prev(signal.SIGTERM, None)
    raise Preempted()
