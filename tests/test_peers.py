"""The peer methods of issue 35 (models/peers.py): each registry entry trains a tiny model through the trainer's
step loop, its state (switching, projections) survives ``state_dict()`` -> ``torch.save`` -> ``torch.load
(weights_only=True)`` -> ``load_state_dict`` so a resumed loop ends bitwise where an uninterrupted one does, LISA
trains exactly the layers it sampled plus the embeddings and head, a BCD run refuses a peer, and a missing package
names the extra. The kill -9 resumes through the CLI are in tests/test_peer_runs.py."""
from __future__ import annotations

import io
import itertools

import pytest
import torch

from bcdflow.models import build_model, get_config
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.peers import LISA, blocks_of, layer_of
from bcdflow.models.visit_compute import visit_loss
from bcdflow.models.specs import CheckpointSchedule
from bcdflow.models.trainer import LoopHooks, LoopState, OptimSpec, StopRule, make_optimizer, run_steps

PEERS = sorted(n for n, o in OPTIMIZERS.items() if o.peer)
CFG = get_config("tiny", n_layer=4, d_model=32, n_head=2, vocab_size=97)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(CFG)


def _batches(n: int = 40):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(CFG.vocab_size, (n, 4, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _setup(name: str, model, spec: OptimSpec):
    """What the engine does: every parameter trainable, the wrapper (LoRA) applied, the optimizer by name."""
    for p in model.parameters():
        p.requires_grad_(True)
    named = list(model.named_parameters())
    finish = None
    if OPTIMIZERS[name].wrap:
        named, finish = OPTIMIZERS[name].wrap(model, spec)
    return named, make_optimizer(named, spec), finish


def _train(name: str, steps: int, spec: OptimSpec, stop_at: int | None = None, model=None, opt=None, named=None,
           state: LoopState | None = None):
    """Train ``steps`` steps; with ``stop_at``, a checkpoint of the loop is taken there and the loop stops."""
    model = model if model is not None else _model()
    if opt is None:
        named, opt, _ = _setup(name, model, spec)
    params = [p for _, p in named]
    saved = {}

    def loss(batch):
        return visit_loss(model, *batch, 0, False)

    def checkpoint(st, why):
        if saved:  # the one at ``stop_at`` only (the loop checkpoints again as it stops)
            return
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)  # what storage/trainckpt writes, read back as it reads
        saved.update(loop=LoopState.from_dict(st.to_dict()), optim=buf.getvalue(),
                     params={n: p.detach().clone() for n, p in named}, rng=torch.get_rng_state())

    start = state.steps if state else 0
    hooks = LoopHooks(checkpoint=checkpoint if stop_at else None,
                      should_stop=(lambda: bool(saved)) if stop_at else None)
    run_steps(loss, params, iter(_batches()[start:]), opt, spec, StopRule(max_steps=steps, window=2), hooks, state,
              CheckpointSchedule(every_steps=stop_at or 0))
    return model, opt, named, saved


@pytest.mark.parametrize("name", PEERS)
def test_each_peer_trains_and_resumes_bitwise(name):
    """Train 10 steps; or 4, a checkpoint, a fresh model and optimizer (another initial state: a new process),
    then the rest from the checkpoint: the same weights bit for bit. BAdam and LISA switch every 3 steps, so the
    checkpoint falls inside a switching period; GaLore and APOLLO refresh their projections at step 0 only."""
    spec = OptimSpec(name, lr=3e-3, switch_every=3, seed=7)
    ref, _, named_ref, _ = _train(name, 10, spec)
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    final = dict(ref.named_parameters()) if OPTIMIZERS[name].wrap is None else None
    if final is not None:  # it trained
        assert any(not torch.equal(final[n], start[n]) for n in start)
    _, _, _, saved = _train(name, 10, spec, stop_at=4)
    assert saved["loop"].steps == 4
    model = _model(seed=99)  # another start: everything must come from the checkpoint
    model.load_state_dict({k: v for k, v in _model().state_dict().items()})  # the run's version 0, as a resume
    named, opt, _ = _setup(name, model, spec)
    with torch.no_grad():
        for n, p in named:
            p.copy_(saved["params"][n])
    opt.load_state_dict(torch.load(io.BytesIO(saved["optim"]), weights_only=True))
    torch.set_rng_state(saved["rng"])
    _train(name, 10, spec, model=model, opt=opt, named=named, state=saved["loop"])
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_lisa_trains_exactly_the_sampled_layers_plus_embeddings_and_head():
    """Within a period only the sampled decoder layers and the embeddings, final norm and head change; the draw
    differs between periods, is a function of the seed, and at each switch every decoder layer loses its AdamW state
    (LMFlow's LISATrainer) while the embeddings, final norm and head keep theirs."""
    model = _model()
    spec = OptimSpec("lisa", lr=1e-2, switch_every=2, lisa_layers=2, seed=3)
    named, opt, _ = _setup("lisa", model, spec)
    assert isinstance(opt, LISA)
    draws = [opt.period_layers(k) for k in range(6)]
    assert all(len(d) == 2 and len(set(d)) == 2 for d in draws) and len({tuple(d) for d in draws}) > 1
    assert LISA(list(_model().named_parameters()), spec).period_layers(4) == draws[4]  # the seed decides
    batches = _batches()
    for k in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert opt.active == draws[k]
        for b in batches[2 * k: 2 * k + 2]:
            run_steps(lambda bt: visit_loss(model, *bt, 0, False), [p for _, p in named], iter([b]), opt, spec,
                      StopRule(max_steps=1, window=1))
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        trained = {n for n, _ in model.named_parameters() if layer_of(n) is None or layer_of(n) in draws[k]}
        assert changed == trained, (k, sorted(changed ^ trained))
        # after the period's last step the next draw is active and starts afresh: only the top holds AdamW state
        held = {n for n, p in model.named_parameters() if p in opt.state and opt.state[p]}
        assert held and {layer_of(n) for n in held} == {None}, sorted(held)


def test_badam_trains_one_block_at_a_time_in_a_seeded_reshuffled_order():
    model = _model()
    spec = OptimSpec("badam", lr=1e-2, switch_every=2, seed=5)
    named, opt, _ = _setup("badam", model, spec)
    blocks = blocks_of([n for n, _ in named])
    assert blocks == [["wpe.", "wte."], ["h.0."], ["h.1."], ["h.2."], ["h.3."], ["ln_f."]]
    order = [opt.block_at(i) for i in range(12)]
    assert sorted(order[:6]) == list(range(6)) and sorted(order[6:]) == list(range(6))  # each epoch: every block
    trained = []  # the block each step changed (exactly one block's parameters, nothing else)
    for b in _batches()[:9]:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        run_steps(lambda bt: visit_loss(model, *bt, 0, False), [p for _, p in named], iter([b]), opt, spec,
                  StopRule(max_steps=1, window=1))
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        (k,) = [k for k, pre in enumerate(blocks) if changed == {n for n, _ in named if n.startswith(tuple(pre))}]
        trained.append(k)
    # the package switches after its first step, then every switch_block_every steps
    assert trained == [order[0]] + [order[1]] * 2 + [order[2]] * 2 + [order[3]] * 2 + [order[4]] * 2


def test_galore_and_apollo_keep_low_rank_state_for_the_layer_matrices():
    """The planner counts AdamW's two full moments for a peer (an upper bound); the built state is smaller for the
    projected matrices (GaLore: rank d/4 moments; APOLLO-Mini: rank 1) and AdamW's for the rest."""
    for name, rank in (("galore", 8), ("apollo", 8), ("apollo-mini", 1)):
        model = _model()
        spec = OptimSpec(name, lr=1e-2)
        named, opt, _ = _setup(name, model, spec)
        _train(name, 1, spec, model=model, opt=opt, named=named)
        for n, p in named:
            st = opt.state[p]
            shapes = [t.shape for t in (st["exp_avg"], st["exp_avg_sq"])]
            if layer_of(n) is not None and p.dim() == 2:
                assert all(min(s) == rank for s in shapes), (name, n, shapes)
            else:
                assert shapes == [p.shape, p.shape], (name, n)
        assert OPTIMIZERS[name].state == 2


def test_lora_trains_adapters_only_and_merges_into_the_model_names():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = OptimSpec("lora", lr=1e-2)
    named, opt, finish = _setup("lora", model, spec)
    assert named and all("lora_" in n for n, _ in named) and not OPTIMIZERS["lora"].full_parameter
    _train("lora", 4, spec, model=model, opt=opt, named=named)
    finish()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()  # the model's own names again
    changed = {n for n in before if not torch.equal(after[n], before[n])}
    assert changed and all(layer_of(n) is not None and after[n].dim() == 2 for n in changed)  # merged into matrices
    assert torch.equal(after["wte.weight"], before["wte.weight"])


def test_a_bcd_run_or_several_processes_refuse_a_peer_and_a_missing_package_names_the_extra(monkeypatch):
    from bcdflow.errors import BadInput
    from bcdflow.models import peers

    OPTIMIZERS["galore"].check("galore", 1, 1)
    with pytest.raises(BadInput, match="optim.name: galore trains the whole model in the baseline's step loop"):
        OPTIMIZERS["galore"].check("galore", 3, 1)
    with pytest.raises(BadInput, match="train.gpus: optim.name=lisa trains in one process"):
        OPTIMIZERS["lisa"].check("lisa", 1, 2)
    OPTIMIZERS["adamw"].check("adamw", 3, 2)
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda n: None if n == "galore_torch" else real(n))
    with pytest.raises(BadInput, match=r"optim.name: galore needs the 'peers' extra \(galore_torch not installed\): "
                                       r"pip install 'bcdflow\[peers\]'"):
        OPTIMIZERS["galore"].check("galore", 1, 1)
    OPTIMIZERS["lisa"].check("lisa", 1, 1)  # written here: no package


def test_every_peer_builds_from_unnamed_parameters_too():
    """``make_optimizer`` with bare parameters (the trainer's old call) still builds every entry; LISA, which samples
    decoder layers, says there are none."""
    from bcdflow.errors import BadInput

    with pytest.raises(BadInput, match="optim.lisa_layers: 1 sampled layers, but the model has 0"):
        make_optimizer(list(torch.nn.Linear(8, 8).parameters()), OptimSpec("lisa"))
    for name in set(PEERS) - {"lisa"}:
        lin = torch.nn.Linear(8, 8)
        opt = make_optimizer(list(lin.parameters()), OptimSpec(name))
        lin(torch.randn(2, 8)).square().sum().backward()
        opt.step()
