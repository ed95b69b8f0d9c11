"""Block plans: which layers and which exact parameter names each block owns (DESIGN §1).

Blocks are data, not code (CONVENTIONS 2). Ownership rules: block 0 owns the embeddings, the last
block owns the final norm and the LM head, and a tensor shared by several blocks (the tied
embedding/head of GPT-2) belongs to the lowest block that uses it: named_parameters() lists a
tied tensor once, under ``wte.weight``, so it lands in block 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from models.base import EMBED_PREFIXES, HEAD_PREFIXES
from models.errors import ConfigError

_LAYER = re.compile(r"^h\.(\d+)\.")


@dataclass(frozen=True)
class Block:
    index: int
    layers: tuple[int, int]  # [lo, hi)
    params: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"index": self.index, "layers": list(self.layers), "params": list(self.params)}


@dataclass(frozen=True)
class Plan:
    n_layer: int
    blocks: tuple[Block, ...]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, b: int) -> Block:
        return self.blocks[b]

    def owner(self, name: str) -> int:
        for blk in self.blocks:
            if name in blk.params:
                return blk.index
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"n_layer": self.n_layer, "blocks": [b.to_dict() for b in self.blocks]}


def layer_bounds(n_layer: int, blocks: int | None = None, boundaries: Sequence[int] | None = None) -> list[int]:
    """Cut points [0, c1, ..., n_layer] from a block count (even split; the remainder goes to the
    later blocks, since block 0 already carries the embeddings) or from explicit cut points."""
    if boundaries:
        cuts = sorted(set([0, *map(int, boundaries), n_layer]))
        if cuts[0] < 0 or cuts[-1] > n_layer:
            raise ConfigError(f"bcd.boundaries: cut points must lie in [0, {n_layer}], got {list(boundaries)}")
        return cuts
    if blocks is None or not 1 <= blocks <= n_layer:
        raise ConfigError(f"bcd.blocks: must be between 1 and n_layer={n_layer}, got {blocks}")
    base, extra = divmod(n_layer, blocks)
    sizes = [base + (1 if i >= blocks - extra else 0) for i in range(blocks)]
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    return cuts


def make_plan(param_names: Sequence[str], n_layer: int, blocks: int | None = None,
              boundaries: Sequence[int] | None = None) -> Plan:
    """Partition parameter names into blocks. Pure: same inputs, same plan."""
    cuts = layer_bounds(n_layer, blocks, boundaries)
    M = len(cuts) - 1
    owned: list[list[str]] = [[] for _ in range(M)]
    for name in param_names:
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            b = next(i for i in range(M) if cuts[i] <= layer < cuts[i + 1])
        elif name.startswith(EMBED_PREFIXES):
            b = 0
        elif name.startswith(HEAD_PREFIXES):
            b = M - 1
        else:
            raise ValueError(f"parameter {name!r} belongs to no layer, embedding or head")
        owned[b].append(name)
    return Plan(n_layer, tuple(Block(i, (cuts[i], cuts[i + 1]), tuple(owned[i])) for i in range(M)))
