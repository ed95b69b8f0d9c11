"""Landscape expansion, partial (BREAD; docs/DESIGN.md §2.3, I1): while a visit trains its block, low-rank adapters on
the linear maps of the frozen layers after it (the suffix) train too, on the gradients the visit's backward computes
anyway to reach the block; the visit's end merges them into those layers' weights.

    adapters = SuffixAdapters(model, layers=range(hi, n), rank=8, seed=1234, device=dev)
    adapters.attach(model)          # forward hooks: Linear(x) + (x @ A^T) @ B^T
    ... train adapters.parameters() beside the block ...
    deltas = adapters.deltas()      # {"h.5.attn.c_attn.weight": B @ A (fp32, host)}
    adapters.detach()

Nothing of the model changes: the adapters are their own module beside it (never in ``model.named_parameters()``:
block files, plans and streamed weights keep their names and contents), applied by forward hooks on each suffix
layer's ``nn.Linear`` modules. A layer's weight is read, never written: a streamed frozen weight stays the host
copy's. ``B`` starts at zero, so the visit starts from the committed model exactly; ``A`` is drawn from a generator
of its own, seeded by the caller (the visit: tasks/expand.py), not from the global RNG. The adapters are fp32 master
weights; under bf16 autocast their matmuls run in bf16 as the layer's own does.

What backward keeps for an adapter (the planner's ``expand_bytes``): the input of each adapted linear (its ``A``
gradient needs it; a frozen linear alone keeps none) and the rank-r product (for ``B``'s gradient).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def adapted_linears(model: nn.Module, layers: Iterable[int]) -> list[tuple[str, nn.Linear]]:
    """The linear maps an expansion adapts: every ``nn.Linear`` of the given layers, named as the model names its
    weight's module (``h.{i}.attn.c_attn``), in layer order."""
    out = []
    for i in sorted(layers):
        for name, mod in model.h[str(i)].named_modules():
            if isinstance(mod, nn.Linear):
                out.append((f"h.{i}.{name}", mod))
    return out


class LowRank(nn.Module):
    """One linear map's update ``B @ A``: ``A`` (r, in), ``B`` (out, r)."""

    def __init__(self, d_in: int, d_out: int, rank: int, gen: torch.Generator):
        super().__init__()
        bound = 1 / math.sqrt(d_in)  # nn.Linear's own init scale: x @ A^T is of the size of a layer's output
        self.A = nn.Parameter(torch.empty(rank, d_in).uniform_(-bound, bound, generator=gen))
        self.B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B)  # (..., in) -> (..., r) -> (..., out)


class SuffixAdapters(nn.Module):
    """Low-rank adapters on every linear map of ``layers`` of ``model`` (the visit's suffix)."""

    def __init__(self, model: nn.Module, layers: Iterable[int], rank: int, seed: int,
                 device: torch.device | str = "cpu"):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # its own: the global RNG draws nothing more than without adapters
        self.names: list[str] = []
        self.adapters = nn.ModuleDict()
        for name, mod in adapted_linears(model, layers):
            self.names.append(name)
            self.adapters[_key(name)] = LowRank(mod.in_features, mod.out_features, rank, gen)
        self.to(device)
        self._hooks: list = []

    def attach(self, model: nn.Module) -> "SuffixAdapters":
        """Hook each adapted linear of ``model``: its output plus the adapter's."""
        self.detach()
        mods = dict(model.named_modules())
        for name in self.names:
            self._hooks.append(mods[name].register_forward_hook(self._hook(self.adapters[_key(name)])))
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @staticmethod
    def _hook(ad: LowRank):
        def hook(module, args, out):
            return out + ad(args[0])
        return hook

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """The adapter parameters named ``expand/{linear}.A`` / ``.B`` (a mid-visit checkpoint's keys), in a fixed
        order (the optimizer's)."""
        return [(f"expand/{n}.{k}", getattr(self.adapters[_key(n)], k)) for n in self.names for k in ("A", "B")]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the adapters from ``tensors`` (keys as :meth:`named`), e.g. a mid-visit checkpoint's."""
        with torch.no_grad():
            for n, p in self.named():
                p.copy_(tensors[n])

    @torch.no_grad()
    def deltas(self) -> dict[str, torch.Tensor]:
        """Each adapted linear's weight update ``B @ A`` in fp32 on the host, keyed by the weight's parameter name."""
        return {f"{n}.weight": (self.adapters[_key(n)].B.float() @ self.adapters[_key(n)].A.float()).cpu()
                for n in self.names}


def _key(name: str) -> str:
    return name.replace(".", "-")  # a module name may not hold dots


def merged(tensors: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """A block's stored ``tensors`` with the ``deltas`` that fall in it added in fp32 and cast back to each tensor's
    stored dtype; returns them and the norm of the update as stored (the new tensors minus the old, in fp32)."""
    out, sq = dict(tensors), 0.0
    for name, d in deltas.items():
        if name in tensors:
            old = tensors[name]
            new = (old.float() + d.to(old.device)).to(old.dtype)
            sq += float(((new.float() - old.float()) ** 2).sum())
            out[name] = new
    return out, math.sqrt(sq)
