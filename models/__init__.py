"""Pure PyTorch models for bcdflow: GPT-2 and LLaMA families, named configs, block plans,
prefix/suffix execution and the step loop. No Prefect, MLflow or fsspec here (docs/DESIGN.md §4)."""
from bcdflow.models.model_config import REGISTRY, ModelConfig, get_config
from bcdflow.models.plan import Block, Plan, make_plan
from bcdflow.models.build import build_model, model_plan, param_sizes

__all__ = ["REGISTRY", "ModelConfig", "get_config", "Block", "Plan", "make_plan", "build_model", "model_plan",
           "param_sizes"]
