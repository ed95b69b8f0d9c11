"""The lighter states of the active block (issue 33, models/light.py): bitsandbytes' 8-bit AdamW moments, updated a
chunk at a time, and bf16 master weights rounded stochastically; a run refuses one where it cannot run. The planner's
agreement with the tensor tracker for them is in tests/test_memory.py."""
from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch

from bcdflow.models import light
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.trainer import OptimSpec, make_optimizer
from bcdflow.tasks.engine import optimizer_state, optimizer_tensors

LIGHT = sorted(n for n, o in OPTIMIZERS.items() if o.light)


def test_stochastic_rounding_is_exact_in_expectation_and_lands_on_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # an eighth of the way from 1 to the next bf16, 1 + 2**-7
    out = light.stochastic_round(x, torch.Generator().manual_seed(0))
    up = torch.tensor(1.0 + 2 ** -7, dtype=torch.bfloat16)  # bf16 keeps 7 mantissa bits: the next value above 1
    assert out.dtype == torch.bfloat16 and set(out.unique().tolist()) == {1.0, float(up)}
    assert abs(out.float().mean().item() - x[0].item()) < 2e-5  # 1/8 of the way up, on average
    neg = light.stochastic_round(-x, torch.Generator().manual_seed(0))
    assert torch.equal(neg, -out)  # sign-magnitude: the same draw rounds -x to -(the rounding of x)
    assert light.stochastic_round(torch.tensor([float("inf"), -float("inf")]), torch.Generator()).isinf().all()


def test_bf16_master_weights_take_updates_below_half_a_bf16_step():
    """At lr 1e-4 an update to a weight near 1 is 1/78 of a bf16 step: rounded to nearest it would be lost every
    step; rounded stochastically the weights move by the updates' sum on average."""
    w = torch.nn.Parameter(torch.ones(64, 256, dtype=torch.bfloat16))
    opt = make_optimizer([w], OptimSpec("adamw8bit-bf16", lr=1e-4, weight_decay=0.0))
    for _ in range(100):
        w.grad = torch.ones_like(w)
        opt.step()
    moved = 1.0 - w.float().mean().item()
    assert w.dtype == torch.bfloat16 and 0.007 < moved < 0.013, moved  # 100 steps of about 1e-4 each


@pytest.mark.parametrize("name", LIGHT)
def test_a_resumed_light_optimizer_ends_bitwise_where_an_uninterrupted_one_does(name):
    """Its state (uint8 moments, fp32 scales, the step) through state_dict -> torch.save -> load -> a fresh
    optimizer: the next steps, and the rounding's draws, are the uninterrupted ones."""
    dtype = torch.bfloat16 if OPTIMIZERS[name].master == 2 else torch.float32
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(300, 64, generator=g), torch.randn(64, generator=g), torch.randn(16, 16, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in init] for _ in range(6)]

    def params():
        return [torch.nn.Parameter(t.to(dtype, copy=True) if t.dim() == 2 else t.clone()) for t in init]

    def steps(ps, opt, gs):
        for step in gs:
            for p, gr in zip(ps, step):
                p.grad = gr.to(p.dtype, copy=True)  # an fp32 update may work in its gradient
            opt.step()

    spec = OptimSpec(name, lr=1e-2, seed=3)
    ref = params()
    opt = make_optimizer(ref, spec)
    steps(ref, opt, grads)
    for how in ("checkpoint", "moments"):
        half = params()
        opt2 = make_optimizer(half, spec)
        steps(half, opt2, grads[:3])
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in half]
        opt3 = make_optimizer(resumed, spec)
        if how == "checkpoint":  # a mid-visit checkpoint (storage/trainckpt: torch.save of the state_dict)
            buf = io.BytesIO()
            torch.save(opt2.state_dict(), buf)
            buf.seek(0)
            opt3.load_state_dict(torch.load(buf, weights_only=True))
        else:  # bcd.moments=keep: named tensors in a safetensors block file, read back as a state_dict
            names = [str(i) for i in range(len(half))]
            stored = safetensors.torch.load(safetensors.torch.save(optimizer_tensors(opt2.state_dict(), names)))
            opt3.load_state_dict(optimizer_state(stored, names, opt3.state_dict()["param_groups"]))
        steps(resumed, opt3, grads[3:])
        for a, b in zip(ref, resumed):
            assert torch.equal(a, b), how
    st = opt.state[ref[0]]
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() == -(-ref[0].numel() // 256)


@pytest.mark.parametrize("name", LIGHT)
def test_kept_light_moments_resume_with_the_exact_step_count_past_256_steps(name):
    """bcd.moments=keep (a safetensors block file of named tensors) after 301 steps: bitsandbytes' load_state_dict
    cast the step to the parameter's dtype, and bf16 holds integers exactly only to 256 (301 came back as 300),
    which shifted the bias correction and the stochastic rounding's seed. Resumed, the step is 301 and the next steps
    are the uninterrupted ones, bitwise."""
    dtype = torch.bfloat16 if OPTIMIZERS[name].master == 2 else torch.float32
    spec = OptimSpec(name, lr=1e-3, seed=5)

    def run(p, opt, lo, hi):
        for i in range(lo, hi):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(dtype)
            opt.step()

    ref = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype))
    opt = make_optimizer([ref], spec)
    run(ref, opt, 0, 302)
    mid = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype))
    opt2 = make_optimizer([mid], spec)
    run(mid, opt2, 0, 301)
    stored = safetensors.torch.load(safetensors.torch.save(optimizer_tensors(opt2.state_dict(), ["w"])))
    resumed = torch.nn.Parameter(mid.detach().clone())
    opt3 = make_optimizer([resumed], spec)
    opt3.load_state_dict(optimizer_state(stored, ["w"], opt3.state_dict()["param_groups"]))
    assert int(opt3.state[resumed]["step"]) == 301
    run(resumed, opt3, 301, 302)
    assert int(opt3.state[resumed]["step"]) == 302 and torch.equal(resumed, ref)


@pytest.mark.parametrize("name", LIGHT)
def test_a_light_state_where_it_cannot_run_is_one_line_naming_the_setting(name):
    from bcdflow.models.errors import ConfigError

    opt = OPTIMIZERS[name]
    opt.check(name, 3, 1, "cpu", "bf16")  # runs here
    opt.check(name, 3, 2, "cuda", "bf16", "ddp")  # a replica a process: each holds the whole state
    with pytest.raises(ConfigError, match=rf"^optim\.name: {name} keeps its 8-bit state whole on each process"):
        opt.check(name, 3, 2, "cuda", "bf16", "fsdp")
    with pytest.raises(ConfigError, match=rf"^optim\.name: {name} runs on cpu and cuda .*not on 'mps'"):
        opt.check(name, 3, 1, "mps", "bf16")
    if opt.master == 2:
        with pytest.raises(ConfigError, match=r"^optim\.name: adamw8bit-bf16 keeps bf16 master weights.*precision"):
            opt.check(name, 3, 1, "cpu", "fp32")


def test_a_run_with_a_light_state_it_cannot_hold_exits_2_and_writes_nothing(tmp_path, capsys):
    from bcdflow.flows.cli import main

    store = tmp_path / "s"
    rc = main(["train", "--store", str(store), "--set", "optim.name=adamw8bit-bf16", "--set", "train.precision=fp32",
               "--set", "model.name=tiny", "--set", "train.device=cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "error: optim.name: adamw8bit-bf16 keeps bf16" in err[0], err
    assert not store.exists() or not any(store.rglob("*.json"))
