"""The run's closing report as a task: figures and the exported model to its MLflow run
(``tracking.figures.log_run_outputs``). One retry: the model is safe in the store either way."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from bcdflow.core.config import RunConfig
from bcdflow.tracking.figures import log_run_outputs



@task(name="report-run", retries=1, retry_delay_seconds=[5], cache_policy=NO_CACHE)
def report_run(cfg: RunConfig, run_id: str, mlflow_run_id: str | None, version: int) -> None:
    """Figures and the exported model of ``version`` to the run's MLflow run."""
    log_run_outputs(cfg, run_id, mlflow_run_id, version)
