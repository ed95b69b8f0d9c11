"""Block orders (``bcd.order``, docs/DESIGN.md §2.9): the registry the config's choice type is made from.

    ORDERS["random"](seed, n_blocks, cycle) -> [2, 0, 1]     # the cycle's blocks in visiting order

A new order is one entry here: ``core/config.Order`` lists these names, and ``core/rules.cycle_order`` calls the
entry. ``greedy`` is a candidate list only: the flow picks among the cycle's remaining blocks visit by visit (the
largest gradient norm, ``tasks/train.choose_block``).
"""
from __future__ import annotations

from typing import Callable


def _random(seed: int, n_blocks: int, cycle: int) -> list[int]:
    import numpy as np  # here: the config reads this registry's names at once (the read-only commands)

    rng = np.random.default_rng(np.random.SeedSequence([seed, cycle, 7919]))  # a permutation per (seed, cycle)
    return [int(b) for b in rng.permutation(n_blocks)]


ORDERS: dict[str, Callable[[int, int, int], list[int]]] = {
    "cyclic": lambda seed, n, cycle: list(range(n)),  # 0..M-1, the paper's
    "reverse": lambda seed, n, cycle: list(range(n - 1, -1, -1)),
    "random": _random,
    "greedy": lambda seed, n, cycle: list(range(n)),
}
