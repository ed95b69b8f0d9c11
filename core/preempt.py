"""Spot preemption and Ctrl-C: on SIGTERM or SIGINT the trainer finishes its current step, writes a checkpoint
and stops.

While a training loop runs (``with training():``), handlers for SIGTERM and SIGINT are chained in front of
whatever was installed (for SIGTERM, Prefect's own handler when a worker runs the flow with
``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule``). They only raise a flag that the loop polls after each
step; after the checkpoint, ``finish()`` hands SIGTERM on to the previous handler (or exits 143), and turns
SIGINT into ``KeyboardInterrupt`` (the CLI exits 130 with the resume line). Outside training (pre-inference
shards are atomic and reused) the previous handlers see the signals directly. Prefect runs sync flows and
directly called tasks on the main thread, the only thread that may install signal handlers.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_requested = threading.Event()
_signal: int | None = None
_previous: dict[int, object] = {}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Raised after the checkpoint when no other SIGTERM handler takes over."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _handler(signum, frame) -> None:
    global _signal
    _signal = signum
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


@contextmanager
def training():
    main = threading.current_thread() is threading.main_thread()
    if main:
        for sig in SIGNALS:
            _previous[sig] = signal.signal(sig, _handler)
    try:
        yield
    finally:
        if main:
            for sig in SIGNALS:
                signal.signal(sig, _previous[sig])  # kept: finish() hands the signal on to it


def finish() -> None:
    """Call after the interruption checkpoint is written: hand the signal on."""
    global _signal
    sig, _signal = _signal, None
    _requested.clear()
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    prev = _previous.get(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
        prev(signal.SIGTERM, None)
    raise Preempted()
