"""Spot preemption: on SIGTERM the trainer finishes its current step, writes a checkpoint and exits.

``install()`` chains a SIGTERM handler in front of whatever was there (Prefect's own handler when a
worker runs the flow with ``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule``). While a training
loop runs, the handler only raises a flag that the loop polls after each step; after the checkpoint,
``finish()`` hands the signal on (Prefect reschedules the run), or exits with 143 when nothing else
handles it. Outside training (pre-inference shards are atomic and reused) the signal is handed on at once.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_active = threading.Event()
_requested = threading.Event()
_previous = None
_installed = False


class Preempted(SystemExit):
    """Raised after the checkpoint when no other SIGTERM handler takes over."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def install() -> None:
    global _previous, _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _previous = signal.signal(signal.SIGTERM, _handler)
    _installed = True


def _handler(signum, frame) -> None:
    if _active.is_set():
        _requested.set()
        return
    _hand_on(signum, frame)


def _hand_on(signum, frame) -> None:
    if callable(_previous) and _previous not in (signal.SIG_DFL, signal.SIG_IGN):
        _previous(signum, frame)
    raise Preempted()


def requested() -> bool:
    return _requested.is_set()


@contextmanager
def training():
    _active.set()
    try:
        yield
    finally:
        _active.clear()


def finish() -> None:
    """Call after the interruption checkpoint is written."""
    _requested.clear()
    _hand_on(signal.SIGTERM, None)
