"""Build a part of the model from a version manifest: only the tensors that part needs are read.

A visit to block b with pre-inference holds layers of blocks >= b and the head (invariant I6); the
tied GPT-2 head also needs ``wte.weight``, which block 0 owns, so that one tensor comes along frozen.
"""
from __future__ import annotations

import torch

from models import Plan, build_model
from models.base import Decoder
from models.config import ModelConfig
from storage import checkpoints
from storage.store import Store


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_part(store: Store, run_id: str, manifest: dict, mcfg: ModelConfig, plan: Plan,
              layers: tuple[int, int], embed: bool, head: bool, device: torch.device) -> Decoder:
    model = build_model(mcfg, layers=layers, embed=embed, head=head, device=device, init=False)
    names = [n for n, _ in model.named_parameters()]
    owners = sorted({plan.owner(n) for n in names})
    tensors = checkpoints.load_from_manifest(store, run_id, manifest, owners, names=names, device=device)
    model.load_state_dict(tensors, strict=True)
    return model


def block_tensors(model: Decoder, plan: Plan, b: int) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].detach().to("cpu").contiguous() for n in plan[b].params}


def autocast(device: torch.device, precision: str):
    """bf16 autocast for the forward pass where asked; fp32 otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
