"""A visit's live progress (tasks/progress.py): the step loop's callback, the time-left estimate, the log lines written
where stderr is not a terminal, the bar where it is; and the trained-token count of the supervised formats."""
from __future__ import annotations

import io
import itertools
import logging

import pytest
import torch

from bcdflow.constants import IGNORE_INDEX
from bcdflow.models.trainer import LoopHooks, OptimSpec, StopRule, make_optimizer, run_steps
from bcdflow.tasks.engine import counted
from bcdflow.tasks.progress import Progress, hms


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _loop(progress, steps=12, window=4, clock=None):
    w = torch.nn.Parameter(torch.ones(3))
    spec = OptimSpec("sgd", lr=0.01, grad_clip=0.0)
    batch = (torch.zeros(2, 5, dtype=torch.long), torch.tensor([[1, 2, IGNORE_INDEX, 3, IGNORE_INDEX]] * 2))

    def loss_fn(b):
        if clock is not None:
            clock.t += 0.5  # each step takes half a second
        return (w ** 2).sum()

    return run_steps(loss_fn, [w], itertools.repeat(batch), make_optimizer([w], spec), spec,
                     StopRule(max_steps=steps, window=window), LoopHooks(progress=progress))


def test_progress_callback_fires_with_monotone_steps_and_a_time_left_estimate():
    clock = FakeClock()
    prog = Progress("c0-b1 train", 12, tty=False, every_s=1e9, clock=clock)
    seen = []

    def spy(step, tokens, loss):
        prog(step, tokens, loss)
        seen.append((step, tokens, loss, prog.snapshot()))

    res = _loop(spy, clock=clock)
    steps = [s for s, *_ in seen]
    assert steps == list(range(0, 13)) + [12]  # the starting point, every step, then the loop's end
    assert all(a <= b for a, b in zip(steps, steps[1:]))
    # a loss from the first step on: that step's own (a tensor, read only when drawn) until the first window is
    # synced, then the window's mean
    assert seen[0][2] is None and seen[0][3]["loss"] is None
    assert isinstance(seen[1][2], torch.Tensor) and seen[1][3]["loss"] == pytest.approx(float(seen[1][2]))
    assert isinstance(seen[3][2], torch.Tensor) and isinstance(seen[4][2], float)
    # 6 trained targets per batch (4 of 10 positions masked): tokens count trained positions only
    assert [t for _, t, *_ in seen][:3] == [0, 6, 12] and res.tokens == 72
    snap = seen[6][3]  # 6 steps in 3 s: 2 steps/s, 6 steps to go
    assert snap["left_s"] == pytest.approx(3.0) and snap["tokens_per_s"] == pytest.approx(12.0)
    assert seen[-1][3]["left_s"] == 0 and seen[-1][2] == res.final_loss  # its end: the loop's final loss
    assert hms(snap["left_s"]) == "0:00:03"


def test_progress_of_a_resumed_loop_rates_from_where_it_continued():
    clock = FakeClock()
    prog = Progress("v", 100, tty=False, every_s=1e9, clock=clock, spend_before=1.0, usd_per_s=0.5)
    prog(40, 4000)  # resumed at step 40
    clock.t = 10.0
    prog(50, 5000, 2.5)
    s = prog.snapshot()
    assert s["left_s"] == pytest.approx(50.0) and s["tokens_per_s"] == pytest.approx(100.0)
    assert s["spend_usd"] == pytest.approx(6.0) and s["loss"] == 2.5


def test_not_a_terminal_writes_one_log_line_every_n_seconds(caplog):
    clock = FakeClock()
    log = logging.getLogger("test.progress")
    prog = Progress("c0-b2 train", 12, tty=False, log=log, every_s=2.0, clock=clock, usd_per_s=0.001)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        _loop(prog, clock=clock)  # 12 steps of 0.5 s: a line at step 1, then every 2 s (4 steps)
        prog.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "test.progress"]
    assert len(lines) == 3 == prog.lines, lines
    assert lines[0].startswith("c0-b2 train: steps 1/12 (8%)")
    assert "steps 9/12 (75%), loss " in lines[2] and "tok/s" in lines[2] and "left" in lines[2] and "$0.00" in lines[2]


