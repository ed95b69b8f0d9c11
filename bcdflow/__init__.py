"""bcdflow: train LLMs with block coordinate descent as a Prefect workflow with staged Zarr artifacts.

The package's layers live in the repository's top-level folders and install as its subpackages
(``pyproject.toml`` maps them): ``bcdflow.errors`` at the bottom, then ``bcdflow.models`` (PyTorch) and
``bcdflow.storage`` (the store and its layout), ``bcdflow.core`` (the run config and context), ``bcdflow.tracking``
(MLflow), ``bcdflow.tasks`` (Prefect tasks) and ``bcdflow.flows`` (Prefect flows and the CLI) on top.
docs/DESIGN.md says what each layer may import.
"""

__version__ = "0.1.0"
