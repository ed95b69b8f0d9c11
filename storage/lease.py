"""One writer per run, and per visit (docs/DESIGN.md I7): a lease object in the store names the process that owns it.

    {key}/lease/{epoch:012d}.json    {"epoch", "token", "ttl", "expires": t,
                                      "owner": {host, pid, started, flow_run_id, attempt, boot_id, pid_ns}}

Acquiring makes epoch n + 1 with an exclusive create (``Store.create``: a hard link on a local disk, a conditional
PUT on S3), so of two processes taking a lease at once exactly one succeeds, and it is then kept alive by
rewriting its own epoch object every ``ttl / 3`` seconds. The current lease is the highest epoch. An observer
judges a lease on its own monotonic clock, never by comparing ``expires`` (the holder's wall clock) with its own:
the lease is free once the observer has seen its object unchanged for a ttl (its owner died or stopped renewing),
when it was released, or at once when its owner is provably a process of this machine (same boot id and pid
namespace) that no longer exists (a ``kill -9`` here need not wait out the ttl). So taking over from a holder that
died elsewhere costs the taker one ttl of watching, however long ago the holder died.
A holder that finds a higher epoch than its own has lost the lease (it was too slow to renew) and must stop
before it commits anything. A holder whose renewals fail stops its work once the lease could expire: its training
asks ``lost_lease()`` after every step, which names any lease this process holds that another process has taken or
that was not renewed for two thirds of its ttl by this process's monotonic clock (docs/DESIGN.md §9).

    lease = Lease(store, "runs/r1", "run r1", ttl=60, owner={"flow_run_id": ...})
    with lease.held():          # LeaseHeld (bad input: one line naming the owner) if another process has it
        ...; lease.check()      # LeaseLost before a commit if another process took over
        check_leases()          # LeaseLost in the step loop (any lease held here) once one could have expired
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bcdflow.constants import MAX_LEASE_SECONDS
from bcdflow.errors import BadInput, DamagedArtifact

from .layout import lease_epoch, lease_key
from .store import Store

log = logging.getLogger(__name__)


class LeaseHeld(BadInput):
    """Another live process holds the lease: the message names it (host, pid, flow run) and when it expires."""

    def __init__(self, what: str, lease: dict):
        self.lease = lease
        o = lease.get("owner", {})
        until = datetime.fromtimestamp(lease.get("expires", 0), timezone.utc).strftime("%H:%M:%S UTC")
        run = f", flow run {o['flow_run_id']}" if o.get("flow_run_id") else ""
        super().__init__(f"{what} is in use by {o.get('host', '?')} pid {o.get('pid', '?')}{run} (its lease is "
                         f"renewed while it works; it expires at {until} if that process is gone): wait for it, "
                         "or stop it first")


class LeaseLost(DamagedArtifact):
    """This process's lease was taken over by another one, or could have been: it stops without committing."""


class LeaseDamaged(DamagedArtifact):
    """A lease object that is not one a holder writes (not an object, times that are no times, another epoch)."""


