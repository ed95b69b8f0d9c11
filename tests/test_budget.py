"""The adaptive step budget (``bcd.budget=adaptive``): a visit ends once its block lowers the loss more slowly than
the other blocks did on their last visits, so the steps go to the block that matters. A synthetic three-block model
(one block's error dominates the loss) runs the real step loop and the real bar (``core.rules.rate_to_beat``)."""
from __future__ import annotations

import types

import torch

from bcdflow.core.rules import rate_to_beat
from bcdflow.models.trainer import OptimSpec, StopRule, make_optimizer, run_steps


def _cycles(budget: str, total_steps: int = 1350, max_steps: int = 150):
    """Cyclic BCD on loss = sum_b scale_b * |w_b - 1|^2 + noise, whole cycles until ``total_steps`` are spent;
    returns the visits (block, steps, stopped_by, rate) and the final noiseless loss."""
    torch.manual_seed(0)
    scales = [1.0, 0.01, 0.01]  # block 0 matters
    w = [torch.nn.Parameter(torch.zeros(16)) for _ in scales]
    noise = torch.Generator().manual_seed(1)

    def loss_of():
        return sum(s * ((p - 1) ** 2).sum() for s, p in zip(scales, w))

    visits = []
    while sum(v.steps for v in visits) < total_steps:
        for b in range(len(w)):
            spec = OptimSpec("adamw", lr=0.002, weight_decay=0.0)
            bar = rate_to_beat(visits, b) if budget == "adaptive" else None
            res = run_steps(lambda _: loss_of() + 0.05 * torch.randn((), generator=noise), [w[b]],
                            iter(lambda: torch.zeros(1), None), make_optimizer([w[b]], spec), spec,
                            StopRule(max_steps=max_steps, window=10, min_rate=bar))
            visits.append(types.SimpleNamespace(block=b, steps=res.steps, stopped_by=res.stopped_by, rate=res.rate))
    with torch.no_grad():
        return visits, float(loss_of())


def test_the_adaptive_budget_gives_the_steps_to_the_block_that_lowers_the_loss():
    fixed, fixed_loss = _cycles("fixed")
    adaptive, adaptive_loss = _cycles("adaptive")
    assert [v.steps for v in fixed] == [150] * 9  # three cycles
    first = adaptive[:9]  # three cycles, while block 0 is far from its optimum (later ones chase noise)
    steps = {b: sum(v.steps for v in first if v.block == b) for b in range(3)}
    # block 0 trains to its cap each time; the others stop at the rule's shortest horizon (2 windows)
    assert {v.steps for v in first if v.block == 0} == {150}
    assert {(v.steps, v.stopped_by) for v in first if v.block} == {(20, "budget")}
    assert steps[0] > 3 * (steps[1] + steps[2]), steps
    # for the same steps in all, the loss ends lower: what the fixed visits spent on blocks 1 and 2 bought little
    assert adaptive_loss < 0.5 * fixed_loss, (adaptive_loss, fixed_loss)
