"""What a run shows its operators in Prefect: artifacts of the parent flow run, and each visit's resolved settings
(:func:`publish_settings`) on the visit's own.

Keys are ``{run-id}-visits``, ``{run-id}-progress``, ``{run-id}-mlflow`` (``RunArtifacts.key``: a short hash
only where the run id alone would not tell runs apart), so the Artifacts page keeps one entry per run: a table of
the committed visits (block, steps, losses, seconds, spend) and a progress bar, both updated
in place after each visit (also across resumes), and a link to the run's MLflow page. An artifact that cannot be
published is logged as a warning, never a reason to fail training. :func:`crash_previous` marks the flow run of a
process that died holding a run or a visit Crashed, with its task runs, once another process takes it over (Prefect
would show them running for good).
"""
from __future__ import annotations

import hashlib
import logging
import re

from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact)

from bcdflow.core.rules import stop_words as run_stop_words
from bcdflow.models.trainer import stop_words
from bcdflow.storage.runs import VisitRecord
from bcdflow.tasks.progress import percent

log = logging.getLogger(__name__)

# visit table: (record key, column header, format)
VISIT_COLUMNS = [
    ("cycle", "cycle", "d"), ("block", "block", "d"), ("version", "version", "d"), ("steps", "steps", "d"),
    ("stopped_by", "stopped by", "s"), ("train_loss", "train loss", ".4f"), ("val_loss", "val loss", ".4f"),
    ("preinfer_seconds", "pre-infer s", ".1f"), ("train_seconds", "train s", ".1f"),
    ("eval_seconds", "eval s", ".1f"), ("gpu_hours", "GPU-h", ".5f"), ("spend_usd", "spend $", ".5f"),
    ("cum_spend_usd", "total $", ".5f"),
]


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def visit_table(visits: list[VisitRecord]) -> list[dict]:
    """The visit records cut to the table's columns (floats to 6 significant digits)."""
    return [{h: (float(f"{x:.6g}") if isinstance(x := getattr(v, k), float) else x) for k, h, _ in VISIT_COLUMNS}
            for v in visits]


def stop_legend(visits: list[VisitRecord], mode: str = "bcd") -> str:
    """What each "stopped by" of the table means, in words (a sentence does not fit a table cell)."""
    reasons = dict.fromkeys(v.stopped_by for v in visits)
    return "; ".join(f"**{r}**: {stop_words(r, mode)}" for r in reasons)


