"""What every task and flow of a run shares: the two error families, the run config, the run context
(store, dataset, model config, plan, device; built once per process), spend, export, and the spot
preemption and failpoint hooks. No Prefect and no MLflow here (DESIGN §4): tasks and flows import it."""