class _LeaseOwner(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    host: str | None = None
    pid: int | None = Field(None, ge=0)
    started: float | None = Field(None, ge=0)
    flow_run_id: str | None = None
    attempt: int | None = Field(None, ge=0)


# the latest time a lease object may name: the last second datetime can print (a holder writes now + ttl)
_LAST_TIME = 253402300799.0


class LeaseRecord(BaseModel):
    """A lease object as ``Lease`` writes it (module docstring), checked wherever one is read: a stored ttl is trusted
    only up to ``MAX_LEASE_SECONDS`` (what ``fleet.lease_seconds`` allows), so no object makes an observer wait
    longer; anything else out of range is damage (``LeaseDamaged``), never a traceback or an endless wait."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    epoch: int = Field(ge=0)
    token: str
    ttl: float = Field(gt=0)
    expires: float = Field(ge=0, le=_LAST_TIME)
    owner: _LeaseOwner = Field(default_factory=_LeaseOwner)


def read_lease(store: Store, key: str, name: str) -> dict:
    """The lease object ``name`` under ``{key}/lease/``, checked (``LeaseRecord``), its ttl cut to the bound.
    FileNotFoundError when it is gone; LeaseDamaged naming it when it is not a lease object."""
    data = store.read_bytes(lease_key(key), name)
    try:
        obj = json.loads(data)
        rec = LeaseRecord.model_validate(obj)
        if rec.epoch != lease_epoch(name):
            raise ValueError(f"it says epoch {rec.epoch}, its name {lease_epoch(name)}")
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        why = f"{where + ': ' if where else ''}{err['msg']}"
    except (ValueError, UnicodeDecodeError) as e:
        why = str(e) if "epoch" in str(e) else f"not valid JSON: {e}"
    else:
        return {**obj, "ttl": min(rec.ttl, MAX_LEASE_SECONDS)}
    raise LeaseDamaged(f"lease {store.url_of(lease_key(key), name)} is damaged ({why[:200]}): no process holds it "
                       "by this object; remove the run with bcdflow rm, or restore the object")


# a process in one of these states does not renew its lease (SIGSTOP, a debugger, exited): watched, not trusted
_NOT_RUNNING = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)

# the leases this process holds (``Lease.held``): what its training polls between steps (``lost_lease``)
_holding: list["Lease"] = []
_holding_lock = threading.Lock()


def lost_lease() -> LeaseLost | None:
    """LeaseLost for the first lease this process holds that it can no longer count on (``Lease.lapsed``), else
    None. Cheap (no store request): the step loop asks after every step (tasks/train.py)."""
    with _holding_lock:
        held = list(_holding)
    for lease in held:
        if why := lease.lapsed():
            return LeaseLost(why)
    return None


def check_leases() -> None:
    """Raise ``lost_lease()`` if there is one: before a holder writes anything more (a mid-visit checkpoint)."""
    if (lost := lost_lease()) is not None:
        raise lost


def machine() -> dict[str, Any]:
    """What makes a pid mean the same process to two observers: the kernel's boot id and the pid namespace (a
    hostname does not: containers share one with separate pid namespaces). Empty where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return {"boot_id": boot, "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    except OSError:
        return {}


def this_process(flow_run_id: str | None = None, attempt: int | None = None) -> dict[str, Any]:
    """Who we are, as a lease names its owner (``attempt``: the flow run's run count, which a rescheduled or
    retried run increments, so its dispatcher can tell this attempt's lease from an earlier one's)."""
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time(),
            "flow_run_id": flow_run_id, "attempt": attempt, **machine()}


def _owner_here(lease: dict) -> tuple[bool, psutil.Process | None]:
    """(whether the lease's owner is provably of this machine: same boot id and pid namespace, its process if it
    still runs: same pid and start time). A hostname proves nothing: containers share one."""
    o = lease.get("owner") or {}
    mine = machine()
    if not mine or not all(o.get(k) == v for k, v in mine.items()):
        return False, None
    try:
        proc = psutil.Process(int(o["pid"]))
        return True, proc if abs(proc.create_time() - float(o["started"])) <= 1e-3 else None
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return True, None


