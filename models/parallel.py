"""One visit on several processes (docs/DESIGN.md §6 "training a visit"), on PyTorch's own engines, as pure model code:
the train task launches them (tasks/train_dist.py); this module wraps the visit and moves its state.

- ``ddp``: every process holds the visit (weights of blocks >= b, the active block in fp32 with its AdamW state)
  and trains on its slice of each batch; ``DistributedDataParallel`` all-reduces the gradients of the parameters
  that require them, which are the active block's only. Frozen weights are not wrapped: they are neither
  broadcast at start nor bucketed.
- ``fsdp``: FSDP2 (``fully_shard``) per layer and for the rest at the root, so each process stores 1/N of every
  weight, gradient and optimizer moment and gathers one layer's weights at a time. Frozen layers are sharded too
  (in bf16 with ``precision=bf16``), and no gradient is reduced for them.

Either way every process computes its slice's loss as a sum, and the step's loss is the sum over all processes
divided by the count of trained targets in the whole batch (one all-reduce of two numbers): the gradients equal the
one-process visit's, whatever the split, masked targets included (``global_mean``).

Checkpoints and the block file are unsharded, in the one-process format: the active block's full tensors and an
optimizer state keyed as ``opt.state_dict()`` keys it on one process (``full_optim_state``); loading scatters them
back (``load_optim_state``). So a visit checkpointed on N processes resumes on any number, one included.

``StopSync`` is the preemption flag: a SIGTERM to any process sets its own flag, and every step all processes
all-reduce (MAX) their flags over a gloo group on the host, so they all stop after the same step; the same
all-reduce carries rank 0's clock, so checkpoints by seconds happen at the same step everywhere.
"""
from __future__ import annotations

import os
import time
import weakref
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from bcdflow.constants import IGNORE_INDEX
from bcdflow.models.base import Decoder
from bcdflow.models.visit_compute import autocast, visit_loss


