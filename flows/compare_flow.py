"""``compare_runs``: ``bcdflow compare`` as a Prefect flow (the deployment ``compare_runs/compare`` of prefect.yaml),
publishing the table as a markdown artifact. The comparison itself is ``flows/compare.py``, which imports no Prefect,
so that ``bcdflow compare`` answers at once.

    compare_runs(run_ids=["full", "bcd"], store="./bcdflow-store")
"""
from __future__ import annotations

from prefect import flow

from bcdflow.core.config import RunConfig
from bcdflow.core.context import open_store
from bcdflow.flows import artifacts
from bcdflow.flows.compare import BRACKET_TOL, TOL, compare


@flow(name="compare_runs")
def compare_runs(run_ids: list[str], store: str = "./bcdflow-store", s3_endpoint_url: str | None = None,
                 target: str | None = None, tol: float = TOL, bracket_tol: float = BRACKET_TOL) -> dict:
    """Compare runs of one store by loss and cost; the table is published as a markdown artifact.

    Args:
        run_ids: The baseline first, then the runs to compare with it.
        store: The store URL.
        s3_endpoint_url: An S3-compatible endpoint for an s3:// store.
        target: L*: best (the baseline's best validation loss + tol, the default), final, common, or a loss.
        tol: What L* adds to the baseline's loss.
        bracket_tol: The widest bracket of a crossing, as a fraction of its step, that still gives a B-F.
    """
    st = open_store(RunConfig(store=store, s3={"endpoint_url": s3_endpoint_url}))
    result = compare(st, run_ids, target=target, tol=tol, bracket_tol=bracket_tol)
    artifacts.publish_markdown(artifacts.artifact_key("compare", "-".join(run_ids))[:200], result["markdown"],
                               description=f"bcdflow compare {' '.join(run_ids)}")
    return result
