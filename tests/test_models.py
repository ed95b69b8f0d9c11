"""Models: both families, part-by-part execution, partial models, sizes (models/).

Run: python -m pytest -q tests/test_models.py   (CPU, a few seconds; no big model is ever built)
"""
from __future__ import annotations

import re

import pytest
import torch

from bcdflow.models import REGISTRY, build_model, get_config
from tests.helpers import count_params
from bcdflow.models.errors import ConfigError
from bcdflow.models.families import FAMILIES as REGISTERED, decoder_class

# every registered family's tiny size (models/families.py): a new family runs through every test here once it has one
FAMILIES = [next(n for n, c in sorted(REGISTRY.items()) if c.family == f and n.startswith("tiny")) for f in REGISTERED]
TABLE8 = ["G-1.6B", "G-5.4B", "G-10B", "G-20B", "L-1.5B", "L-6B", "L-11B", "L-23B"]


def small(name: str, **kw):
    """The registry's tiny config, narrowed to d_model 64 so every test stays in milliseconds."""
    return get_config(name, d_model=64, n_head=4, n_ctx=64, vocab_size=256, **kw)


def tokens(cfg, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)


@pytest.fixture(params=FAMILIES)
def model_and_cfg(request):
    cfg = small(request.param)
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def test_forward_shapes(model_and_cfg):
    model, cfg = model_and_cfg
    t = tokens(cfg)
    x, y = t[:, :-1], t[:, 1:]
    assert model(x).shape == (2, 16, cfg.vocab_size)  # (B, T, vocab)
    assert model.embed(x).shape == (2, 16, cfg.d_model)  # (B, T, C)
    loss = model(x, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # a fresh model is close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5


@pytest.mark.parametrize("k", [0, 2, 6])
def test_parts_compose_to_the_whole_model(model_and_cfg, k):
    model, cfg = model_and_cfg
    t = tokens(cfg)
    x, y = t[:, :-1], t[:, 1:]
    with torch.no_grad():
        h = model.run_layers(model.embed(x), 0, k)
        h = model.run_layers(h, k, cfg.n_layer)
        assert torch.equal(model.loss(h, y), model(x, y))
        assert torch.equal(model.head(h), model(x))


@pytest.mark.parametrize("lo", [1, 3, 5])
def test_partial_model_matches_whole_model_from_prefix_hidden_states(model_and_cfg, lo):
    model, cfg = model_and_cfg
    part = build_model(cfg, layers=(lo, cfg.n_layer), embed=False, head=True, init=False)
    names = [n for n, _ in part.named_parameters()]
    # the partial model holds only layers >= lo and the head (plus wte for a tied head), same names
    assert not any(re.match(rf"h\.{i}\.", n) for n in names for i in range(lo))
    assert not any(n.startswith("wpe.") for n in names)
    assert ("wte.weight" in names) == cfg.tied
    whole = model.state_dict()
    part.load_state_dict({n: whole[n] for n in part.state_dict()}, strict=True)
    part.eval()
    t = tokens(cfg)
    x, y = t[:, :-1], t[:, 1:]
    with torch.no_grad():
        h = model.run_layers(model.embed(x), 0, lo)
        assert torch.equal(part.head(part.run_layers(h, lo, cfg.n_layer)), model(x))
        assert torch.equal(part.loss(part.run_layers(h, lo, cfg.n_layer), y), model(x, y))


def test_partial_prefix_model_has_no_head():
    cfg = small("tiny-llama")
    part = build_model(cfg, layers=(0, 2), embed=True, head=False)
    names = [n for n, _ in part.named_parameters()]
    assert "wte.weight" in names
    assert not any(n.startswith(("ln_f.", "lm_head.", "h.2.")) for n in names)


def test_gpt_head_is_tied_llama_head_is_not():
    gpt = build_model(small("tiny"))
    names = dict(gpt.named_parameters())
    assert "lm_head.weight" not in names and "wte.weight" in names
    assert not hasattr(gpt, "lm_head")
    # the head reads the very tensor the embedding does: a change to one is a change to the other
    with torch.no_grad():
        gpt.wte.weight.zero_()
        assert torch.count_nonzero(gpt.head(torch.randn(1, 3, 64))) == 0

    llama = build_model(small("tiny-llama"))
    assert not llama.cfg.tied
    assert llama.lm_head.weight.data_ptr() != llama.wte.weight.data_ptr()
    assert {"wte.weight", "lm_head.weight"} <= set(dict(llama.named_parameters()))


def test_grouped_query_attention_runs():
    cfg = small("tiny-llama", n_kv_head=2)
    assert cfg.kv_heads == 2 < cfg.n_head
    model = build_model(cfg)
    assert model.h["0"].attention.wk.weight.shape == (2 * cfg.head_dim, cfg.d_model)
    t = tokens(cfg)
    loss = model(t[:, :-1], t[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and model.h["0"].attention.wk.weight.grad is not None
    # multi-query (one kv head) too
    mq = build_model(small("tiny-llama", n_kv_head=1))
    assert mq(t[:, :-1]).shape == (2, 16, cfg.vocab_size)


def test_bad_gqa_head_count_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^model\.n_kv_head"):
        small("tiny-llama", n_kv_head=3)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("over", [{}, {"n_kv_head": 1}, {"tie_embeddings": True}, {"bias": False}])
def test_count_params_matches_built_model(name, over):
    if "n_kv_head" in over and name == "tiny":
        over = {"n_kv_head": None}
    cfg = small(name, **over)
    model = build_model(cfg, init=False)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_count_params_of_registry_tiny_configs():
    for name in FAMILIES:
        cfg = get_config(name)
        assert count_params(cfg) == sum(p.numel() for p in build_model(cfg, init=False).parameters())


def test_every_registry_name_resolves():
    expected = {"tiny", "tiny-llama", "gpt2-124m", *TABLE8}
    assert expected <= set(REGISTRY)
    for name in REGISTRY:
        cfg = get_config(name)
        assert cfg == REGISTRY[name]
        assert cfg.family == ("llama" if name.startswith(("L-", "tiny-llama")) else "gpt")
    with pytest.raises(ConfigError, match=r"^model\.name"):
        get_config("G-999B")


@pytest.mark.parametrize("name", TABLE8)
def test_table8_sizes_match_their_names(name):
    # computed from the config, never built: L-23B would need ~90 GB
    want = float(name.split("-")[1].rstrip("B")) * 1e9
    got = count_params(get_config(name))
    assert abs(got - want) / want <= 0.10, f"{name}: {got / 1e9:.2f}B"


def test_gpt2_124m_size():
    # 124M with the 50257 vocab; the padded 50304 vocab adds ~36k parameters
    assert abs(count_params(get_config("gpt2-124m")) - 124.4e6) / 124.4e6 < 0.01


def test_overrides_and_unknown_fields():
    cfg = get_config("gpt2-124m", n_layer=2, d_model=None)
    assert cfg.n_layer == 2 and cfg.d_model == 768
    with pytest.raises(ConfigError, match=r"^model\.nope"):
        get_config("tiny", nope=1)


@pytest.mark.parametrize("name", FAMILIES)
def test_sequence_longer_than_context_raises(name):
    cfg = small(name)
    model = build_model(cfg)
    idx = torch.zeros(1, cfg.n_ctx + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="n_ctx"):
        model(idx)
    assert model(idx[:, : cfg.n_ctx]).shape == (1, cfg.n_ctx, cfg.vocab_size)


def test_init_is_seeded():
    cfg = small("tiny")
    torch.manual_seed(3)
    a = build_model(cfg).state_dict()
    torch.manual_seed(3)
    b = build_model(cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rope_tables_are_sized_to_the_sequence_not_the_context_and_bitwise_its_rows():
    """A 131k-context model trained on short rows holds tables for the rows' length only; row p of a short table is
    bitwise row p of the context-long one, so the forward pass is unchanged bit for bit."""
    from bcdflow.models.llama import rope_tables

    cfg = get_config("tiny-llama", d_model=64, n_head=4, n_ctx=8192, vocab_size=256)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = tokens(cfg, T=24)[:, :-1]
    logits = model(x)
    cos, sin = model._rope
    assert cos.shape == (24, cfg.head_dim // 2)  # not (8192, ...)
    full_cos, full_sin = rope_tables(cfg.head_dim, cfg.n_ctx, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(cos, full_cos[:24]) and torch.equal(sin, full_sin[:24])
    # the forward with the context-long tables gives the same logits, bitwise
    model._rope = (full_cos, full_sin)
    assert torch.equal(model(x), logits)
    model._init_buffers()
    model(tokens(cfg, T=40)[:, :-1])  # a longer sequence grows the tables
    assert model._rope[0].size(0) == 40
    assert "rope_cos" not in model.state_dict()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_gives_the_planner_its_bytes_per_token(name):
    """The planner's hooks (models/base.Decoder) are the family's own: positive, at least the fp32 residual, and a
    trainable layer keeps at least what a frozen one on the gradient path does."""
    cfg = small(name)
    cls = decoder_class(cfg.family)
    assert cls is type(build_model(cfg))
    for s in (2, 4):
        frozen, trainable = cls.saved_bytes(cfg, s, "frozen"), cls.saved_bytes(cfg, s, "trainable")
        assert trainable >= frozen >= 4 * cfg.d_model
        assert cls.adapter_input_bytes(cfg, s) > 0 and cls.infer_bytes(cfg, s) >= 8 * cfg.d_model
    assert cls.buffer_bytes(cfg) >= 0


def test_no_code_branches_on_a_family_name_outside_the_registry():
    """A family is its module (a ``Decoder`` with its planner hooks, ``residual_projections`` and Hugging Face format
    ``hf``) plus its ``models/families.FAMILIES`` entry: no other module compares a family's name or keys a table by
    it (models/hf_names.py branched on ``family == "gpt"`` with LLaMA as the implicit else, and keyed its tables by
    family; models/base.py named both families' projections). The registry of named sizes (models/model_config.py)
    names the family of each size."""
    import ast
    import pathlib

    from bcdflow.models.families import FAMILIES

    root = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for layer in ("models", "core", "storage", "tasks", "flows", "tracking"):
        for path in sorted((root / layer).glob("*.py")):
            if path.name in ("families.py", "model_config.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Compare):
                    names = [n for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)]
                    names += [e for n in node.comparators if isinstance(n, (ast.Tuple, ast.List, ast.Set))
                              for e in n.elts if isinstance(e, ast.Constant)]
                elif isinstance(node, ast.Dict):
                    names = [k for k in node.keys if isinstance(k, ast.Constant)]
                found += [f"{layer}/{path.name}:{n.lineno} {n.value!r}" for n in names if n.value in FAMILIES]
    assert not found, found
