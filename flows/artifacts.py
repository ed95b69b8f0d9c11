"""What a run shows its operators in Prefect: artifacts of the parent flow run.

Keys are ``{run-id}-visits``, ``{run-id}-progress``, ``{run-id}-mlflow``, so the Artifacts page keeps one entry
per run: a table of the committed visits (block, steps, losses, seconds, spend), a progress bar updated per
visit, and a link to the run's MLflow page. An artifact that cannot be published is logged as a warning, never
a reason to fail training.
"""
from __future__ import annotations

import logging
import re

from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)

from storage.runs import VisitRecord

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


def visit_table(visits: list[VisitRecord]) -> list[dict]:
    """The visit records cut to the table's columns (floats to 6 significant digits)."""
    return [{h: (float(f"{x:.6g}") if isinstance(x := getattr(v, k), float) else x) for k, h, _ in VISIT_COLUMNS}
            for v in visits]


def _publish(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the API is down or we run outside a flow: the run itself is what matters
        log.warning("Prefect artifact not published (%s: %s)", type(e).__name__, e)
        return None


def publish_visits(run_id: str, visits: list[VisitRecord], stop_reason: str | None = None) -> None:
    total = sum(v.spend_usd for v in visits)
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
