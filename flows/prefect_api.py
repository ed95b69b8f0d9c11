"""The Prefect API a bcdflow command runs its flows against: the one set (``PREFECT_API_URL``), checked to answer
before a run is created, or (unset: the embedded default) Prefect's temporary server of this process, detached into
its own session so a terminal's Ctrl-C does not kill it mid-run, with a watchdog that stops it once the command is
gone however it went; and ``PREFECT_HOME``, checked to be writable before Prefect is imported.

    check_prefect_home(); check_prefect_api()     # before a run starts (flows/cli.py)
    detach_temporary_server()                     # before the first flow call
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

from bcdflow.errors import BadInput


def detach_temporary_server() -> None:
    """Run Prefect's temporary server (used when no PREFECT_API_URL is set) in its own session. Ctrl-C in a
    terminal signals the whole foreground process group: the server would die with it and leave the run
    retrying a dead API for minutes. Detached, it outlives the interrupt, so the run reports its state and
    bcdflow exits within seconds; it still stops when bcdflow exits (Prefect's atexit hook), and when bcdflow dies
    without running it (kill -9, the OOM killer) a watchdog process stops it (``_watch``)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api.server import SubprocessASGIServer  # seconds of imports a process on a set API skips

    class _Detached(SubprocessASGIServer):
        def _run_uvicorn_command(self):
            popen = subprocess.Popen
            subprocess.Popen = functools.partial(popen, start_new_session=True)
            try:
                server = super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen
            _watch(server.pid)
            return server

    _Detached()  # registers itself as the process's temporary server (Prefect looks it up by port None)


# A watchdog beside the detached server: once the CLI is gone, however it went (kill -9, the OOM killer), it stops
# the server, which would otherwise run for ever in its own session. A separate process rather than
# PR_SET_PDEATHSIG: that fires when the thread that started the server ends, not the process.
_WATCHDOG = """
import os, signal, sys, time
cli, server = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == cli:
    time.sleep(0.5)
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        sys.exit()
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(server, sig)
    except ProcessLookupError:
        sys.exit()
    time.sleep(5)
"""


def _watch(server_pid: int) -> None:
    subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(server_pid)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def check_prefect_api() -> None:
    """A Prefect API that is set (``PREFECT_API_URL``, in the environment or a profile) must answer before a run is
    created: a stopped server left in the profile by a UI session would otherwise fail the run after it started.
    Any HTTP answer will do (a Prefect Cloud URL may ask for a key); no answer is bad input naming the setting."""
    import httpx
    from prefect.context import get_settings_context
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return  # the embedded default: a temporary server of this process
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=5.0)
    except httpx.TransportError as e:
        profile = get_settings_context().profile
        if os.environ.get("PREFECT_API_URL"):
            where, how = "in the environment", "unset PREFECT_API_URL"
        elif PREFECT_API_URL in profile.settings:
            where, how = f"in Prefect profile {profile.name!r}", "prefect config unset PREFECT_API_URL"
        else:
            where, how = "in a prefect.toml or .env file here", "remove it there"
        raise BadInput(f"PREFECT_API_URL={url} (set {where}) does not answer ({type(e).__name__}): start that Prefect "
                       f"server, or unset the setting to run on bcdflow's embedded default: {how}") from None


def check_prefect_home() -> None:
    """Prefect keeps its database, profiles and logs in ``PREFECT_HOME`` (default ``~/.prefect``): one that cannot be
    written (below a file, no permission) would make the temporary server retry for minutes. Bad input naming the
    variable, checked before Prefect is imported."""
    home = os.path.abspath(os.path.expanduser(os.environ.get("PREFECT_HOME") or "~/.prefect"))
    at = home
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    if not (os.path.isdir(at) and os.access(at, os.W_OK | os.X_OK)):
        why = "is not a directory" if at == home else f"cannot be created ({at} is not a writable directory)"
        raise BadInput(f"PREFECT_HOME: {home} {why}: set PREFECT_HOME to a writable directory "
                       "(e.g. export PREFECT_HOME=$PWD/.prefect)")
