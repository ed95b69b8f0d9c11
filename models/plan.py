"""Block plans: which layers and which exact parameter names each block owns (docs/DESIGN.md §1).

Blocks are data, not code (docs/CONVENTIONS.md 2). Ownership rules: block 0 owns the embeddings, the last
block owns the final norm and the LM head, and a tensor shared by several blocks (the tied
embedding/head of GPT-2) belongs to the lowest block that uses it: named_parameters() lists a
tied tensor once, under ``wte.weight``, so it lands in block 0.
"""
from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from bcdflow.models.errors import ConfigError

EMBED_PREFIXES = ("wte.", "wpe.")
HEAD_PREFIXES = ("ln_f.", "lm_head.")

_LAYER = re.compile(r"^h\.(\d+)\.")


@functools.lru_cache(maxsize=None)  # the planner asks millions of times about a few thousand names
def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (``h.{i}.*``), None for the embeddings and the head."""
    return int(name.split(".")[1]) if name.startswith("h.") else None


@dataclass(frozen=True)
class Block:
    """A stored block: one file of a version's manifest (``params``: the tensors it holds) and the layers it owns."""
    index: int
    layers: tuple[int, int]  # [lo, hi)
    params: tuple[str, ...]
    split: tuple[str, ...] = ()
    """Its vocabulary matrices trained in row visits (``bcd.vocab_blocks``), not by its own visit."""

    def to_dict(self) -> dict:
        d = {"index": self.index, "layers": list(self.layers), "params": list(self.params)}
        if self.split:
            d["split"] = list(self.split)
        return d


VISIT_KINDS = {"layers": "bcdflow.models.plan:LayerVisit", "rows": "bcdflow.models.rows:RowVisit"}
"""Each kind of visit and the class that says what it trains, holds and commits (a :class:`LayerVisit` or its
subclass), ``module:Class``, imported on first use (the row kind's module holds torch). A new kind of visit is its
module and one line here (docs/DESIGN.md, where a change goes)."""


