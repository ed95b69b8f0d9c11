"""Live progress of a visit while it runs: its training steps and its pre-inference shards (docs/DESIGN.md §2.3).

    prog = visit_progress(ctx, cycle, block, log=get_run_logger(), spend_before=state.spend_usd)
    run_steps(..., LoopHooks(progress=prog))   # called once before the first step and after each step: (step, tokens, loss)
    prog.close()                       # the bar goes; the visit's summary line takes its place
    prog.finish(res.steps, "stopped by budget: ...")   # the artifact's last word: the stage's real end, at 100%

Where it shows:

- **a terminal** (stderr is one): a ``rich`` progress bar, ``c0-b1 train steps 120/200 ━━━━╸━━ loss 3.2100 ·
  12.3k tok/s · 0:01:02 < 0:00:40 · run $0.0123`` (the run's spend so far), redrawn at most every 0.5 s and
  removed when the stage ends. It shares one console with the log lines: it draws on the rich console of Prefect's
  console handler, and log handlers writing to the same stream go through that console while the bar is up, so a
  log line prints above the bar, never glued onto it;
- **anything else** (CI, a worker's log, a pipe): the same figures as one log line every ``BCDFLOW_PROGRESS_SECONDS``
  (default 30) through the logger given (the Prefect run logger: the lines show in the flow run's logs in the UI);
- **the Prefect UI**: with ``artifact=True``, a progress artifact of the visit's flow run, moved every 10 s from a
  background thread (one update in flight at most; a failure is logged once and never stops training), at a whole
  percent; ``finish`` gives it the stage's real end (a visit that stopped early at 29 of 60 steps is done, at 100%,
  with the steps it took and why it stopped in words), never the last throttled update, and in log mode writes the
  same as the stage's last log line. Its loss is the loop's ``final_loss`` (``run_steps`` reports it when the loop
  ends, whatever ended it): the visit's ``train_loss``, as the visits table and MLflow show it.

``BCDFLOW_PROGRESS=bar|log|off`` overrides the choice of the first two. Per step the cost is one clock read and a
comparison. The loss is the last window's mean, already on the host; before the first window it is the last step's
loss, a tensor read only when the line is drawn (at most one GPU sync per redraw, in the first window only).
"""
from __future__ import annotations

import contextvars
import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

BAR_SECONDS = 0.5
ARTIFACT_SECONDS = 10.0
_log = logging.getLogger("bcdflow.progress")


