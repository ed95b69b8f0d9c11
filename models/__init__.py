"""Pure PyTorch models for bcdflow: GPT-2 and LLaMA families, named configs, block plans,
prefix/suffix execution and the step loop. No Prefect, MLflow or fsspec here (DESIGN §4)."""
from models.config import REGISTRY, ModelConfig, get_config
from models.plan import Block, Plan, make_plan
from models.base import build_model

__all__ = ["REGISTRY", "ModelConfig", "get_config", "Block", "Plan", "make_plan", "build_model"]
