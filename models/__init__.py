"""Pure PyTorch models for bcdflow: GPT-2 and LLaMA families, named configs, block plans,
prefix/suffix execution and the step loop. No Prefect, MLflow or fsspec here (docs/DESIGN.md §4).

Importing the package loads no torch: the configs, plans and the records the run config builds (models/specs.py)
are torch-free, and ``build_model``, ``model_plan`` and ``param_sizes`` (models/build.py) import it on first use."""
from bcdflow.models.model_config import REGISTRY, ModelConfig, get_config
from bcdflow.models.plan import Block, Plan, make_plan

__all__ = ["REGISTRY", "ModelConfig", "get_config", "Block", "Plan", "make_plan", "build_model", "model_plan",
           "param_sizes"]
_BUILD = ("build_model", "model_plan", "param_sizes")


def __getattr__(name: str):
    if name in _BUILD:  # torch: imported when a model is built or planned, not with the package
        from bcdflow.models import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