def _publish(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the API is down or we run outside a flow: the run itself is what matters
        log.warning("Prefect artifact not published (%s: %s)", type(e).__name__, e)
        return None


def _upsert(key: str, data, description: str, create) -> None:
    """Update the artifact with this key in place (its latest version), or create it: one entry per run in
    the Artifacts tab, however many visits and resumes it takes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])), limit=1)
        if found:
            client.update_artifact(found[0].latest_id, ArtifactUpdate(data=data, description=description))
            return
    create(description)


# a run id bcdflow generated (flows/params.new_run_id: mode, UTC start, 4 random hex digits): unique across machines
GENERATED_RUN_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*-\d{8}-\d{6}-[0-9a-f]{4}$")


class RunArtifacts:
    """The artifacts of one bcdflow run: its visits table, its progress bar and its MLflow link, each updated in
    place. Keys read as the run: ``{run-id}-{what}`` (``bcd-20250101-120000-1a2b-visits``) for a run id bcdflow
    generated, unique across machines. A short hash of the store's URL and the run id joins it only where the id
    alone could name another run: an id the user chose (``--run-id exp1``: unique within its store, not across the
    stores that share one Prefect server) or one that is not already a key (``Run_A`` and ``run-a`` are two runs,
    one key once lowercased with dashes: Prefect keys allow lowercase letters, digits and dashes only)."""

    def __init__(self, run_id: str, store_url: str, total_visits: int, mode: str = "bcd"):
        self.run_id, self.total, self.mode = run_id, max(total_visits, 1), mode
        name = artifact_key(run_id, "")
        if name == run_id and GENERATED_RUN_ID.match(run_id):
            self.scope = name
        else:
            digest = hashlib.sha256(f"{store_url}\n{run_id}".encode()).hexdigest()
            self.scope = f"{name}-{digest[:6]}"

    def key(self, what: str) -> str:
        return artifact_key(self.scope, what)

    def link(self, url: str | None, text: str) -> None:
        if url:
            key, desc = self.key("mlflow"), f"MLflow run of `{self.run_id}`"
            _publish(_upsert, key, f"[{text}]({url})", desc,
                     lambda d: create_link_artifact(url, link_text=text, key=key, description=d))

    def visits(self, visits: list[VisitRecord], stop_reason: str | None = None) -> None:
        """The run's visits table, re-published in place after each visit."""
        from prefect.artifacts import TableArtifact

        desc = f"Visits of run `{self.run_id}`: {len(visits)} committed, ${sum(v.spend_usd for v in visits):.4f} spent"
        if stop_reason:
            desc += f"; the run stopped ({stop_reason}): {run_stop_words(stop_reason, self.mode)}"
        if visits:
            desc += f". A visit stopped by {stop_legend(visits, self.mode)}."
        table, key = visit_table(visits), self.key("visits")
        _publish(_upsert, key, TableArtifact(table=table).format(), desc,
                 lambda d: create_table_artifact(table, key=key, description=d))

    def progress(self, done: int, note: str | None = None, finished: bool = False) -> None:
        """Committed visits out of the planned cycles x blocks."""
        desc = f"Visits of run `{self.run_id}`: {done}/{self.total} committed" + (f"; {note}" if note else "")
        value, key = 100 if finished else percent(done, self.total), self.key("progress")
        _publish(_upsert, key, value, desc, lambda d: create_progress_artifact(value, key=key, description=d))


def publish_markdown(key: str | None, markdown: str, description: str | None = None) -> None:
    _publish(create_markdown_artifact, markdown, key=key, description=description)


def settings_markdown(run_id: str, cycle: int, block: int, params: dict[str, str]) -> str:
    """A visit's settings as it resolved them (``tracking/describe.run_params``: what MLflow's parameters show), a
    table of ``key | value``. Its flow run's parameters stay the run's config as stored, unset keys null: that is
    what a dispatched visit validates and runs (docs/guide/watching.md), and what an unset key resolves to (the
    rate by the card, the paper's learning rate, the model's sizes) is the visit's to decide where it runs."""
    bar = "\\|"  # a value's "|" escaped, so it stays in its cell
    rows = "\n".join(f"| `{k}` | {str(v).replace('|', bar)} |" for k, v in sorted(params.items()))
    return (f"Settings of visit c{cycle}-b{block} of run `{run_id}` as resolved (unset keys as what they resolved to, "
            f"as MLflow's parameters show them; this flow run's parameters are the config as stored, unset keys "
            f"null).\n\n| key | value |\n| --- | --- |\n{rows}\n")


def publish_settings(run_id: str, cycle: int, block: int, params: dict[str, str]) -> None:
    """The visit's resolved settings as a markdown artifact of its flow run (no key: one per visit's flow run, not
    an entry per visit on the Artifacts page)."""
    publish_markdown(None, settings_markdown(run_id, cycle, block, params),
                     f"Settings of visit c{cycle}-b{block} of run `{run_id}`, as resolved")


def crash_previous(previous: dict | None, what: str) -> str | None:
    """Mark Crashed the flow run of ``previous`` (the lease object this process took ``what`` over from: its owner
    names a flow run) when Prefect still has it in a non-final state: its process died (kill -9, a lost machine)
    without reporting. Its task runs still running (the visit's train-block, which would show Running for good) are
    marked Crashed too, and its progress artifact says which attempt replaced it. Every message names this flow run,
    the attempt that replaced it. Returns the marked flow run's id; a flow run this server does not know is left
    alone."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    old, me = ((previous or {}).get("owner") or {}).get("flow_run_id"), flow_run.get_id()
    if not old or old == me:  # never leased, or a rescheduled attempt of this very flow run
        return None
    by = f"flow run {flow_run.get_name()!r} ({me})" if me else "another process"
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(old).state
            if state is None or state.is_final():
                return None
            _crash_run(client, old, f"its process stopped holding {what} without reporting (killed, or its machine "
                                    f"was lost); replaced by {by}")
    except Exception as e:  # another server's flow run (ObjectNotFound), or the API is busy: nothing to repair here
        log.info("flow run %s (the previous holder of %s) not marked crashed: %s: %s", old, what, type(e).__name__, e)
        return None
    log.warning("flow run %s held %s when its process died: marked Crashed, with its task runs; replaced by %s", old,
                what, by)
    return old


def _crash_run(client, flow_run_id: str, message: str) -> None:
    """The flow run, its task runs not yet final, and the note on its progress artifact, all forced (a dead process
    cannot object): Crashed with ``message``."""
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType,
                                                FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                                TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    alive = [t for t in StateType if t not in (StateType.COMPLETED, StateType.FAILED, StateType.CRASHED,
                                                StateType.CANCELLED)]
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                  task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=alive))))
    for tr in tasks:
        client.set_task_run_state(tr.id, Crashed(message=message), force=True)
    for art in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"]))):
        client.update_artifact(art.id, ArtifactUpdate(data=art.data, description=f"{art.description or ''} — "
                                                                                  f"crashed: {message}"))
