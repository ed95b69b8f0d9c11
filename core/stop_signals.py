"""Spot preemption and Ctrl-C: on SIGTERM or SIGINT the trainer finishes its current step, writes a checkpoint
and stops.

While a training loop runs (``with training():``), handlers for SIGTERM and SIGINT are chained in front of
whatever was installed. They only raise a flag that the loop polls after each step. After the checkpoint the
caller decides what happens next (``signal_received()``): a Ctrl-C becomes ``KeyboardInterrupt`` (the CLI exits
130 with the resume line); a SIGTERM under a Prefect worker reschedules the flow run (tasks/preemption.py), and
otherwise ``hand_on()`` gives it to the handler installed before (or exits 143). Outside training (pre-inference
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
                signal.signal(sig, _previous[sig])  # kept: hand_on() passes the signal to it


def signal_received() -> int | None:
    """The signal that stopped the loop (and clears it): SIGTERM or SIGINT."""
    global _signal
    sig, _signal = _signal, None
    _requested.clear()
    return sig


def hand_on() -> None:
    """SIGTERM, after the checkpoint, outside a worker: the handler installed before ours, or exit 143."""
    prev = _previous.get(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
        prev(signal.SIGTERM, None)
    raise Preempted()