class VisitStep(nn.Module):
    """The visit's loss as a module: DDP and FSDP2 act in module calls (FSDP2 gathers the root's weights, the
    embeddings and the head, in this module's forward), and ``visit_loss`` calls the model's parts directly.

    ``forward(x, y)`` returns the sum of the visit's token losses (training: ``global_mean`` divides);
    ``reduction="mean"`` their mean (evaluation: every process runs the whole batch)."""

    def __init__(self, model: Decoder, lo: int, hi: int, from_acts: bool, recompute: bool, precision: str):
        super().__init__()
        self.model = model
        self.lo, self.hi, self.from_acts, self.recompute, self.precision = lo, hi, from_acts, recompute, precision
        self.recompute_active = False  # bcd.recompute=all: the active block's layers too

    def forward(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        with autocast(x.device, self.precision):
            return visit_loss(self.model, x, y, self.lo, self.from_acts, hi=self.hi, recompute=self.recompute,
                              recompute_active=self.recompute_active,
                              reduction=reduction)


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def slice_rows(lo: int, hi: int, rank: int, size: int) -> tuple[int, int]:
    """This process's contiguous part of batch rows [lo, hi): as equal as can be, the first ones one row shorter."""
    n = hi - lo
    return lo + n * rank // size, lo + n * (rank + 1) // size


def global_mean(local_sum: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
    """The batch's mean loss from this process's sum and count of trained targets (one all-reduce of both).

    Its value is the global mean on every process; its gradient is ``world / global count`` times this process's
    sum's, so the gradient average DDP and FSDP take over processes is the global mean's gradient."""
    _, size = world()
    both = torch.stack([local_sum.detach().float(), local_count.float()])
    dist.all_reduce(both)
    total, count = both[0], both[1]
    scaled = local_sum * (size / count)
    return scaled + (total / count - scaled).detach()


def empty_slice_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A process whose slice of a (ragged) batch is empty still runs the step (DDP and FSDP need every process in
    every collective): one row with every target ignored, so it adds nothing to the loss or the gradients."""
    return x[:1], torch.full_like(y[:1], IGNORE_INDEX)


class CommCount:
    """The bytes DDP hands its all-reduce (a communication hook's state): ``bytes`` in all, over ``calls`` buckets.
    ``bcdflow plan`` prices the same bytes a step (core/cluster.py); the visit reports them (``comm_bytes``)."""

    def __init__(self, group=None):
        self.group, self.bytes, self.calls = group, 0, 0


def _counting_allreduce(state: CommCount, bucket):
    """DDP's own all-reduce hook (``default_hooks.allreduce_hook``: the mean over the processes), counting the
    bucket's bytes first."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    state.calls += 1
    return default_hooks.allreduce_hook(state.group, bucket)


def wrap_ddp(step: VisitStep, device: torch.device) -> nn.Module:
    """DDP over the parameters that require gradients (the active block); frozen ones are left out entirely. Its
    all-reduce counts the bytes it moves (``module.comm``, :class:`CommCount`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    frozen = [f"model.{n}" for n, p in step.model.named_parameters() if not p.requires_grad]
    frozen += [f"model.{n}" for n, _ in step.model.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(step, frozen)
    mod = DDP(step, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    mod.comm = CommCount()
    mod.register_comm_hook(mod.comm, _counting_allreduce)
    return mod


def shard_fsdp(step: VisitStep, device: torch.device) -> VisitStep:
    """FSDP2: each held layer is one unit (gathered for its forward and again for its backward), the embeddings and
    the head form the root unit. Call on a meta-device model; materialize with ``to_empty`` and ``load_sharded``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world()[1],))
    for layer in step.model.h.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(step, mesh=mesh)
    return step


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every process calls it); a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def load_sharded(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (on the host) into the parameters of ``model``: into this process's shard of a sharded
    one (no communication: every process read the same tensors), as they are into a plain one."""
    from torch.distributed.tensor import distribute_tensor

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if is_sharded(p):
                src = t.to(p.device, p.dtype)
                p.to_local().copy_(distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(t)


class Gathered:
    """Whole tensors of sharded ones alive at once on their device, counted by finalizers (the FSDP checkpoint's
    invariant: at most one beyond the shards, docs/DESIGN.md §10; tests read ``peak``)."""
    live = peak = count = 0

    @classmethod
    def track(cls, t: torch.Tensor) -> torch.Tensor:
        cls.count += 1
        cls.live += 1
        cls.peak = max(cls.peak, cls.live)
        weakref.finalize(t.untyped_storage(), cls._freed)
        return t

    @classmethod
    def _freed(cls) -> None:
        cls.live -= 1


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor as a new host tensor: a sharded one is gathered on its device,
    copied out and its device copy freed before the next is gathered, so a checkpoint of a sharded visit never
    holds more than one whole tensor on the device (every process calls it: a collective)."""
    if not is_sharded(t):
        return t.detach().to("cpu", copy=True).contiguous()
    whole = Gathered.track(t.full_tensor())
    out = torch.empty(whole.shape, dtype=whole.dtype, device="cpu")
    out.copy_(whole)
    del whole
    return out


def full_params(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors of the given parameters on the host, one gathered at a time (every process calls it)."""
    return {n: to_host(p.detach()) for n, p in named}


def full_optim_state(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with every state tensor whole on the host, one gathered at a time: the one-process format
    (a collective). A block's AdamW moments (5.9 GB for Llama-3-8B's last block) never sit whole on the device."""
    sd = opt.state_dict()
    # sorted: each gather is a collective, so every process must gather the same tensors in the same order (the
    # entries of a state loaded from a checkpoint need not be in the order the process's own steps made them)
    return {"state": {k: {n: to_host(v) if isinstance(v, torch.Tensor) else v for n, v in sorted(st.items())}
                      for k, st in sorted(sd["state"].items())},
            "param_groups": sd["param_groups"]}


def load_optim_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a one-process optimizer state into ``opt``; moments of sharded parameters are cut to this process's
    shard."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for g in opt.param_groups for p in g["params"]]
    out = {}
    for k, st in state["state"].items():
        p = params[int(k)]
        out[k] = {}
        for n, v in st.items():
            if isinstance(v, torch.Tensor) and is_sharded(p) and v.shape == p.shape:
                v = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            out[k][n] = v
    opt.load_state_dict({"state": out, "param_groups": state["param_groups"]})


class StopSync:
    """``should_stop`` and ``clock`` for run_steps on several processes: each call of ``__call__`` all-reduces this
    process's preemption flag (MAX) and rank 0's elapsed seconds over a host (gloo) group, so every process stops
    at the same step and sees the same clock."""

    def __init__(self, requested: Callable[[], bool]):
        self.requested = requested
        self.rank = world()[0]
        # on the host, with a long timeout: the processes also wait here (``barrier``) while rank 0 writes a
        # multi-GB checkpoint to the store, which may outlast NCCL's 10-minute collective timeout
        self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))
        self.t0 = time.perf_counter()
        self.now = 0.0

    def __call__(self) -> bool:
        flags = torch.tensor([1.0 if self.requested() else 0.0,
                              time.perf_counter() - self.t0 if self.rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.now = float(flags[1])
        return bool(flags[0] > 0)

    def clock(self) -> float:
        return self.now


def local_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK when CUDA is present and asked for, else the CPU."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
