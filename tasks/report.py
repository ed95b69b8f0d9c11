"""What a run shows its operators: Prefect artifacts in the flow run, figures for MLflow, markdown tables.

Prefect artifacts (keys are ``{run-id}-visits``, ``{run-id}-progress``, ``{run-id}-mlflow``, so the
Artifacts page keeps one history per run): a table of the committed visits (block, steps, losses,
seconds, spend) re-published after each visit, a progress bar updated per visit, and a link to the
run's MLflow page. Figures (matplotlib, Agg): training loss over steps with each visit's span coloured
by block, validation loss against cumulative spend, spend by stage per visit. An artifact that cannot
be published is logged as a warning, never a reason to fail training.
"""
from __future__ import annotations

import logging
import os
import re

import matplotlib

matplotlib.use("Agg")  # headless workers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from prefect import task  # noqa: E402
from prefect.artifacts import (create_link_artifact, create_markdown_artifact,  # noqa: E402
                               create_progress_artifact, create_table_artifact, update_progress_artifact)
from prefect.cache_policies import NO_CACHE  # noqa: E402

from tasks import spend as spend_mod  # noqa: E402

log = logging.getLogger(__name__)

# visit table: (record key, column header, format)
VISIT_COLUMNS = [
    ("cycle", "cycle", "d"), ("block", "block", "d"), ("version", "version", "d"), ("steps", "steps", "d"),
    ("train_loss", "train loss", ".4f"), ("val_loss", "val loss", ".4f"),
    ("preinfer_seconds", "pre-infer s", ".1f"), ("train_seconds", "train s", ".1f"),
    ("eval_seconds", "eval s", ".1f"), ("gpu_hours", "GPU-h", ".5f"), ("spend_usd", "spend $", ".5f"),
    ("cum_spend_usd", "total $", ".5f"), ("stopped_by", "stopped by", "s"),
]


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def _fmt(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and v != v):  # None or NaN
        return "–"
    try:
        return format(v, fmt)
    except (TypeError, ValueError):
        return str(v)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A GitHub-markdown table of ``rows`` with ``columns`` = (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "| " + " | ".join("---" if f == "s" else "---:" for _, _, f in columns) + " |"]
    lines += ["| " + " | ".join(_fmt(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def visit_table(visits: list[dict]) -> list[dict]:
    """The visit records cut to the table's columns (floats to 6 significant digits)."""
    return [{h: (float(f"{v[k]:.6g}") if isinstance(v.get(k), float) else v.get(k)) for k, h, _ in VISIT_COLUMNS}
            for v in visits]


def _publish(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the API is down or we run outside a flow: the run itself is what matters
        log.warning("Prefect artifact not published (%s: %s)", type(e).__name__, e)
        return None


def publish_visits(run_id: str, visits: list[dict], stop_reason: str | None = None) -> None:
    total = sum(v.get("spend_usd") or 0.0 for v in visits)
    desc = f"Visits of run `{run_id}`: {len(visits)} committed, ${total:.4f} spent"
    if stop_reason:
        desc += f"; stopped: {stop_reason}"
    _publish(create_table_artifact, visit_table(visits), key=artifact_key(run_id, "visits"), description=desc)


def publish_link(run_id: str, url: str | None, text: str) -> None:
    if url:
        _publish(create_link_artifact, url, link_text=text, key=artifact_key(run_id, "mlflow"),
                 description=f"MLflow run of `{run_id}`")


def publish_markdown(key: str, markdown: str, description: str | None = None) -> None:
    _publish(create_markdown_artifact, markdown, key=key, description=description)


class Progress:
    """A Prefect progress artifact: committed visits out of the planned cycles x blocks."""

    def __init__(self, run_id: str, total: int, done: int = 0):
        self.total = max(total, 1)
        self.id = _publish(create_progress_artifact, self.percent(done), key=artifact_key(run_id, "progress"),
                           description=f"Visits of run `{run_id}` committed ({done}/{total})")

    def percent(self, done: int) -> float:
        return min(100.0, 100.0 * done / self.total)

    def update(self, done: int, note: str | None = None, finished: bool = False) -> None:
        if self.id is None:
            return
        desc = f"{done}/{self.total} visits committed" + (f"; {note}" if note else "")
        _publish(update_progress_artifact, self.id, 100.0 if finished else self.percent(done), description=desc)


# -- figures ------------------------------------------------------------------------------------

def _block_colors(visits: list[dict]) -> dict[int, tuple]:
    cmap = plt.get_cmap("tab10")
    return {b: cmap(i % 10) for i, b in enumerate(sorted({v["block"] for v in visits}))}


def figures(spend, visits: list[dict], train_loss: list[tuple[int, float]], out_dir: str) -> list[str]:
    """Write the run's three figures as PNGs into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    colors = _block_colors(visits)
    pts = spend_mod.curve(spend, visits)
    paths = []

    # 1. training loss over global steps; each visit's span shaded in its block's colour
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen: set[int] = set()
    for v in visits:
        end = v.get("step_end")
        if end is None:
            continue
        b = v["block"]
        ax.axvspan(end - v["steps"], end, color=colors[b], alpha=0.15, lw=0,
                   label=None if b in seen else f"block {b}")
        ax.axvline(end, color=colors[b], lw=0.6, alpha=0.6)
        seen.add(b)
    if train_loss:
        ax.plot(*zip(*train_loss), color="black", lw=0.8, label="train loss")
    if pts:
        ax.plot([p["step"] for p in pts], [p["val_loss"] for p in pts], "o-", color="tab:red", ms=3,
                lw=1, label="val loss")
    ax.set(xlabel="step", ylabel="loss", title="Loss over steps (visits shaded by block)")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir, "loss_over_steps.png"))

    # 2. validation loss against cumulative spend
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if pts:
        ax.plot([p["spend_usd"] for p in pts], [p["val_loss"] for p in pts], "-", color="gray", lw=0.8)
        for p in pts:
            ax.plot(p["spend_usd"], p["val_loss"], "o", color=colors[p["block"]], ms=4)
    ax.set(xlabel="cumulative spend (USD)", ylabel="validation loss", title="Validation loss vs spend")
    paths.append(_save(fig, out_dir, "val_loss_vs_spend.png"))

    # 3. spend by stage, one stacked bar per visit
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(visits) + 2), 4.5))
    labels = [f"c{v['cycle']}-b{v['block']}" for v in visits]
    bottom = [0.0] * len(visits)
    for stage, color in zip(spend_mod.STAGES, ("tab:blue", "tab:orange", "tab:green")):
        vals = [spend_mod.visit_spend(spend, v)[f"spend_{stage}_usd"] if v.get(f"spend_{stage}_usd") is None
                else v[f"spend_{stage}_usd"] for v in visits]
        ax.bar(labels, vals, bottom=bottom, color=color, label=stage)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set(xlabel="visit", ylabel="USD", title="Spend by stage")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir, "spend_by_stage.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the run's MLflow outputs -------------------------------------------------------------------

def _report_run(cfg, run_id: str, mlflow_run: str, version: int) -> None:
    """Log the figures and (``log_model``) the exported final model to the run's MLflow run."""
    import tempfile

    from storage import runs
    from tasks.export import export_version
    from tasks.tracking import Tracker

    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    store = cfg.open_store()
    visits = runs.read_state(store, run_id)["visits"]
    with tempfile.TemporaryDirectory(prefix="bcdflow-report-") as tmp:
        figures(cfg.spend, visits, tracker.history(mlflow_run, "train_loss"), os.path.join(tmp, "figures"))
        tracker.artifact(mlflow_run, os.path.join(tmp, "figures"), "figures")
        if cfg.log_model:
            export_version(store, run_id, version, os.path.join(tmp, "model"))
            tracker.artifact(mlflow_run, os.path.join(tmp, "model"), "model")


report_run = task(_report_run, name="report-run", retries=1, retry_delay_seconds=[5], cache_policy=NO_CACHE)
