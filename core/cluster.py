"""Communication on the cluster a visit trains on (issue 42): ``train.nodes`` machines of ``train.gpus`` GPUs, joined
by ``train.link_gbs`` between machines and ``train.gpu_link_gbs`` (else the card kind's, models/specs.CARD_RATES)
within one. Pure arithmetic, torch-free; ``core/forecast.py`` prices each visit's all-reduce with it and full
training's (data parallel and ZeRO-3) on the same cluster.

    c = Cluster.of(cfg)                       # or Cluster(nodes=4, gpus=4, link_gbs=1.25, gpu_link_gbs=10)
    c.allreduce(grad_bytes, backward_s)       # Comm: bytes, what each process sends, seconds, seconds left exposed

The model, and what it leaves out:

- **All-reduce** (data parallel: a BCD visit's trained gradients, full training's every gradient): a ring, each
  process sends and receives ``2(n-1)/n`` of the buffer (n processes); its time is that over the slowest hop's
  bandwidth: between machines where there are several (a ring ordered by machine crosses each machine's link once
  each way; NCCL's hierarchical rings and trees move the same bytes over it), else between the GPUs of the machine.
  Latency is left out (buckets of 25 MB: milliseconds against seconds).
- **Overlap**: DDP all-reduces a bucket as soon as backward has produced its gradients, so only what outlasts the
  backward that produces them is exposed, and never less than the last bucket's reduction (it starts when backward
  ends). ``backward_s`` is the backward that runs while gradients are produced: all of it for full training, the
  active block's layers' for a BCD visit (the suffix's backward comes first and produces no gradient to reduce).
- **ZeRO-3 / FSDP** (full training sharded over every GPU): each layer's weights are all-gathered before its forward
  and again before its backward, and its gradients reduce-scattered after: ``(n-1)/n`` of the weights twice and of
  the gradients once; the forward's gathers hide behind the forward (prefetch) but for the first layer's, the
  backward's gathers and reductions behind the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket (``bucket_cap_mb=25``): the last one's reduction follows the end of backward."""


@dataclass(frozen=True)
class Comm:
    """One step's communication per process."""
    bytes: int
    """The buffers handed to the collectives (what a DDP communication hook sees: the gradients)."""
    wire_bytes: float
    """What each process sends (and receives) over the links for them."""
    seconds: float
    """Their transfer time."""
    exposed_s: float
    """What the step waits for, after the overlap with compute."""

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "wire_bytes": self.wire_bytes, "seconds": self.seconds,
                "exposed_s": self.exposed_s}


NONE = Comm(0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    """Machines."""
    gpus: int
    """GPUs (processes) on each."""
    link_gbs: float
    """Between machines, GB/s each way."""
    gpu_link_gbs: float
    """Between the GPUs of one machine (all-reduce bus bandwidth), GB/s."""

    @classmethod
    def of(cls, cfg) -> "Cluster":
        """The cluster of a run config (``train.nodes``, ``train.gpus``, ``train.link_gbs``, ``train.gpu_link_gbs``
        else ``spend.train_device``'s)."""
        from bcdflow.models.specs import link_gbs_for

        t = cfg.train
        return cls(t.nodes, t.gpus, t.link_gbs, link_gbs_for(t.gpu_link_gbs, cfg.spend.train_device))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    @property
    def bandwidth_gbs(self) -> float:
        """The ring's slowest hop: between machines when there are several, else between GPUs."""
        return self.link_gbs if self.nodes > 1 else self.gpu_link_gbs

    def words(self) -> str:
        one = f"{self.gpus} GPU{'s' * (self.gpus > 1)}"
        if self.nodes == 1:
            return one + (f" joined at {self.gpu_link_gbs:g} GB/s" if self.gpus > 1 else "")
        return (f"{self.nodes} machines x {one} ({self.world} GPUs), {self.link_gbs:g} GB/s between machines, "
                f"{self.gpu_link_gbs:g} GB/s within one")

    def _move(self, wire: float) -> float:
        return wire / (self.bandwidth_gbs * GB)

    def allreduce(self, nbytes: int, backward_s: float) -> Comm:
        """A ring all-reduce of ``nbytes`` per step overlapped with ``backward_s`` of backward (DDP's buckets)."""
        n = self.world
        if n == 1 or nbytes <= 0:
            return NONE
        ring = 2 * (n - 1) / n
        s = self._move(ring * nbytes)
        last = self._move(ring * min(nbytes, BUCKET_BYTES))
        return Comm(int(nbytes), ring * nbytes, s, max(s - backward_s, last))

    def zero3(self, param_bytes: int, grad_bytes: int, layer_bytes: int, forward_s: float,
              backward_s: float) -> Comm:
        """ZeRO-3's per step: the weights (``param_bytes`` at the dtype they compute in) all-gathered before the
        forward and again before the backward, the gradients (``grad_bytes``) reduce-scattered; ``layer_bytes``: the
        largest layer's weights (its gather before the first forward is never hidden)."""
        n = self.world
        if n == 1:
            return NONE
        share = (n - 1) / n
        gather, reduce = self._move(share * param_bytes), self._move(share * grad_bytes)
        wire = share * (2 * param_bytes + grad_bytes)
        exposed = max(gather - forward_s, self._move(share * layer_bytes)) + max(gather + reduce - backward_s, 0.0)
        return Comm(int(2 * param_bytes + grad_bytes), wire, 2 * gather + reduce, exposed)
