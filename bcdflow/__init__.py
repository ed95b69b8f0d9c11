"""bcdflow: train LLMs with block coordinate descent as a Prefect workflow with staged Zarr artifacts.

The package's layers live in the repository's top-level folders and install as its subpackages
(``pyproject.toml`` maps them): ``bcdflow.errors`` at the bottom, then ``bcdflow.models`` (PyTorch) and
``bcdflow.storage`` (the store and its layout), ``bcdflow.core`` (the run config and context), ``bcdflow.tracking``
(MLflow), ``bcdflow.tasks`` (Prefect tasks) and ``bcdflow.flows`` (Prefect flows and the CLI) on top.
docs/DESIGN.md says what each layer may import.
"""

__version__ = "0.1.0"

# A checkout used without an install (the GPU machine's check: its own torch, the wheels of `make gpu-wheels` on
# PYTHONPATH, the repository itself beside them): the layers are the repository's top-level folders, as
# pyproject.toml's package-dir maps them for an install, so they are this package's path too. An install (editable or
# not) finds the same files either way; an installed wheel has no pyproject.toml beside it and is left alone.
import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "core")):
    __path__.append(_root)  # noqa: F821 - a package's own __path__
del _os, _root