def test_preinfer_shards_are_logged_to_the_last():
    stream = io.StringIO()
    log = logging.getLogger("test.progress.shards")
    log.addHandler(logging.StreamHandler(stream))
    log.setLevel(logging.INFO)
    with Progress("c0-b1 pre-infer", 3, "shards", tty=False, log=log, every_s=1e9) as prog:
        for i in range(4):
            prog.update(i)
    assert stream.getvalue().splitlines()[-1].startswith("c0-b1 pre-infer: shards 3/3 (100%)")


def test_a_terminal_gets_a_rich_bar_that_is_removed_at_the_end(monkeypatch):
    monkeypatch.setenv("BCDFLOW_PROGRESS", "bar")
    prog = Progress("c0-b1 train", 12, every_s=0)
    _loop(prog)
    assert prog._bar is not None and prog.lines == 0  # no log lines in a terminal
    prog.close()
    assert prog._bar is None


def test_the_bar_and_the_log_lines_share_one_console(monkeypatch):
    """Issue 28: Prefect's log lines were glued onto the live bar (``... run $0.005103:07:59.311 | INFO | ...``): the
    bar drew on its own console while the log handlers wrote to the same terminal. Now the bar draws on the console
    of the log handler that writes to stderr, and plain stream handlers go through it while the bar is up, so every
    log line starts a line of its own and the bar is drawn again below it."""
    from rich.console import Console
    from rich.theme import Theme

    term = io.StringIO()  # Prefect's console: its own theme only, no progress-bar styles
    console = Console(file=term, force_terminal=True, width=120, theme=Theme({"log.info_level": "cyan"}, inherit=False))

    class ConsoleHandler(logging.Handler):  # as Prefect's PrefectConsoleHandler: a rich console on the terminal
        def __init__(self):
            super().__init__()
            self.console = console

        def emit(self, record):
            self.console.print(self.format(record), soft_wrap=True)

    monkeypatch.setattr("sys.stderr", term)  # the terminal the handlers write to
    monkeypatch.setenv("BCDFLOW_PROGRESS", "bar")
    richer, plain = ConsoleHandler(), logging.StreamHandler(term)
    log = logging.getLogger("test.progress.console")
    log.addHandler(richer)
    other = logging.getLogger("test.progress.plain")  # as MLflow's own handler on stderr
    other.addHandler(plain)
    log.setLevel(logging.INFO)
    other.setLevel(logging.INFO)
    try:
        clock = FakeClock()
        prog = Progress("c0-b1 train", 12, every_s=0, clock=clock)
        prog.update(1, 10, 3.5)
        log.info("PREFECT-LINE Task run 'shard-2' - Finished")
        clock.t += 1
        prog.update(2, 20, 3.4)
        other.info("PLAIN-LINE system metrics")
        clock.t += 1
        prog.update(3, 30, 3.3)
        prog.close()
    finally:
        log.removeHandler(richer)
        other.removeHandler(plain)
    assert plain.stream is term  # given back when the bar went
    import re

    lines = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.getvalue()))
    assert any("c0-b1 train steps" in ln and "loss 3.5000" in ln for ln in lines)  # the bar is on that terminal
    for word in ("PREFECT-LINE", "PLAIN-LINE"):
        (line,) = [ln for ln in lines if word in ln]
        assert line.startswith(word), lines  # never glued onto the bar


def test_off_shows_nothing(monkeypatch, caplog):
    monkeypatch.setenv("BCDFLOW_PROGRESS", "off")
    prog = Progress("v", 12, every_s=0)
    with caplog.at_level(logging.INFO):
        _loop(prog)
    assert prog.lines == 0 and prog._bar is None