def hms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _si(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def percent(done: float, total: float) -> int:
    """``done`` of ``total`` as a whole percent, for a person (48, not 48.333333333333336), at most 100."""
    return min(100, int(100 * done / max(total, 1)))


def _mode(tty: bool | None) -> str:
    forced = os.environ.get("BCDFLOW_PROGRESS", "").strip().lower()
    if forced in ("bar", "log", "off"):
        return forced
    if tty is None:
        tty = sys.stderr.isatty()
    return "bar" if tty else "log"


class Progress:
    """One stage's progress (``unit``: steps or shards) out of ``total``; see the module docstring.

    ``update(done, tokens, loss)`` (also the ``run_steps`` callback, by ``__call__``) is throttled; the first call
    is the reference point of the rates (a resumed visit starts at its checkpoint's step). ``spend_before`` is the
    run's spend when the stage starts and ``usd_per_s`` what the stage's GPUs cost per second."""

    def __init__(self, label: str, total: int, unit: str = "steps", *, spend_before: float = 0.0,
                 usd_per_s: float = 0.0, tty: bool | None = None,
                 log: logging.Logger | logging.LoggerAdapter | None = None, every_s: float | None = None,
                 artifact: bool = False, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.spend_before, self.usd_per_s = spend_before, usd_per_s
        self.mode = _mode(tty)
        self.log = log or _fallback_logger()
        self.every_s = float(os.environ.get("BCDFLOW_PROGRESS_SECONDS", 30) if every_s is None else every_s)
        self.clock = clock
        self._artifact_on, self._artifact_id, self._artifact_job = artifact, None, None
        self._pool: ThreadPoolExecutor | None = None
        self._artifact_failed = False
        self._bar = self._task = None
        self._routed: list = []  # (log handler, its own stream) while the bar is up
        self._t0 = self._done0 = self._tokens0 = None
        self._final: dict | None = None  # the figures when the stage's loop ended (close), for finish
        self._last_draw = self._last_artifact = -float("inf")
        self.done, self.tokens, self.loss = 0, 0, None
        self.lines = 0  # log lines written (tests)

    # -- the figures --------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What the line shows: done of total, loss, tokens/s, elapsed and left seconds, spend so far (USD)."""
        loss = None if self.loss is None else float(self.loss)  # a step's loss tensor is read here, when drawn
        elapsed = 0.0 if self._t0 is None else self.clock() - self._t0
        moved = self.done - (self._done0 or 0)
        rate = moved / elapsed if elapsed > 0 and moved > 0 else None
        left = (self.total - self.done) / rate if rate else None
        tps = (self.tokens - (self._tokens0 or 0)) / elapsed if elapsed > 0 else None
        return {"label": self.label, "done": self.done, "total": self.total, "unit": self.unit, "loss": loss,
                "tokens_per_s": tps, "elapsed_s": elapsed, "left_s": left,
                "spend_usd": self.spend_before + elapsed * self.usd_per_s}

    def _info(self, s: dict) -> str:
        parts = []
        if s["loss"] is not None:
            parts.append(f"loss {s['loss']:.4f}")
        if s["tokens_per_s"] is not None and self.unit == "steps":
            parts.append(f"{_si(s['tokens_per_s'])} tok/s")
        parts.append(f"{hms(s['elapsed_s'])} < {hms(s['left_s'])}")
        parts.append(f"run ${s['spend_usd']:.4f}")
        return " · ".join(parts)

    def line(self) -> str:
        s = self.snapshot()
        timing = f"{hms(s['elapsed_s'])} < {hms(s['left_s'])}"
        return (f"{self.label}: {self.unit} {s['done']}/{s['total']} ({100 * s['done'] / s['total']:.0f}%), "
                + self._info(s).replace(timing, f"{hms(s['elapsed_s'])} elapsed, {hms(s['left_s'])} left")
                .replace(" · ", ", "))

    # -- updates ------------------------------------------------------------------------------------------------
    def __call__(self, done: int, tokens: int = 0, loss=None) -> None:
        self.update(done, tokens, loss)

    def update(self, done: int, tokens: int = 0, loss=None) -> None:
        """``loss``: a float, or a 0-dim tensor (read only when drawn), or None (keep the last)."""
        self.done, self.tokens = done, tokens
        if loss is not None:
            self.loss = loss
        now = self.clock()
        if self._t0 is None:
            self._t0, self._done0, self._tokens0 = now, done, tokens
            self._begin()
        if self.mode == "bar":
            if now - self._last_draw >= BAR_SECONDS or done >= self.total:
                self._last_draw = now
                self._draw()
        elif self.mode == "log":
            if now - self._last_draw >= self.every_s and done > self._done0 or \
                    (self.unit != "steps" and done >= self.total):
                self._last_draw = now
                self.log.info("%s", self.line())
                self.lines += 1
        if self._artifact_on and now - self._last_artifact >= ARTIFACT_SECONDS:
            self._last_artifact = now
            self._artifact_update()

    def close(self) -> None:
        """End the stage: the bar is removed (the caller's summary line replaces it); the artifact shows the last
        figures."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            for handler, stream in self._routed:
                handler.setStream(stream).flush()  # the proxy's last partial line, then the handler's own stream
            self._routed = []
            self._themed.pop_theme()
        if self._t0 is not None:
            self._final = self.snapshot()
        if self._artifact_on and self._t0 is not None:
            if self._artifact_job is not None:
                self._artifact_job.result()  # the last figures must not be skipped behind an update in flight
            self._artifact_update()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._t0 = None  # a retried task's loop starts the stage again (same artifact, a new bar)
        self._last_draw = -float("inf")

    def finish(self, done: int, why: str) -> str:
        """The stage ended for good after ``done`` of its ``total`` (a visit: its steps; ``why``: why it stopped, in
        words): the artifact goes to 100% with that as its description (created now where the loop never made one:
        a visit trained by torchrun's processes), and in log mode it is the last log line. Returns the description.
        Call after :meth:`close`."""
        self.close()
        s = self._final or {}
        figures = [f"loss {s['loss']:.4f}"] if s.get("loss") is not None else []
        if s.get("tokens_per_s") and self.unit == "steps":
            figures.append(f"{_si(s['tokens_per_s'])} tok/s")
        if s:
            figures += [f"{hms(s['elapsed_s'])} elapsed", f"run ${s['spend_usd']:.4f}"]
        desc = f"{self.label}: done, {done} of {self.total} {self.unit} ({why})" + \
            (f"; {', '.join(figures)}" if figures else "")
        if self.mode == "log":  # the log's last line: the stage's real end (the throttled lines may stop well short)
            self.log.info("%s", desc)
            self.lines += 1
        if self._artifact_on:
            if self._artifact_id is None:
                self._artifact_id = self._guard(self._create, 100, desc)
            else:
                self._guard(self._move, 100, desc)
        return desc

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the terminal -------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        if self.mode == "bar":
            from rich.default_styles import DEFAULT_STYLES
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.theme import Theme

            console = shared_console()
            # the bar's styles on that console while the bar is up (Prefect's console theme has only its own)
            console.push_theme(Theme({k: v for k, v in DEFAULT_STYLES.items() if k.startswith(("bar.", "progress."))}))
            self._themed = console
            # auto_refresh off: no drawing thread; the bar is redrawn by our throttled updates only
            # step of max before the bar, so a narrow terminal cuts the figures at the end, not the count
            # stdout is not redirected: what a command prints there stays there
            self._bar = RichProgress(TextColumn("{task.description}"), MofNCompleteColumn(), BarColumn(bar_width=20),
                                     TextColumn("{task.fields[info]}"), console=console, auto_refresh=False,
                                     transient=True, redirect_stdout=False)
            self._task = self._bar.add_task(f"{self.label} {self.unit}", total=self.total, completed=self.done,
                                            info="")
            self._bar.start()
            self._routed = route_logs(console)

    def _draw(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self._info(self.snapshot()), refresh=True)

    # -- the Prefect artifact -----------------------------------------------------------------------------------
    def _artifact_update(self) -> None:
        """Create the artifact (in the caller's run context, so it belongs to its flow run), then move it from one
        background thread, skipping an update while the previous one is in flight."""
        pct = percent(self.done, self.total)
        desc = self.line()
        if self._artifact_id is None:
            self._artifact_id = self._guard(self._create, pct, desc)
            return
        if self._artifact_job is not None and not self._artifact_job.done():
            return
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="bcdflow-progress")
        run = contextvars.copy_context().run  # Prefect's settings and client context, in the thread too
        self._artifact_job: Future = self._pool.submit(run, self._guard, self._move, pct, desc)

    @staticmethod
    def _create(pct: int, desc: str):
        from prefect.artifacts import create_progress_artifact

        return create_progress_artifact(pct, description=desc)

    def _move(self, pct: int, desc: str):
        from prefect.artifacts import update_progress_artifact

        return update_progress_artifact(self._artifact_id, pct, description=desc)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # no API, or outside a run: the training is what matters
            if not self._artifact_failed:
                self._artifact_failed = True
                _log.warning("progress artifact not published (%s: %s)", type(e).__name__, e)
            self._artifact_on = self._artifact_id is not None
            return None


def _console_handlers():
    """Every logging handler of the process (the root's and each named logger's)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers]


def shared_console():
    """The rich console the log lines go to: Prefect's console handler's when it writes to stderr, so the bar and
    the log lines share one console (rich prints a line above a live bar), else a new one on stderr."""
    from rich.console import Console

    for h in _console_handlers():
        console = getattr(h, "console", None)
        if isinstance(console, Console) and console.file in (sys.stderr, sys.__stderr__):
            return console
    return Console(stderr=True)


def route_logs(console) -> list:
    """Send the plain stream handlers that write where the bar draws (MLflow's, a torchrun process's) through the
    bar's console while it is up; returns (handler, its stream) to restore. Prefect's handler prints on that console
    already."""
    from rich.file_proxy import FileProxy

    routed = []
    for h in _console_handlers():
        if type(h) is logging.StreamHandler and h.stream in (console.file, sys.stderr, sys.__stderr__):
            routed.append((h, h.setStream(FileProxy(console, h.stream))))
    return routed


def _fallback_logger() -> logging.Logger:
    """``bcdflow.progress``, printing to stderr where nothing configured logging (a torchrun process)."""
    if not logging.getLogger().handlers and not _log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", "%H:%M:%S"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)
    return _log


def train_usd_per_s(cfg) -> float:
    """What the training stage's GPUs cost per second (``spend.train_device`` x its GPU count)."""
    from bcdflow.core import spend

    kind, gpus = spend.stage_plan(cfg.spend, spend.gpus_used(cfg))["train"]
    return spend.catalog(cfg.spend).get(kind, 0.0) * gpus / 3600


def preinfer_usd_per_s(cfg) -> float:
    from bcdflow.core import spend

    kind, gpus = spend.stage_plan(cfg.spend, spend.gpus_used(cfg))["preinfer"]
    return spend.catalog(cfg.spend).get(kind, 0.0) * gpus / 3600


def visit_progress(cfg, run_id: str, cycle: int, block: int, store=None, *, spend_before: float | None = None,
                   log=None, artifact: bool = False, tty: bool | None = None) -> Progress:
    """The training line of visit (cycle, block): steps of ``bcd.max_steps``, spend from ``spend_before`` (default:
    the run's committed spend, read from its state.json in ``store``) at the training stage's price."""
    if spend_before is None and store is not None:
        from bcdflow.storage import runs

        state = runs.read_state(store, run_id)
        spend_before = state.spend_usd if state else 0.0
    return Progress(f"c{cycle}-b{block} train", cfg.stop_rule().max_steps, "steps", spend_before=spend_before or 0.0,
                    usd_per_s=train_usd_per_s(cfg), log=log, artifact=artifact, tty=tty)
