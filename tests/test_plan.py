"""Block plans: which layers and parameter names each block owns (models/plan.py, docs/DESIGN.md §1).

Run: python -m pytest -q tests/test_plan.py   (CPU, well under a second per test)
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

from bcdflow.models import build_model, get_config, make_plan
from bcdflow.models.errors import ConfigError
from bcdflow.models.gpt import GPT
from bcdflow.models.llama import LLaMA
from bcdflow.models.plan import layer_bounds

_LAYER = re.compile(r"^h\.(\d+)\.")


def sizes_of(name: str, **over) -> dict[str, int]:
    """name -> element count from a meta-device model: no memory, so any registry size works."""
    cfg = get_config(name, **over)
    cls = {"gpt": GPT, "llama": LLaMA}[cfg.family]
    with torch.device("meta"):
        return {n: p.numel() for n, p in cls(cfg).named_parameters()}


def names_of(name: str, **over) -> list[str]:
    cfg = get_config(name, d_model=64, n_head=4, n_ctx=64, vocab_size=256, **over)
    return [n for n, _ in build_model(cfg, init=False).named_parameters()]  # uninitialised: names only


@pytest.fixture(params=["tiny", "tiny-llama"])
def family(request):
    return request.param


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 6])
def test_every_parameter_owned_by_exactly_one_block(family, blocks):
    names = names_of(family)
    plan = make_plan(names, 6, blocks)
    owned = [n for blk in plan.blocks for n in blk.params]
    assert sorted(owned) == sorted(names)  # nothing lost, nothing twice
    assert len(plan.visits) == blocks and [b.index for b in plan.blocks] == list(range(blocks))
    for blk in plan.blocks:
        for n in blk.params:
            assert plan.owner(n) == blk.index
            m = _LAYER.match(n)
            if m:  # a layer's tensors belong to the block whose range holds the layer
                assert blk.layers[0] <= int(m.group(1)) < blk.layers[1]
    with pytest.raises(KeyError):
        plan.owner("h.99.nope")


def test_embeddings_in_block_0_final_norm_and_head_in_last(family):
    names = names_of(family)
    plan = make_plan(names, 6, 3)
    first, last = plan.visits[0], plan.visits[len(plan.visits) - 1]
    emb = [n for n in names if n.startswith(("wte.", "wpe."))]
    head = [n for n in names if n.startswith(("ln_f.", "lm_head."))]
    assert emb and set(emb) <= set(first.params)
    assert head and set(head) <= set(last.params)
    assert any(n.startswith("ln_f.") for n in last.params)
    if family == "tiny":
        assert "wpe.weight" in first.params
    else:
        assert "lm_head.weight" in last.params and "lm_head.weight" not in first.params
    # the middle block holds layers only
    assert all(_LAYER.match(n) for n in plan.visits[1].params)


def test_tied_weight_belongs_to_block_0():
    names = names_of("tiny")
    assert "lm_head.weight" not in names  # tied: listed once, as the embedding
    plan = make_plan(names, 6, 3)
    assert plan.owner("wte.weight") == 0
    assert "wte.weight" not in plan.visits[2].params
    # an untied GPT gets its own head in the last block
    untied = make_plan(names_of("tiny", tie_embeddings=False), 6, 3)
    assert untied.owner("lm_head.weight") == 2 and untied.owner("wte.weight") == 0


@pytest.mark.parametrize("n_layer,blocks", [(6, 1), (6, 3), (6, 4), (7, 3), (12, 5), (30, 7), (5, 5)])
def test_layer_ranges_contiguous_covering_and_even(n_layer, blocks):
    cuts = layer_bounds(n_layer, blocks)
    plan = make_plan([], n_layer, blocks)
    ranges = [b.layers for b in plan.blocks]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous
    assert cuts == [r[0] for r in ranges] + [n_layer]
    sizes = [hi - lo for lo, hi in ranges]
    base, extra = divmod(n_layer, blocks)
    # even split; the remainder goes to the later blocks (block 0 already carries the embeddings)
    assert sizes == [base] * (blocks - extra) + [base + 1] * extra
    assert min(sizes) >= 1


def test_remainder_examples():
    assert [b.layers for b in make_plan([], 7, 3).blocks] == [(0, 2), (2, 4), (4, 7)]
    assert [b.layers for b in make_plan([], 8, 3).blocks] == [(0, 2), (2, 5), (5, 8)]


def test_explicit_boundaries(family):
    names = names_of(family)
    plan = make_plan(names, 6, blocks=None, boundaries=[2, 5])
    assert [b.layers for b in plan.blocks] == [(0, 2), (2, 5), (5, 6)]
    assert {n for n in plan.visits[1].params} == {n for n in names if _LAYER.match(n) and 2 <= int(_LAYER.match(n)[1]) < 5}
    # boundaries win over blocks
    assert make_plan(names, 6, blocks=6, boundaries=[2, 5]) == plan
    assert [b.layers for b in make_plan(names, 6, boundaries=[1]).blocks] == [(0, 1), (1, 6)]
    # a name -> size mapping does not move explicit cut points
    assert [b.layers for b in make_plan(sizes_of(family), 6, boundaries=[2, 5]).blocks] == [(0, 2), (2, 5), (5, 6)]


@pytest.mark.parametrize("bad", [[7], [-1, 3], [0], [6], [2, 6], [2, 1], [1, 1], [5, 2, 2]])
def test_boundaries_out_of_range_unsorted_or_repeated(bad):
    with pytest.raises(ConfigError, match=r"^bcd\.boundaries"):
        make_plan([], 6, boundaries=bad)


def test_one_block_owns_everything(family):
    names = names_of(family)
    plan = make_plan(names, 6, 1)
    assert len(plan.visits) == 1 and plan.visits[0].layers == (0, 6)
    assert set(plan.visits[0].params) == set(names)


@pytest.mark.parametrize("blocks", [0, -1, 7, None])
def test_bad_block_count_raises(blocks):
    with pytest.raises(ConfigError, match=r"^bcd\.blocks") as e:
        make_plan(names_of("tiny"), 6, blocks)
    assert "6" in str(e.value)  # names the limit


def test_unknown_parameter_name_is_rejected():
    with pytest.raises(ValueError, match="stray.weight"):
        make_plan(["wte.weight", "stray.weight"], 6, 2)


def test_plan_is_pure(family):
    names = names_of(family)
    frozen = copy.deepcopy(names)
    a = make_plan(names, 6, 3)
    b = make_plan(list(names), 6, 3)
    assert a == b and hash(a) == hash(b)  # frozen dataclasses: equal values, equal plans
    assert a.to_dict() == b.to_dict()
    assert names == frozen  # the input is not touched
    # the plan is data: it round-trips through JSON-friendly dicts
    d = a.to_dict()
    assert d["n_layer"] == 6 and [blk["layers"] for blk in d["blocks"]] == [[0, 2], [2, 4], [4, 6]]
    # block order of params follows the input order (stable, reproducible manifests)
    assert list(a.blocks[1].params) == [n for n in names if n in set(a.blocks[1].params)]


# -- blocks balanced by parameter count (a name -> size mapping; what runs use by default) -----------

def block_sizes(plan, sizes) -> list[int]:
    return [sum(sizes[n] for n in blk.params) for blk in plan.blocks]


@pytest.mark.parametrize("name,blocks", [("gpt2-124m", 3), ("tiny", 3), ("tiny-llama", 2), ("L-6B", 4),
                                         ("G-1.6B", 3)])
def test_balanced_split_cuts_nearest_equal_shares(name, blocks):
    sizes = sizes_of(name)
    n_layer = get_config(name).n_layer
    plan = make_plan(sizes, n_layer, blocks)
    # same ownership rules as the list form
    assert sorted(n for blk in plan.blocks for n in blk.params) == sorted(sizes)
    assert plan.owner(next(n for n in sizes if n.startswith("wte."))) == 0
    assert plan.owner("ln_f.weight") == blocks - 1
    ranges = [b.layers for b in plan.blocks]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer and all(hi > lo for lo, hi in ranges)
    # each cut is the layer boundary whose cumulative size (embeddings included) is nearest j/M of the
    # total, among the boundaries that leave every block at least one layer
    embed = sum(v for n, v in sizes.items() if n.startswith(("wte.", "wpe.")))
    layer = [sum(v for n, v in sizes.items() if n.startswith(f"h.{i}.")) for i in range(n_layer)]
    cum = [embed + sum(layer[:k]) for k in range(n_layer + 1)]
    total = sum(sizes.values())
    for j in range(1, blocks):
        cut, target = ranges[j][0], j * total / blocks
        allowed = range(ranges[j - 1][0] + 1, n_layer - (blocks - j) + 1)
        assert abs(cum[cut] - target) == min(abs(cum[k] - target) for k in allowed)


def test_balanced_split_examples():
    # GPT-2 124M: the 39M-parameter embedding is already a third of the model
    assert [b.layers for b in make_plan(sizes_of("gpt2-124m"), 12, 3).blocks] == [(0, 1), (1, 6), (6, 12)]
    # uniform layers and negligible embeddings/head: the same cuts as the even layer split
    small = sizes_of("tiny", d_model=64, n_head=4, vocab_size=16, n_ctx=8)
    assert make_plan(small, 6, 3) == make_plan(list(small), 6, 3)
    # huge embeddings never leave a block without a layer
    big = sizes_of("tiny", vocab_size=50_000)
    assert [b.layers for b in make_plan(big, 6, 6).blocks] == [(i, i + 1) for i in range(6)]


def test_balanced_split_is_more_even_than_layer_split():
    sizes = sizes_of("gpt2-124m")
    spread = lambda plan: max(block_sizes(plan, sizes)) - min(block_sizes(plan, sizes))  # noqa: E731
    assert spread(make_plan(sizes, 12, 3)) < spread(make_plan(list(sizes), 12, 3))


def test_balanced_split_is_pure_and_checks_block_count():
    sizes = sizes_of("tiny-llama")
    frozen = dict(sizes)
    assert make_plan(sizes, 6, 3) == make_plan(dict(sizes), 6, 3)
    assert sizes == frozen
    for bad in (0, 7):
        with pytest.raises(ConfigError, match=r"^bcd\.blocks"):
            make_plan(sizes, 6, bad)