@pytest.mark.parametrize("ending", ["plateau", "max_steps", "interrupted"])
def test_the_last_progress_is_the_loops_end_whatever_ended_it(ending):
    """Issue 45: a visit stopped by its stop rule (the adaptive budget, a plateau) broke out of the loop before the
    step's progress call, so the artifact and the live line kept the window before's loss (5.6349 against the
    visit's 5.6169) and the log had no last line. Now the last call is at the loop's last step with its final loss
    (the visit's train_loss), and ``finish`` writes the stage's last log line with that loss."""
    clock = FakeClock()
    log = logging.getLogger("test.progress.end")
    stream = io.StringIO()
    log.addHandler(logging.StreamHandler(stream))
    log.setLevel(logging.INFO)
    prog = Progress("c0-b1 train", 12, tty=False, log=log, every_s=1e9, clock=clock)
    calls = []

    def spy(step, tokens, loss):
        prog(step, tokens, loss)
        calls.append((step, None if loss is None else float(loss)))

    w = torch.nn.Parameter(torch.ones(1))
    spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
    values = iter([5.0 - 0.1 * i + (0.05 if i % 2 else 0.0) for i in range(12)])  # falling, uneven: each mean its own

    def loss_fn(b):
        clock.t += 0.5
        return (w * 0).sum() + next(values)

    stop = StopRule(max_steps=12, window=4, patience=2 if ending == "plateau" else 0, min_delta=10.0)
    res = run_steps(loss_fn, [w], itertools.repeat(torch.zeros(1, 3, dtype=torch.long)), make_optimizer([w], spec),
                    spec, stop, LoopHooks(progress=spy,
                                          should_stop=(lambda: len(calls) > 6) if ending == "interrupted" else None))
    assert res.stopped_by == ending and res.steps == {"plateau": 8, "max_steps": 12, "interrupted": 6}[ending]
    assert calls[-1] == (res.steps, pytest.approx(res.final_loss))
    if ending != "interrupted":
        assert res.final_loss != pytest.approx(sum(res.losses[-4:]) / 4)  # not the last window's mean
    prog.close()
    desc = prog.finish(res.steps, f"stopped by {ending}")
    assert f"loss {res.final_loss:.4f}" in desc
    assert stream.getvalue().splitlines()[-1] == desc  # the log's last line: the stage's real end


def test_counted_batches_carry_their_trained_tokens_and_the_loop_sums_them():
    y = torch.tensor([[5, IGNORE_INDEX, IGNORE_INDEX, 7], [IGNORE_INDEX] * 4])
    fetch = counted(lambda a, b: (torch.zeros_like(y), y))
    x, y2, n = fetch(0, 2)
    assert n == 2 and y2 is y
    w = torch.nn.Parameter(torch.ones(1))
    spec = OptimSpec("sgd", lr=0.0, grad_clip=0.0)
    res = run_steps(lambda b: (w * 0).sum(), [w], itertools.repeat(fetch(0, 2)), make_optimizer([w], spec), spec,
                    StopRule(max_steps=3, window=3))
    assert res.tokens == 6


