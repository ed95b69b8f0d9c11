"""``compare_runs``: ``bcdflow compare`` as a Prefect flow (the deployment ``compare_runs/compare`` of prefect.yaml),
publishing the table as a markdown artifact. The comparison itself is ``flows/compare.py``, which imports no Prefect,
so that ``bcdflow compare`` answers at once.

    compare_runs(run_ids=["full", "bcd"], store="./bcdflow-store")
"""
from __future__ import annotations

from prefect import flow

from bcdflow.core.config import store_config
from bcdflow.core.context import open_store
from bcdflow.flows import artifacts
from bcdflow.flows.compare import BRACKET_TOL, TOL, compare


@flow(name="compare_runs")
def compare_runs(run_ids: list[str], store: str = "./bcdflow-store", endpoint_url: str | None = None,
                 target: str | None = None, tol: float = TOL, bracket_tol: float = BRACKET_TOL) -> dict:
    """Compare runs of one store by loss and cost; the table is published as a markdown artifact.

    Args:
        run_ids: The baseline first, then the runs to compare with it.
        store: The store URL.
        endpoint_url: The store's endpoint (an S3-compatible server for an s3:// store; its backend's option).
        target: L*: best (the baseline's best validation loss + tol, the default), final, common, or a loss.
        tol: What L* adds to the baseline's loss.
        bracket_tol: The widest bracket of a crossing, as a fraction of its step, that still gives a B-F.
    """
    st = open_store(store_config(store, endpoint_url))
    result = compare(st, run_ids, target=target, tol=tol, bracket_tol=bracket_tol)
    artifacts.publish_markdown(artifacts.artifact_key("compare", "-".join(run_ids))[:200], result["markdown"],
                               description=f"bcdflow compare {' '.join(run_ids)}")
    return result
