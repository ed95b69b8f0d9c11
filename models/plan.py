"""Block plans: which layers and which exact parameter names each block owns (docs/DESIGN.md §1).

Blocks are data, not code (docs/CONVENTIONS.md 2). Ownership rules: block 0 owns the embeddings, the last
block owns the final norm and the LM head, and a tensor shared by several blocks (the tied
embedding/head of GPT-2) belongs to the lowest block that uses it: named_parameters() lists a
tied tensor once, under ``wte.weight``, so it lands in block 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from bcdflow.models.errors import ConfigError

EMBED_PREFIXES = ("wte.", "wpe.")
HEAD_PREFIXES = ("ln_f.", "lm_head.")

_LAYER = re.compile(r"^h\.(\d+)\.")


@dataclass(frozen=True)
class Block:
    index: int
    layers: tuple[int, int]  # [lo, hi)
    params: tuple[str, ...]
    split: tuple[str, ...] = ()
    """A stored block: its vocabulary matrices trained in row blocks (``bcd.vocab_blocks``), not by its own visit."""
    rows: tuple[int, int] | None = None
    """A row block: the rows [lo, hi) of its one parameter (``params``) it trains; None: a stored block."""
    owner: int | None = None
    """A row block: the stored block that holds its matrix (whose file its visit commits)."""

    def to_dict(self) -> dict:
        d = {"index": self.index, "layers": list(self.layers), "params": list(self.params)}
        if self.split:
            d["split"] = list(self.split)
        if self.rows is not None:
            d.update(rows=list(self.rows), owner=self.owner)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Block":
        return cls(d["index"], tuple(d["layers"]), tuple(d["params"]), tuple(d.get("split", ())),
                   tuple(d["rows"]) if d.get("rows") is not None else None, d.get("owner"))

    def reads_activations(self, preinfer: bool) -> bool:
        """Whether this block's visit trains from the frozen prefix's stored activations (paper §3.2.2): with
        pre-inference on, every block with a prefix (not the first). The one place this rule is spelled."""
        return preinfer and self.layers[0] > 0

    def trainable(self, freeze: Sequence[str], tied: bool) -> set[str]:
        """The parameters this block's visit trains: its own, less what ``bcd.freeze`` keeps frozen and the matrices
        its row blocks train (a row block: its matrix, whose rows ``rows`` it trains)."""
        return set(self.params) - frozen_names(self.params, freeze, tied) - set(self.split)

    def frozen_layers(self, n_layer: int, preinfer: bool) -> list[int]:
        """The frozen layers this block's visit holds: the suffix, and the prefix when it reads no stored
        activations (the layers a streamed visit keeps in host memory)."""
        lo, hi = self.layers
        start = lo if self.reads_activations(preinfer) else 0
        return [i for i in range(start, n_layer) if not lo <= i < hi]


@dataclass(frozen=True)
class Plan:
    """The blocks a run visits: ``blocks``, the stored blocks (each one file of a version's manifest), then ``rows``,
    the row blocks of its vocabulary matrices (``bcd.vocab_blocks``), numbered after them; a row block's visit commits
    the stored block that holds its matrix (``Block.owner``). ``len`` and indexing cover both: every visit's."""
    n_layer: int
    blocks: tuple[Block, ...]
    rows: tuple[Block, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks) + len(self.rows)

    def __getitem__(self, b: int) -> Block:
        if b < 0:
            raise IndexError(b)
        return self.blocks[b] if b < len(self.blocks) else self.rows[b - len(self.blocks)]

    def stored(self, b: int) -> int:
        """The stored block whose file block ``b``'s visit commits (itself, or a row block's owner)."""
        blk = self[b]
        return blk.index if blk.owner is None else blk.owner

    def suffix(self, b: int, freeze: Sequence[str], tied: bool) -> set[str]:
        """What ``bcd.expand=sign`` steps in block ``b``'s visit: every parameter the stored blocks after it train
        (``bcd.freeze`` kept; a tied head is block 0's embedding, never a suffix's); none for a row block or the last
        block."""
        blk = self[b]
        if blk.rows is not None or blk.layers[1] >= self.n_layer:
            return set()
        return {n for later in self.blocks[self.stored(b) + 1:] for n in later.trainable(freeze, tied)}

    def owner(self, name: str) -> int:
        for blk in self.blocks:
            if name in blk.params:
                return blk.index
        raise KeyError(name)

    def to_dict(self) -> dict:
        d = {"n_layer": self.n_layer, "blocks": [b.to_dict() for b in self.blocks]}
        if self.rows:  # the stored blocks stay ``blocks``: what the manifests, export and prune read
            d["rows"] = [b.to_dict() for b in self.rows]
        return d


def layer_bounds(n_layer: int, blocks: int | None = None, boundaries: Sequence[int] | None = None,
                 layer_sizes: Sequence[int] | None = None, embed_size: int = 0, head_size: int = 0) -> list[int]:
    """Cut points [0, c1, ..., n_layer] from explicit cut points, or from a block count: with
    ``layer_sizes`` the cuts balance parameter counts (block 0 also carries the embeddings, the last
    block the head: the paper's "update one third of the parameters", §4.1); without, an even layer
    split with the remainder on the later blocks."""
    if boundaries:
        cuts = [int(c) for c in boundaries]
        if any(not 0 < c < n_layer for c in cuts):
            raise ConfigError(f"bcd.boundaries: cut points must lie strictly between 0 and n_layer={n_layer}, "
                              f"got {cuts}")
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ConfigError(f"bcd.boundaries: cut points must be strictly increasing (no repeats), got {cuts}")
        return [0, *cuts, n_layer]
    if blocks is None or not 1 <= blocks <= n_layer:
        raise ConfigError(f"bcd.blocks: must be between 1 and n_layer={n_layer}, got {blocks}")
    if layer_sizes is not None:
        return _balanced_cuts(list(layer_sizes), blocks, embed_size, head_size)
    base, extra = divmod(n_layer, blocks)
    sizes = [base + (1 if i >= blocks - extra else 0) for i in range(blocks)]
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    return cuts


def _balanced_cuts(layer_sizes: list[int], blocks: int, embed_size: int, head_size: int) -> list[int]:
    """Each cut at the layer boundary whose cumulative size is nearest j/M of the total, keeping at
    least one layer per block."""
    n = len(layer_sizes)
    cum = [embed_size]
    for size in layer_sizes:
        cum.append(cum[-1] + size)  # cum[k] = params of embeddings + layers [0, k)
    total = cum[-1] + head_size
    cuts = [0]
    for j in range(1, blocks):
        lo, hi = cuts[-1] + 1, n - (blocks - j)
        cuts.append(min(range(lo, hi + 1), key=lambda k: (abs(cum[k] - j * total / blocks), k)))
    return cuts + [n]


def make_plan(param_names: Sequence[str] | Mapping[str, int], n_layer: int, blocks: int | None = None,
              boundaries: Sequence[int] | None = None) -> Plan:
    """Partition parameter names into blocks. Pure: same inputs, same plan.

    ``param_names`` is a list of names (even layer split) or a mapping name -> element count (blocks
    balanced by parameter count)."""
    sizes = None
    if isinstance(param_names, Mapping):
        layer_sizes, embed, head = [0] * n_layer, 0, 0
        for name, numel in param_names.items():
            m = _LAYER.match(name)
            if m:
                layer_sizes[int(m.group(1))] += numel
            elif name.startswith(EMBED_PREFIXES):
                embed += numel
            else:
                head += numel
        sizes = {"layer_sizes": layer_sizes, "embed_size": embed, "head_size": head}
    cuts = layer_bounds(n_layer, blocks, boundaries, **(sizes or {}))
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


VOCAB_MATRICES = {"wte.weight": "wte", "lm_head.weight": "lm_head"}
"""The vocabulary matrices a plan may split into row blocks (``bcd.vocab_blocks``), and the module holding each."""


def row_cuts(rows: int, parts: int) -> list[int]:
    """Cut points [0, ..., rows] of ``parts`` row blocks as even as they go (the remainder on the later ones, as an
    even layer split)."""
    base, extra = divmod(rows, parts)
    cuts = [0]
    for i in range(parts):
        cuts.append(cuts[-1] + base + (1 if i >= parts - extra else 0))
    return cuts


def split_rows(plan: Plan, shapes: Mapping[str, Sequence[int]], parts: int, frozen: Iterable[str] = ()) -> Plan:
    """``plan`` with each vocabulary matrix in ``shapes`` (the token embedding, then an untied head; not those
    ``frozen``) split into ``parts`` row blocks (``bcd.vocab_blocks``), numbered after the stored blocks: embedding
    rows ``layers`` (0, 0) (on the gradient path through every layer), head rows (n_layer, n_layer) (from the last
    layer's states). ``parts`` 1: the plan as it is."""
    if parts <= 1:
        return plan
    frozen = set(frozen)
    names = [n for n in VOCAB_MATRICES if n in shapes and n not in frozen]
    for name in names:
        if not 1 <= parts <= shapes[name][0]:
            raise ConfigError(f"bcd.vocab_blocks: {name} has {shapes[name][0]} rows, so at most that many row "
                              f"blocks, got {parts}")
    rows, blocks = [], list(plan.blocks)
    for name in names:
        owner = plan.owner(name)
        blocks[owner] = Block(owner, blocks[owner].layers, blocks[owner].params,
                              blocks[owner].split + (name,))
        at = 0 if name == "wte.weight" else plan.n_layer
        cuts = row_cuts(shapes[name][0], parts)
        rows += [Block(len(plan.blocks) + len(rows) + k, (at, at), (name,), rows=(cuts[k], cuts[k + 1]),
                       owner=owner) for k in range(parts)]
    return Plan(plan.n_layer, tuple(blocks), tuple(rows))


FREEZABLE = {"embeddings": EMBED_PREFIXES, "head": ("lm_head.",)}


def frozen_names(names: Iterable[str], freeze: Sequence[str], tied: bool) -> set[str]:
    """The parameters ``bcd.freeze`` keeps frozen in every visit: ``embeddings`` (token and position), ``head``
    (the output projection; a tied head is the token embedding, so freezing either freezes it)."""
    prefixes = tuple(p for f in freeze for p in FREEZABLE[f]) + (("wte.",) if tied and "head" in freeze else ())
    return {n for n in names if prefixes and n.startswith(prefixes)}


def block_tensors(model, plan: Plan, b: int) -> dict:
    """Block ``b``'s tensors of ``model`` (whole or partial, global names): detached, contiguous, on the CPU."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().to("cpu").contiguous() for n in plan[b].params}
