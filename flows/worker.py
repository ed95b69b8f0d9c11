"""``bcdflow worker --pool NAME``: a Prefect process worker whose flow runs get to checkpoint on SIGTERM.

A spot machine going away (``docker stop``, systemd, the provider's agent) sends SIGTERM to the worker, and
Prefect 3.8.8's worker then SIGKILLs the flow-run processes it started within a fraction of a second: no visit
could write its preemption checkpoint, and its run would stay Running. This wrapper runs ``prefect worker start``
as its child and, on SIGTERM or SIGINT, freezes the worker (SIGSTOP: it can neither kill its runs nor take one
back), sends SIGTERM to the flow-run processes (each finishes its step, checkpoints and reschedules its run:
tasks/preemption.py), waits up to ``--grace`` seconds for them, and only then stops the worker. Run it as the container's PID 1 (the Dockerfile does) or under systemd with
``KillMode=mixed``. It also tells the deployments where this machine keeps the code (``BCDFLOW_HOME``, read by
the pull step of prefect.yaml), so workers need no checkout at the path ``prefect deploy`` ran in.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# the checkout (or the installed bcdflow package): both hold flows/bcd.py, the path prefect.yaml's entrypoints name
HOME = str(Path(__file__).resolve().parents[1])


def run(pool: str, grace: float, extra: list[str]) -> int:
    env = {**os.environ, "BCDFLOW_HOME": os.environ.get("BCDFLOW_HOME", HOME)}
    prefect = shutil.which("prefect", path=os.path.dirname(sys.executable)) or "prefect"

    def defaults() -> None:  # a worker started from a script may inherit ignored signals; it must stop on them
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    worker = subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--type", "process", *extra], env=env,
                              cwd=env["BCDFLOW_HOME"], preexec_fn=defaults)

    def stop(signum, frame) -> None:
        try:
            runs = psutil.Process(worker.pid).children()  # the flow-run processes (python -m prefect.engine)
        except psutil.NoSuchProcess:
            runs = []
        if runs:
            # frozen meanwhile, the worker can neither kill its runs nor take one back (a rescheduled visit)
            worker.send_signal(signal.SIGSTOP)
            for p in runs:
                p.send_signal(signal.SIGTERM)
            _wait_gone(runs, grace)  # each checkpoints and reschedules its run meanwhile
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # delivered as it resumes: it stops before it polls again
            worker.send_signal(signal.SIGCONT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return worker.wait()


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Until every process has exited (a zombie waiting for the frozen worker to reap it counts) or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        time.sleep(0.2)