class Lease:
    """A lease on ``{key}/lease/``: ``what`` names the leased thing in messages ("run r1", "visit c0-b1 of r1")."""

    def __init__(self, store: Store, key: str, what: str, ttl: float = 60.0, owner: dict | None = None):
        self.store, self.key, self.what, self.ttl = store, key.rstrip("/"), what, float(ttl)
        self.owner = owner or this_process()
        self.token = uuid.uuid4().hex
        self.epoch: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None
        self._renewed = 0.0  # time.monotonic() of our last write of the lease object
        self._seen: tuple | None = None  # the other holder's lease as we last saw it, and since when (monotonic)
        self._seen_at = 0.0

    # -- reading -------------------------------------------------------------------------------------------
    def current(self) -> dict | None:
        """The highest-epoch lease object, or None when the thing was never leased."""
        names = [n for n in self.store.listdir(lease_key(self.key)) if lease_epoch(n) is not None]
        for name in sorted(names, key=lease_epoch, reverse=True):
            try:
                return read_lease(self.store, self.key, name)  # LeaseDamaged: one line naming it
            except FileNotFoundError:  # removed meanwhile (an older epoch dropped by the next holder): look again
                continue
        return None

    def unrenewed_for(self, lease: dict) -> float:
        """Seconds, by this process's monotonic clock, since this observer first saw ``lease`` as it is now (its
        epoch, token and expiry); a renewal rewrites the expiry, so it starts again at 0. Clocks of other machines
        never enter: a holder is judged by whether it renews, as Kubernetes' leader election judges it."""
        sig = (lease.get("epoch"), lease.get("token"), lease.get("expires"))
        now = time.monotonic()
        if sig != self._seen:
            self._seen, self._seen_at = sig, now
        return now - self._seen_at

    def _free(self, lease: dict | None) -> bool:
        if lease is None or lease.get("token") == self.token or lease.get("expires", 0) == 0:  # 0: released
            return True
        here, proc = _owner_here(lease)
        if here and proc is None:
            return True  # a dead owner of this machine (or its pid is another process now) frees it at once
        return self.unrenewed_for(lease) >= float(lease.get("ttl", self.ttl))

    def _renewing_here(self, lease: dict) -> bool:
        """Whether the holder is provably a running process of this machine that renewed within half a ttl:
        ``expires`` was written by this machine's own clock, so it can be compared with ours. A second ``train`` or
        ``resume`` of a live run here then stops at once instead of watching for the next renewal (up to a third of
        the ttl); a holder elsewhere, or a stopped one here (SIGSTOP: it renews no more), is watched."""
        _, proc = _owner_here(lease)
        try:
            if proc is None or proc.status() in _NOT_RUNNING:
                return False
            return time.time() - (float(lease["expires"]) - float(lease["ttl"])) < float(lease["ttl"]) / 2
        except (psutil.Error, KeyError, ValueError, TypeError):
            return False

    def holder(self) -> dict | None:
        """The current lease object while a live process other than this one holds it (its ``owner``: host, pid,
        flow run), else None: never leased, expired, released, or its owner on this machine is gone."""
        cur = self.current()
        return None if self._free(cur) else cur

    def expires_in(self) -> float:
        """Seconds until the current holder's lease expires, as this observer judges it (0 when it is free)."""
        cur = self.current()
        return 0.0 if self._free(cur) else max(0.0, float(cur.get("ttl", self.ttl)) - self.unrenewed_for(cur))

    # -- holding -------------------------------------------------------------------------------------------
    def _write(self) -> None:
        t = time.monotonic()
        self.store.write_json(self._body(), lease_key(self.key, self.epoch))
        self._renewed = t

    def _body(self, expires: float | None = None) -> dict:
        return {"epoch": self.epoch, "token": self.token, "owner": self.owner, "ttl": self.ttl,
                "expires": time.time() + self.ttl if expires is None else expires}

    def acquire(self) -> "Lease":
        """Take the lease. Held by another process: watch it for up to its ttl (polling); a renewal seen means the
        holder lives (LeaseHeld at once), none for a whole ttl means it is gone (take it). A lease folder reached
        through a symbolic link is refused first (UnsafeName naming it): its object would be written outside the
        store (docs/DESIGN.md §5)."""
        self.store.check_confined(lease_key(self.key), act="writes no lease through a link; nothing was written (make "
                                                           "it a plain folder or remove it)")
        cur = self.current()
        first = None
        while not self._free(cur):
            if self._renewing_here(cur):
                raise LeaseHeld(self.what, cur)  # a live process of this machine that renews: no need to watch
            sig = (cur.get("epoch"), cur.get("token"), cur.get("expires"))
            if first is not None and sig != first:
                raise LeaseHeld(self.what, cur)  # renewed while we watched: alive
            first = sig
            time.sleep(min(1.0, float(cur.get("ttl", self.ttl)) / 10))
            cur = self.current()
        self.epoch = 0 if cur is None else int(cur["epoch"]) + 1
        data = json.dumps(self._body(), indent=2).encode()
        t = time.monotonic()
        if not self.store.create(data, lease_key(self.key, self.epoch)):
            raise LeaseHeld(self.what, self.current() or {})  # another process took this epoch first
        self._renewed = t
        for name in self.store.listdir(lease_key(self.key)):  # older epochs are history
            if (e := lease_epoch(name)) is not None and e < self.epoch - 1:
                self.store.rm(lease_key(self.key), name)
        return self

    def renew(self) -> None:
        """Push the expiry out by ``ttl``; LeaseLost if another process holds a later epoch."""
        cur = self.current()
        if cur is None or cur.get("token") != self.token:
            self._lost = f"{self.what}: another process took over its lease ({(cur or {}).get('owner')}); this " \
                         "one stops without committing"
            raise LeaseLost(self._lost)
        self._write()

    def lapsed(self) -> str | None:
        """Why this holder must stop its work now, or None: another process took the lease over (the keep-alive
        saw it), or it was not renewed for ``ttl - margin`` seconds by this process's monotonic clock (renewals
        failing or hanging, the process paused), so it could expire, and be taken, before the work in flight ends.
        ``margin`` is a third of the ttl (the renewal period: two renewals in a row did not succeed), left for the
        step in flight, and a checkpoint begun before the lapse, to end within the lease. The clock starts before
        each successful write, so it runs ahead of any observer's (which starts when it reads the object)."""
        if self._lost:
            return self._lost
        if self.epoch is None:
            return None
        late = time.monotonic() - self._renewed
        if late < self.ttl - self.ttl / 3:
            return None
        return (f"{self.what}: its lease was not renewed for {late:.1f} s (ttl {self.ttl:g} s), so it could expire "
                "and be taken over; this one stops its work without committing")

    def check(self, margin: float | None = None) -> None:
        """Before a commit: raise LeaseLost unless we still hold the lease for at least ``margin`` seconds."""
        margin = self.ttl / 3 if margin is None else margin
        if self._lost:
            raise LeaseLost(self._lost)
        if self.epoch is not None and time.monotonic() - self._renewed >= self.ttl:
            # not renewed for a ttl (a paused process, a store down): another process may have taken over
            raise LeaseLost(f"{self.what}: its lease was not renewed for {time.monotonic() - self._renewed:.0f} s "
                            f"(ttl {self.ttl:g} s), so another process may hold it; this one stops without committing")
        cur = self.current()
        if cur is None or cur.get("token") != self.token:
            raise LeaseLost(f"{self.what}: another process took over its lease ({(cur or {}).get('owner')}); this "
                            "one stops without committing")
        if cur["expires"] - time.time() < margin:
            self.renew()

    def release(self) -> None:
        """Expire our lease now (when we still hold it), so the next process need not wait out the ttl."""
        if self.epoch is None:
            return
        cur = self.current()
        if cur is not None and cur.get("token") == self.token:
            self.store.write_json(self._body(expires=0.0), lease_key(self.key, self.epoch))
        self.epoch = None

    def drop(self) -> None:
        """Remove everything under the leased key, the lease objects last, instead of releasing the lease: the
        thing it leased never came to exist (a run refused before its first state leaves nothing behind,
        docs/DESIGN.md §8). Only while this process holds the current lease; the keep-alive stops first."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        cur = self.current()
        if self.epoch is None or cur is None or cur.get("token") != self.token:
            return
        for name in self.store.listdir(self.key):
            if name != "lease":
                self.store.rm(self.key, name)
        self.store.rm(lease_key(self.key))
        self.epoch = None
        if self.store.is_local:  # the folder too, unless another process wrote into it meanwhile
            with contextlib.suppress(OSError):
                os.rmdir(self.store.path(self.key))

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except LeaseLost as e:
                log.error("%s", e)
                return
            except Exception as e:  # a transient store fault: try again next period (the work stops once lapsed())
                late = time.monotonic() - self._renewed
                log.warning("%s: renewing its lease failed (%s: %s); last renewed %.1f s ago, ttl %g s%s", self.what,
                            type(e).__name__, e, late, self.ttl,
                            ": it could expire, so its work stops and commits nothing" if self.lapsed() else "")

    @contextmanager
    def held(self):
        """Acquire, renew in the background while the block runs, release at the end (also on failure)."""
        self.acquire()
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep_alive, name=f"lease {self.what}", daemon=True)
        self._thread.start()
        with _holding_lock:
            _holding.append(self)
        try:
            yield self
        finally:
            with _holding_lock:
                _holding.remove(self)
            self._stop.set()
            self._thread.join(timeout=5)
            try:
                self.release()
            except Exception:  # the store is down: the lease simply expires
                pass