def test_each_visit_run_has_a_progress_artifact_and_logs_its_steps(tiny_cfg, prefect_server, monkeypatch):
    """A tiny run, not in a terminal: each visit's flow run shows its own progress artifact (at 100% when the visit
    ends), and its logs carry the steps and the pre-inference shards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterTags

    from bcdflow.flows.bcd import bcd_train
    from tests.test_tracking import _prefect_artifacts

    monkeypatch.setenv("BCDFLOW_PROGRESS", "log")
    monkeypatch.setenv("BCDFLOW_PROGRESS_SECONDS", "0")
    cfg = tiny_cfg("bcd.blocks=2")

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    keep = Keep()
    # the run loggers do not propagate, and the tests set them to WARNING (conftest.py)
    run_loggers = {lg: lg.level for lg in map(logging.getLogger, ("prefect.flow_runs", "prefect.task_runs"))}
    for lg in run_loggers:
        lg.addHandler(keep)
        lg.setLevel(logging.INFO)
    try:
        assert bcd_train(config=cfg, run_id="prog")["version"] == 2
    finally:
        for lg, level in run_loggers.items():
            lg.removeHandler(keep)
            lg.setLevel(level)
    text = "\n".join(keep.lines)
    assert "c0-b0 train: steps 6/6 (100%)" in text and "tok/s" in text
    assert "c0-b1 pre-infer: shards" in text
    with get_client(sync_client=True) as client:
        visits = client.read_flow_runs(flow_run_filter=FlowRunFilter(  # this run's visits: the session server has others
            name=FlowRunFilterName(any_=["prog/c0-b0", "prog/c0-b1"]), tags=FlowRunFilterTags(all_=["run:prog"])))
    assert len(visits) >= 2
    for fr in visits:
        (art,) = _prefect_artifacts(str(fr.id))["progress"]
        assert art["data"] == 100 and "done, 6 of 6 steps (stopped by max_steps: reached its step cap" in \
            art["description"], art


def test_the_progress_artifact_ends_at_the_visits_real_end(prefect_server):
    """Issue 37: a visit that stopped early (budget, plateau) left its artifact where the last throttled update left it
    ("steps 29/60 (48%) ... 0:00:02 left", "Progress: 48.333333333333336%"). Its last word is now the visit's real end:
    the steps it took, why it stopped, 100%; and a percentage is a whole number."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    def read(artifact_id):
        with get_client(sync_client=True) as client:
            (art,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
        return art

    @flow(name="a-visit")
    def a_visit():  # 29 of 60 steps, then the adaptive budget ends it
        clock = FakeClock()
        prog = Progress("c0-b1 train", 60, tty=False, every_s=1e9, clock=clock, artifact=True)
        prog(0)
        for step in range(1, 30):
            clock.t += 0.5
            prog(step, 100 * step, 4.5)
        prog.close()
        before = read(prog._artifact_id)
        return prog._artifact_id, before, prog.finish(29, "stopped by budget: its loss fell more slowly")

    art_id, before, desc = a_visit()
    assert before.data == 48 and "29/60 (48%)" in before.description  # the loop's last figures: a whole percent
    after = read(art_id)
    assert after.data == 100 and after.description == desc
    assert desc.startswith("c0-b1 train: done, 29 of 60 steps (stopped by budget: its loss fell more slowly)")
    assert "left" not in desc and "loss 4.5000" in desc and "0:00:14 elapsed" in desc


def test_a_visits_resolved_settings_are_an_artifact_of_its_flow_run(tiny_cfg, prefect_server):
    """Issue 45: a visit's flow-run parameters are the config as stored, unset keys null (what a dispatched visit
    validates and runs), while MLflow shows the resolved values; the visit's flow run now has a settings artifact
    with those values (``tracking/describe.run_params``): the model's sizes, each block's layers, no None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterTags

    from bcdflow.flows.bcd import bcd_train
    from tests.test_tracking import _prefect_artifacts

    cfg = tiny_cfg("bcd.blocks=2", "bcd.max_steps=2")
    assert cfg.model.n_layer is None  # unset in the config: null among the flow run's parameters
    assert bcd_train(config=cfg, run_id="settings")["version"] == 2
    with get_client(sync_client=True) as client:
        (fr,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=["settings/c0-b1"]), tags=FlowRunFilterTags(all_=["run:settings"])))
    assert fr.parameters["config"]["model"]["n_layer"] is None
    (art,) = _prefect_artifacts(str(fr.id))["markdown"]
    text = art["data"]
    assert "visit c0-b1 of run `settings`" in text and "None" not in text, text
    assert "| `model.n_layer` | 6 |" in text and "| `block.1.layers` |" in text and "| `optim.lr` | 0.003 |" in text
