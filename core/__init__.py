"""What every task and flow of a run shares: the run config (data and validation), the run context (resolves the
model, opens the store, picks the device; built once per process and handed to every task), spend, export, the
Hugging Face import, and the spot preemption and failpoint hooks. No Prefect and no MLflow here
(docs/DESIGN.md §4): tasks and flows import it."""
