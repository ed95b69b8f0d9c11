"""The records the run config hands the models layer, torch-free (``core/config.RunConfig`` builds each one, so the
config and the commands that only read a store import no torch):

    cfg.optim_spec(block)   # OptimSpec: the optimizer of a visit (models/trainer.make_optimizer builds it)
    cfg.stop_rule(rate)     # StopRule: when a visit's step loop has converged (models/trainer.run_steps reads it)
    cfg.step_shape()        # StepShape: one training step as the planner sees it (models/memory.py, models/holding.py)

and the time model's rates by card kind (:data:`CARD_RATES`; :data:`TFLOPS` and :data:`PCIE_GBS` are the default
kind's), which ``spend.train_device`` chooses and ``train.tflops`` and ``train.pcie_gbs`` override.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bcdflow.models.errors import ConfigError
from bcdflow.models.optimizers import OPTIMIZERS


@dataclass(frozen=True)
class CardRates:
    """What the planner's time model assumes of one card kind: the dense matmul throughput a training step reaches,
    TFLOP/s, by ``train.precision``, the host-to-device copy bandwidth a streamed layer gets, GB/s, and the
    all-reduce bandwidth between GPUs of one machine of that kind, GB/s (nccl-tests' bus bandwidth)."""
    bf16: float
    fp32: float
    pcie_gbs: float
    link_gbs: float = 10.0

    def tflops(self, precision: str) -> float:
        """The throughput at ``precision`` (``bf16``; anything else computes in fp32)."""
        return self.bf16 if precision == "bf16" else self.fp32


DEFAULT_CARD = "rtx4090"
"""The kind whose rates the time model uses where nothing names one (a bare ``StepShape``; ``core/spend.DEFAULT_KIND``
is the same kind: a run priced by default is planned as one)."""
CARD_RATES: dict[str, CardRates] = {
    "rtx4090": CardRates(bf16=80.0, fp32=40.0, pcie_gbs=25.0, link_gbs=10.0),
    "rtx3090": CardRates(bf16=35.0, fp32=17.5, pcie_gbs=25.0, link_gbs=10.0),
    "a6000": CardRates(bf16=77.0, fp32=19.0, pcie_gbs=25.0, link_gbs=10.0),
    "l40s": CardRates(bf16=181.0, fp32=46.0, pcie_gbs=25.0, link_gbs=10.0),
    "a100": CardRates(bf16=156.0, fp32=9.75, pcie_gbs=25.0, link_gbs=230.0),
    "a800": CardRates(bf16=156.0, fp32=9.75, pcie_gbs=25.0, link_gbs=150.0),
    "h100": CardRates(bf16=495.0, fp32=33.5, pcie_gbs=50.0, link_gbs=360.0),
    "h200": CardRates(bf16=495.0, fp32=33.5, pcie_gbs=50.0, link_gbs=360.0),
}
"""The time model's rates by card kind (the names ``spend.train_device`` and the price catalog use,
``core/spend.DEFAULT_PRICES``; every priced kind has rates, and a kind here needs a price, ``spend.prices``, to be
chosen). Throughput is about half the card's dense peak from its vendor's spec sheet (no sparsity), the share of
peak a whole training step reaches (attention, norms, the optimizer, launches) and the time model's convention since
its first rates: bf16 on the tensor cores with fp32 accumulation; fp32 on the CUDA cores, since torch leaves TF32 off
(``torch.backends.cuda.matmul.allow_tf32`` is False by default and bcdflow never sets it). The copy bandwidth is the
card's host link in practice: PCIe 4.0 x16 about 25 GB/s of its 32, PCIe 5.0 x16 about 50 of its 64.

- ``rtx4090``: Ada whitepaper, bf16 165.2 (fp32 accumulate), fp32 82.6; PCIe 4.0. 80 / 40 / 25: the time model's
  rates before they were by kind, so a default run plans as it did.
- ``rtx3090``: Ampere GA102 whitepaper, bf16 71 (fp32 accumulate), fp32 35.6; PCIe 4.0.
- ``a6000`` (RTX A6000): datasheet, tensor 309.7 with sparsity (154.8 dense), fp32 38.7; PCIe 4.0.
- ``l40s``: datasheet, bf16 362 dense (733 with sparsity), fp32 91.6; PCIe 4.0.
- ``a100`` (SXM4 or PCIe, 40 or 80 GB): datasheet, bf16 312 dense, fp32 19.5; the host link is PCIe 4.0 on both
  boards (NVLink joins the GPUs, not the host).
- ``a800``: the A100's export variant, the same compute and host link (only NVLink is slower: 400 GB/s).
- ``h100`` (SXM5): datasheet, bf16 989 dense, fp32 67; PCIe 5.0. An H100 PCIe card is slower (bf16 756, fp32 51):
  price it as a kind of its own with ``train.tflops`` and ``train.pcie_gbs``.
- ``h200`` (SXM): the H100 SXM's compute (989, 67) with more and faster memory; PCIe 5.0.

The link between GPUs of one machine (``link_gbs``, what a data-parallel all-reduce gets; ``train.gpu_link_gbs``
overrides it): about the bus bandwidth nccl-tests' ``all_reduce_perf`` reports at large messages. GeForce cards
(4090, 3090) have no peer-to-peer over PCIe and rented boxes no NVLink bridge, so NCCL copies through host memory:
about 10 GB/s; the A6000 and L40S in rented PCIe boxes the same. Over NVLink: A100 SXM4 (600 GB/s NVLink 3) about
230, A800 (400 GB/s) about 150, H100 and H200 SXM (900 GB/s NVLink 4) about 360. Between machines:
``train.link_gbs`` (default 10 Gbit/s Ethernet).

Measured rates. ``make gpu-check`` (benchmarks/gpu_check.py) measures on the card it runs on the host-to-device copy
of a page-locked buffer (GB/s) and a bf16 and an fp32 matmul of a Llama-3-8B MLP's shape (TFLOP/s), prints them
beside the rates assumed here, and times its measured visits with both (its "calibrated" rows). To plan a run with
measured rates, put them in its config: ``train.pcie_gbs`` the copy's GB/s, ``train.tflops`` one figure at the run's
``train.precision`` (e.g. ``--set train.tflops=400 --set train.pcie_gbs=52``). A matmul alone runs nearer the peak
than a whole step (attention, norms and the optimizer are not in it), so a measured TFLOP/s predicts a step somewhat
faster than it runs; the calibrated rows show by how much. Each override wins over its kind's rate; a kind not in
this table (one priced only, ``spend.prices=[KIND=USD]``) needs both, else the config is refused naming
``spend.train_device``.
"""
PCIE_GBS = CARD_RATES[DEFAULT_CARD].pcie_gbs
"""Host-to-device copy bandwidth of the default kind, GB/s (PCIe 4.0 x16 in practice)."""
TFLOPS = {"fp32": CARD_RATES[DEFAULT_CARD].fp32, "bf16": CARD_RATES[DEFAULT_CARD].bf16}
"""Matmul throughput of the default kind by ``train.precision``, TFLOP/s (:data:`CARD_RATES`)."""


def card_rates(kind: str) -> CardRates:
    """:data:`CARD_RATES` of ``kind``; a kind with none is a ConfigError naming ``spend.train_device`` and the known
    kinds (``RunConfig`` refuses such a config unless ``train.tflops`` and ``train.pcie_gbs`` are both set)."""
    try:
        return CARD_RATES[kind]
    except KeyError:
        raise ConfigError(f"spend.train_device: the time model has no rates for card kind {kind!r} (known: "
                          f"{', '.join(CARD_RATES)}); set train.tflops and train.pcie_gbs (make gpu-check measures "
                          "them) or use a known kind") from None


def tflops_for(precision: str, tflops: float | None = None, kind: str = DEFAULT_CARD) -> float:
    """The matmul throughput the time model uses: ``tflops`` where given, else ``kind``'s at ``precision``."""
    return float(tflops) if tflops else card_rates(kind).tflops(precision)


def link_gbs_for(link_gbs: float | None = None, kind: str = DEFAULT_CARD) -> float:
    """The all-reduce bandwidth between GPUs of one machine: ``link_gbs`` where given, else ``kind``'s (a kind the
    table does not know: a PCIe card's, :data:`CARD_RATES`' default)."""
    if link_gbs:
        return float(link_gbs)
    return CARD_RATES[kind].link_gbs if kind in CARD_RATES else CardRates.link_gbs


def pcie_gbs_for(pcie_gbs: float | None = None, kind: str = DEFAULT_CARD) -> float:
    """The host-to-device bandwidth the time model uses: ``pcie_gbs`` where given, else ``kind``'s."""
    return float(pcie_gbs) if pcie_gbs else card_rates(kind).pcie_gbs


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
    suffix: str = "off"
    """``bcd.expand=sign``: what the layers after the block (and an untied head) train, state-free (``sign``): their
    weight gradients computed, one at a time, and dropped in their hooks (models/suffix.py); ``off``: frozen."""
    gpus: int = 1
    parallel: str = "single"
    """``single`` (one process), ``ddp`` (the batch split over ``gpus`` replicas) or ``fsdp`` (sharded too)."""
    pcie_gbs: float = PCIE_GBS
    """The time model's host-to-device bandwidth, GB/s (``RunConfig.step_shape``: ``spend.train_device``'s, or
    ``train.pcie_gbs``)."""
    tflops: float | None = None
    """The time model's matmul throughput, TFLOP/s (``RunConfig.step_shape``: ``spend.train_device``'s at the
    precision, or ``train.tflops``; None: :data:`TFLOPS` of the precision, the default kind's)."""

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
    first_step: int = 0
    """The run's steps before this loop's first: the clock of a schedule over the run (``cosine``)."""

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


@dataclass(frozen=True)
class CheckpointSchedule:
    """When a loop writes its mid-visit checkpoint (the ``checkpoint`` section): every ``every_steps`` steps or
    ``every_seconds`` seconds, whichever comes first (0: never by that), but writing them takes at most
    ``max_share`` of the loop's time: after a checkpoint that took W seconds, one that falls due is written once
    W x (1 - share) / share seconds of training have passed (postponed, not dropped). A signal's checkpoint is never
    held back, and the last step's state is the loop's result, not a checkpoint. ``models/trainer.run_steps`` asks
    a :meth:`timer` once per step; the forecast (``core/forecast``) counts the same rule in closed form
    (:meth:`count`)."""
    every_steps: int = 0
    every_seconds: float = 0.0
    max_share: float = 1.0

    def hold(self, write_s: float) -> float:
        """Seconds of training a checkpoint that took ``write_s`` holds the next one back."""
        return write_s * (1 - self.max_share) / self.max_share

    def timer(self, now: float, write_s: float = 0.0) -> "CheckpointTimer":
        """The loop's timer from clock reading ``now``; ``write_s``: the last checkpoint's write (a resumed loop's)."""
        return CheckpointTimer(self, last=now, held_until=now + self.hold(write_s), write_s=write_s, prev_now=now)

    def count(self, steps: int, train_s: float, write_s: float) -> int:
        """Checkpoints a loop of ``steps`` steps over ``train_s`` seconds writes when each takes ``write_s``: by
        steps or seconds, whichever gives more, then at most ``max_share`` of the time (n writes of W seconds with
        n x W <= share x (train_s + n x W)); the first that falls due is never held back."""
        n = max(steps // self.every_steps if self.every_steps else 0,
                int(train_s // self.every_seconds) if self.every_seconds else 0)
        if self.max_share < 1 and write_s > 0 and n:
            n = min(n, max(1, int(self.max_share * train_s / (write_s * (1 - self.max_share)))))
        return n


@dataclass
class CheckpointTimer:
    """A loop's checkpoint clock (:meth:`CheckpointSchedule.timer`): which checkpoint falls due after a step."""
    schedule: CheckpointSchedule
    last: float
    """When the last checkpoint was written (or the loop began)."""
    held_until: float
    """No checkpoint by steps or seconds before this clock reading (``max_share``)."""
    write_s: float
    """The last checkpoint's write, seconds (kept in the loop state: a resumed loop holds as it would have)."""
    prev_now: float
    ckpt_at: float | None = None
    """When the last checkpoint began, until its write is timed at the next step's end."""
    step_before: float = 0.0
    owed: str | None = None
    """A checkpoint that fell due while held back: written when the hold ends."""

    def due(self, step: int, now: float, last_step: bool, interrupted: bool) -> str | None:
        """After step ``step`` ended at ``now``: ``"signal"``, ``"steps"``, ``"seconds"`` or None. The write of the
        checkpoint before is timed here: to this step's end less the step before it, on a clock every process of a
        distributed visit agrees on, so each holds back the same checkpoints."""
        sc = self.schedule
        if self.ckpt_at is not None:
            self.write_s = max(0.0, now - self.ckpt_at - self.step_before)
            self.held_until, self.ckpt_at = now + sc.hold(self.write_s), None
        why = "signal" if interrupted else None
        if not last_step and not why:
            why = ("steps" if sc.every_steps and step % sc.every_steps == 0 else
                   "seconds" if sc.every_seconds and now - self.last >= sc.every_seconds else self.owed)
            if why and now < self.held_until:
                self.owed, why = why, None
        return why

    def written(self, now: float) -> None:
        """The checkpoint due at ``now`` was written."""
        self.last, self.owed = now, None
        if self.schedule.max_share < 1:
            self.ckpt_at, self.step_before = now, now - self.prev_now

    def stepped(self, now: float) -> None:
        """A step's bookkeeping done at ``now``."""
        self.prev_now = now


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
