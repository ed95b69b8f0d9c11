"""The records the run config hands the models layer, torch-free (``core/config.RunConfig`` builds each one, so the
config and the commands that only read a store import no torch):

    cfg.optim_spec(block)   # OptimSpec: the optimizer of a visit (models/trainer.make_optimizer builds it)
    cfg.stop_rule(rate)     # StopRule: when a visit's step loop has converged (models/trainer.run_steps reads it)
    cfg.step_shape()        # StepShape: one training step as the planner sees it (models/memory.py, models/holding.py)

and the time model's constants (:data:`PCIE_GBS`, :data:`TFLOPS`), which ``train.pcie_gbs`` and ``train.tflops``
default to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bcdflow.models.optimizers import OPTIMIZERS

PCIE_GBS = 25.0
"""Host-to-device copy bandwidth a streamed layer gets, GB/s: PCIe 4.0 x16 in practice (an RTX 4090's bus)."""
TFLOPS = {"fp32": 40.0, "bf16": 80.0}
"""Matmul throughput a training step reaches, TFLOP/s, by ``train.precision``: about half an RTX 4090's dense peak
in each (bf16 on tensor cores, 165; fp32 on the CUDA cores, 82.6: torch leaves TF32 off). ``train.tflops``
overrides it; ``make gpu-check`` measures both on the card it runs on."""


def tflops_for(precision: str, tflops: float | None = None) -> float:
    """The matmul throughput the time model uses: ``tflops`` where given, else :data:`TFLOPS` of the precision."""
    return float(tflops) if tflops else TFLOPS.get(precision, TFLOPS["fp32"])


@dataclass(frozen=True)
class StepShape:
    """One training step as the planner sees it: its batch, the run's settings that change what a step holds or how
    long it takes, and how the visit holds its frozen layers. ``RunConfig.step_shape()`` builds a run's; the planner
    tries variations of it with ``dataclasses.replace`` (each way of recomputing, the streamed layers, a no-grad
    pass's rows)."""
    batch: int
    """Rows per step (a no-grad pass: rows per forward)."""
    seq: int
    precision: str = "fp32"
    optim: str = "adamw"
    weight_decay: float = 1e-5
    chunk_rows: int | None = None
    """Rows of the loss over the vocabulary at once (``train.loss_chunk_rows``; None: 128 MB of fp32 logits)."""
    recompute: str = "auto"
    """``bcd.recompute``: ``off``, ``on`` (the frozen suffix keeps only its layers' inputs), ``all`` (the active
    block's layers too), ``auto`` (the holding tries off and on; a single estimate counts it as off)."""
    preinfer: bool = True
    """``bcd.preinfer``: a visit to a block past the first reads its prefix's stored states and holds no prefix."""
    freeze: tuple[str, ...] = ()
    """``bcd.freeze``: parameters no visit trains (``embeddings``, ``head``)."""
    offload: str = "auto"
    """``train.offload``: ``off``, ``stream`` (every frozen layer held streams), ``auto`` (the fewest that fit)."""
    window: int = 2
    """``train.stream_window``: device slots of the streamed layers."""
    streamed: tuple[int, ...] | None = None
    """The frozen layers that stream from host memory; None: as ``offload`` says (``stream``: all, else none)."""
    expand_rank: int = 0
    """``bcd.expand``'s adapter rank on the layers after the block (0: none)."""
    gpus: int = 1
    parallel: str = "single"
    """``single`` (one process), ``ddp`` (the batch split over ``gpus`` replicas) or ``fsdp`` (sharded too)."""
    pcie_gbs: float = PCIE_GBS
    tflops: float | None = None
    """The time model's matmul throughput (None: :data:`TFLOPS` of the precision)."""

    @property
    def tokens(self) -> int:
        """Tokens each process holds: data parallel and FSDP split the batch over the processes."""
        rows = self.batch if self.parallel == "single" else -(-self.batch // self.gpus)
        return rows * self.seq

    @property
    def dtype_bytes(self) -> int:
        """Bytes of the compute dtype: 2 under bf16 autocast, else 4."""
        return 2 if self.precision == "bf16" else 4


@dataclass
class OptimSpec:
    name: str = "adamw"
    lr: float | None = None  # None = the paper's default for the optimizer
    weight_decay: float = 1e-5
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    warmup_steps: int = 0
    """Linear warmup over a loop's first steps (each visit's, after its fresh optimizer)."""
    schedule: str = "constant"
    """``cosine``: the learning rate decays over the run's ``total_steps`` (global steps, counted across visits)
    from ``lr`` to ``min_lr_ratio`` × ``lr``; ``constant``: no decay."""
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    lr_scale: float = 1.0
    """This loop's multiplier of ``lr`` (``bcd.lr_scales``: one per block)."""
    switch_every: int | None = None
    """BAdam's and LISA's steps between switches (None: the method's default; models/peers.py)."""
    rank: int | None = None
    """GaLore's and APOLLO's projection rank, LoRA's rank (None: the method's default)."""
    lisa_layers: int = 1
    """LISA's decoder layers sampled per period (gamma)."""
    seed: int = 0
    """The run's seed: BAdam's block order and LISA's draws derive from it."""

    @property
    def base_lr(self) -> float:
        return (self.lr if self.lr is not None else OPTIMIZERS[self.name].paper_lr) * self.lr_scale

    def lr_at(self, step: int, global_step: int) -> float:
        """The learning rate of the loop's ``step``-th step (0-based) at the run's ``global_step`` (0-based)."""
        lr = self.base_lr
        if self.schedule == "cosine" and self.total_steps:
            frac = min(1.0, global_step / self.total_steps)
            lr *= self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        if self.warmup_steps:
            lr *= min(1.0, (step + 1) / self.warmup_steps)
        return lr

    @property
    def scheduled(self) -> bool:
        return bool(self.warmup_steps) or (self.schedule == "cosine" and bool(self.total_steps))


@dataclass
class StopRule:
    """When a loop has converged (checked at the end of each window of ``window`` steps).

    The loss is noisy (each step sees other rows), so both rules read a least-squares line through the last
    ``horizon`` step losses (at least ``max(patience, 2)`` windows, half the loop once it is longer), not a
    comparison of two window means, which a lucky window fools:

    - ``plateau`` (``patience`` > 0): even the optimistic end of the slope's noise (slope + ``z`` standard
      errors) lowers the loss by less than ``min_delta`` per window;
    - ``budget`` (``min_rate`` set; ``bcd.budget=adaptive``): the line lowers the loss by less than ``min_rate``
      per step, the rate the other blocks reached on their last visits: a step spent elsewhere buys more.
    """
    max_steps: int
    patience: int = 0  # plateau rule: 0 = off; else its horizon in windows (at least 2)
    min_delta: float = 1e-2
    window: int = 20
    min_rate: float | None = None
    z: float = 2.0

    def horizon(self, steps: int) -> int:
        return max(max(self.patience, 2) * self.window, steps // 2)

    def verdict(self, losses: list[float]) -> str | None:
        """``"plateau"``, ``"budget"`` or None (go on) after ``losses`` (one per step so far)."""
        if (self.patience == 0 and self.min_rate is None) or len(losses) < max(self.patience, 2) * self.window:
            return None
        slope, se = loss_trend(losses, self.horizon(len(losses)))
        if self.patience and (-slope + self.z * se) * self.window < self.min_delta:
            return "plateau"
        if self.min_rate is not None and -slope < self.min_rate:
            return "budget"
        return None


def loss_trend(losses: list[float], horizon: int) -> tuple[float, float]:
    """Least-squares slope (loss per step) of the last ``horizon`` losses and its standard error."""
    y = losses[-horizon:]
    n = len(y)
    mid, mean = (n - 1) / 2, sum(y) / n
    sxx = sum((t - mid) ** 2 for t in range(n))
    slope = sum((t - mid) * (v - mean) for t, v in enumerate(y)) / sxx
    rss = sum((v - mean - slope * (t - mid)) ** 2 for t, v in enumerate(y))
    return slope, math.sqrt(rss / max(n - 2, 1) / sxx)
