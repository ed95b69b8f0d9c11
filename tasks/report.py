"""The run's closing report as a task: figures and the exported model to its MLflow run
(``tracking.report.log_run_outputs``). One retry: the model is safe in the store either way."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from bcdflow.tracking.report import log_run_outputs

report_run = task(log_run_outputs, name="report-run", retries=1, retry_delay_seconds=[5], cache_policy=NO_CACHE)