class LayerVisit:
    """A stored block's own visit: it trains the block's parameters whole (less ``bcd.freeze`` and its ``split``
    matrices) and commits the block's file. Every hook is the plain case; another kind overrides what differs."""

    expands = True
    """Whether ``bcd.expand`` (adapters or the state-free rule on the layers after it) applies."""

    def label(self, t: "VisitTarget") -> str | None:
        """What reports print as what it trains beside its layers (None: its layers say it)."""
        return None

    def report(self, t: "VisitTarget") -> dict:
        """The fields ``plan-memory``'s visit rows add for this kind (``label``: its table's narrow cell)."""
        return {}

    def trained_shape(self, t: "VisitTarget", name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of what trains of parameter ``name`` (of ``shape``)."""
        return tuple(shape)

    def memory_terms(self, t: "VisitTarget", terms: dict, m) -> dict:
        """models/memory.visit_memory's gradient terms of the loss, the embedding and the optimizer (``terms``) as
        this kind makes them; ``m``: the visit's figures there."""
        return terms

    def commit_host_bytes(self, t: "VisitTarget", file_bytes: int, numel: Mapping[str, int]) -> int:
        """Host bytes its commit takes, the stored block's file being ``file_bytes``."""
        return file_bytes

    def model_trainable(self, active: frozenset) -> frozenset:
        """What the visit's model loads trainable (a kind that trains a slice loads its matrix frozen)."""
        return active

    def attach(self, t: "VisitTarget", model, named: list, master, read_stored: Callable) -> list:
        """The (name, parameter) list the optimizer steps, once the model is built; ``read_stored(name)`` gives a
        stored tensor of the version it starts from (its stored dtype, read-only, on the host)."""
        return named

    def commit(self, t: "VisitTarget", named: list, read_block: Callable) -> dict | None:
        """The tensors its commit writes, or None: the model's block tensors (tasks/engine.py);
        ``read_block()`` gives the stored block's tensors as the base version stores them."""
        return None


@dataclass(frozen=True)
class VisitTarget:
    """One visit of a run (``Plan.visits``): its index, its kind (:data:`VISIT_KINDS`), the stored block whose file
    its commit writes, the layers it trains at (the gradient path starts there), the parameters it trains and, for a
    row visit, the rows [lo, hi) of its one matrix."""
    index: int
    kind: str
    stored: int
    layers: tuple[int, int]
    params: tuple[str, ...]
    split: tuple[str, ...] = ()
    rows: tuple[int, int] | None = None

    @property
    def mechanism(self) -> LayerVisit:
        """The kind's class (an instance), imported on first use."""
        return _kind(self.kind)

    def to_dict(self) -> dict:
        d = {"index": self.index, "layers": list(self.layers), "params": list(self.params)}
        if self.split:
            d["split"] = list(self.split)
        if self.rows is not None:
            d.update(rows=list(self.rows), owner=self.stored)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VisitTarget":
        """A visit as a run's record stores it (``Plan.to_dict``: a stored block's, or a row visit's with its owner)."""
        rows = d.get("rows")
        return cls(d["index"], "layers" if rows is None else "rows", d["index"] if rows is None else d["owner"],
                   tuple(d["layers"]), tuple(d["params"]), tuple(d.get("split", ())),
                   None if rows is None else tuple(rows))

    def reads_activations(self, preinfer: bool) -> bool:
        """Whether this visit trains from the frozen prefix's stored activations (paper §3.2.2): with
        pre-inference on, every visit with a prefix (not the first). The one place this rule is spelled."""
        return preinfer and self.layers[0] > 0

    def trainable(self, freeze: Sequence[str], tied: bool) -> set[str]:
        """The parameters this visit trains: its own, less what ``bcd.freeze`` keeps frozen and the matrices
        its block's row visits train (a row visit: its matrix, whose rows ``rows`` it trains)."""
        return set(self.params) - frozen_names(self.params, freeze, tied) - set(self.split)

    def frozen_layers(self, n_layer: int, preinfer: bool) -> list[int]:
        """The frozen layers this visit holds: the suffix, and the prefix when it reads no stored
        activations (the layers a streamed visit keeps in host memory)."""
        lo, hi = self.layers
        start = lo if self.reads_activations(preinfer) else 0
        return [i for i in range(start, n_layer) if not lo <= i < hi]


@functools.cache
def _kind(kind: str) -> LayerVisit:
    module, name = VISIT_KINDS[kind].split(":")
    return getattr(importlib.import_module(module), name)()


@dataclass(frozen=True)
class Plan:
    """The stored blocks of a run (``blocks``: each one file of a version's manifest) and the visits that train
    them (``visits``: one per stored block, in order, then any others, numbered after them: the row visits of the
    vocabulary matrices, ``bcd.vocab_blocks``). Loops over visits read ``visits``, loops over files ``blocks``."""
    n_layer: int
    blocks: tuple[Block, ...]
    extra: tuple[VisitTarget, ...] = ()
    """The visits beyond each stored block's own (numbered from ``len(blocks)``)."""

    @functools.cached_property
    def visits(self) -> tuple[VisitTarget, ...]:
        own = tuple(VisitTarget(b.index, "layers", b.index, b.layers, b.params, b.split) for b in self.blocks)
        return own + self.extra

    def counts(self) -> str:
        """The plan in words: "3 blocks", "3 blocks, 4 row visits"."""
        kinds: dict[str, int] = {}
        for v in self.extra:
            kinds[v.kind] = kinds.get(v.kind, 0) + 1
        return ", ".join([f"{len(self.blocks)} block{'s' * (len(self.blocks) != 1)}",
                          *(f"{k} {kind[:-1] if kind.endswith('s') else kind} visit{'s' * (k != 1)}"
                            for kind, k in kinds.items())])

    def suffix(self, b: int, freeze: Sequence[str], tied: bool) -> set[str]:
        """What ``bcd.expand=sign`` steps in visit ``b``: every parameter the stored blocks after it train
        (``bcd.freeze`` kept; a tied head is block 0's embedding, never a suffix's); none for a kind that does not
        expand or the last block."""
        v = self.visits[b]
        if not v.mechanism.expands or v.layers[1] >= self.n_layer:
            return set()
        return {n for later in self.visits[v.stored + 1:len(self.blocks)] for n in later.trainable(freeze, tied)}

    def owner(self, name: str) -> int:
        for blk in self.blocks:
            if name in blk.params:
                return blk.index
        raise KeyError(name)

    def to_dict(self) -> dict:
        d = {"n_layer": self.n_layer, "blocks": [b.to_dict() for b in self.blocks]}
        if self.extra:  # the stored blocks stay ``blocks``: what the manifests, export and prune read
            d["rows"] = [v.to_dict() for v in self.extra]
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
        blocks[owner] = Block(owner, blocks[owner].layers, blocks[owner].params, blocks[owner].split + (name,))
        at = 0 if name == "wte.weight" else plan.n_layer
        cuts = row_cuts(shapes[name][0], parts)
        rows += [VisitTarget(len(plan.blocks) + len(rows) + k, "rows", owner, (at, at), (name,),
                             rows=(cuts[k], cuts[k + 1])) for k in range(parts)]
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
    return {n: params[n].detach().to("cpu").contiguous() for n in plan.blocks[b].params}
