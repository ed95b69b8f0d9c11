"""The run planned at the user's scale (``bcdflow plan``; issue 34): per visit the rows it samples, the activation bytes
pre-inference writes and training reads back, and the time of each stage; per cycle and for the run the wall time,
GPU-hours per kind, the store's peak and total bytes, and the money (GPUs and object storage). Pure arithmetic over
the run config, the model's figures, the dataset's size and stated rates: no torch, no store, no device.

    figs = ModelFigures(d_model=4096, params=8.0e9, forward_flops=..., blocks=(BlockFigures(...), ...))
    rates = Rates(write_gbs=0.2, read_gbs=0.2, preinfer_gpus=1, preinfer_tflops=80, train_tflops=80)
    p = forecast_run(cfg, figs, Dataset.of_tokens(100e6, cfg.data.seq_len, cfg.data.val_fraction), rates)
    p.visits[b].written, p.cycle.wall_s, p.run.usd, p.run.store_peak

What it counts, and from where (so the figures are the product's, not a second model of it):

- rows: ``core/rules.visit_row_count`` (the sample at ``bcd.sample_rate``, cut to ``max_steps x batch_size``);
  steps: the step cap ``bcd.max_steps`` (a visit may stop sooner on its plateau or budget: the plan is the bound).
- activation bytes: ``storage/act_layout.group_layout``, the layout ``storage/activations.create_group`` gives the
  group: whole chunk objects of both arrays (hidden at ``bcd.act_dtype``, int32 targets), the last chunk stored whole.
  Written once by pre-inference; read back once per epoch over the rows (``epochs = steps x batch / rows``; the
  reader fetches whole chunk objects, each once while batches walk through it).
- rates: TFLOP/s by card kind (``spend.train_device``, and ``spend.preinfer_device`` for pre-inference on GPUs of its
  own: :func:`train_tflops`, :func:`preinfer_tflops`; ``models/specs.CARD_RATES``), ``train.tflops`` over the kind's.
- pre-inference time: the prefix's forward FLOPs over the rows on ``preinfer_gpus`` GPUs at ``preinfer_tflops``,
  overlapped with the writes at ``write_gbs`` (two shard tasks a GPU: one computes while the other writes), after
  each GPU loads the prefix's block files at ``read_gbs``.
- training time: the step cap x the step time of the visit as held (``models/holding.choose_holding``, the time
  model ``plan-memory`` prints), overlapped with reading the activations at ``read_gbs`` (the reader prefetches),
  after loading the visit's part of the model; plus its mid-visit checkpoints and the commit's block files at
  ``write_gbs``; evaluation: a forward over ``train.eval_rows`` rows at ``train_tflops``.
- money: GPU seconds x ``spend`` prices per kind (``core/spend.catalog``), the training box's wait during
  pre-inference on other GPUs included (a rental bills it); object storage: GB-months held (each visit's bytes for
  its wall time), requests (PUT, GET) and egress at the ``spend`` section's storage prices.
- the store's peak: the token dataset, every block file written so far (versions are kept until ``bcdflow prune``),
  one visit's activations and its two newest mid-visit checkpoints (the one before stays as a fallback).

``bcd.preinfer=auto`` (:func:`choose_preinfer`): per block, pre-infer where the visit with it is faster than
computing the prefix on the training card every step (streamed or resident, as the holding says) by more than
:data:`TIE` and no dearer in all (GPUs, requests, egress, storage: ``VisitForecast.usd``), or as fast (within
:data:`TIE`) and cheaper; else compute it (a way that fits the card first); both ways with the same mid-visit
checkpoints; the reason is one line, with both ways' figures and the store bandwidth that would flip it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from bcdflow.core.cluster import Cluster
from bcdflow.core.config import RunConfig
from bcdflow.core.rules import visit_row_count
from bcdflow.core.spend import catalog, gpus_used
from bcdflow.errors import BadInput
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.specs import CARD_RATES, tflops_for
from bcdflow.storage.act_layout import group_layout

GB = 1e9
MONTH_S = 30 * 86400.0
"""A storage month, seconds (object stores bill GB-months of 30 days)."""
STORED_BYTES = 4
"""Bytes a parameter takes in a block file (trained versions are fp32)."""
TIE = 0.01
"""``bcd.preinfer=auto``: wall times within this fraction are as fast (then the prefix is computed on the card)."""
HEADER_BYTES = 256
DISK_GBS = 2.0
"""A rented box's NVMe disk, GB/s: where ``bcd.block_cache`` keeps its copies of the block files."""
"""A safetensors header's bytes per tensor (models/memory.file_bytes)."""
MEASURED_BF = {1.0: 2.42, 2.0: 1.37, 8 / 3: 1.21, 4.0: 1.12}
"""B-F by the layers a visit trains (the model's layers / its visits): BCD's steps to full AdamW's loss over full
AdamW's, the figures ``bcdflow plan`` compares full training with (``--bf`` gives the user's own, from ``bcdflow
compare``; :func:`measured_bf` between them). Keyed by layers a visit, not by block count: on a 16-layer model 8
blocks (2 layers each) took 1.12-1.13 where 8 blocks of the 8-layer model (1 each) took 2.42, 12 blocks (1.33 each)
1.73 and 16 blocks (1 each) 2.15-2.17 (docs/results/tuned-2026-11-29). The validity suite's ``l8-d128`` (8 layers, d=128, its vocabulary 7.7% of
the parameters), pysrc, 3 seeds, every run at the rate a sweep on a held-out seed chose for full AdamW (1e-3), BCD's
defaults (``bcd.expand=lora``): 8 blocks (1 layer each) 2.42 [2.30-2.55], 4 blocks (2) 1.37 [1.28-1.50], 3 blocks
(2.67) 1.21 [1.10-1.42], 2 blocks (4) 1.12 [1.12-1.13] (docs/results/rates-2026-11-28). The 8-layer model's, where
the 16-layer model at the same layers a block was as fast or faster: an upper bound for deeper models. One corpus,
pretraining; more than 4 layers a visit take 4's figure, fewer than 1 (row visits) 1's (a lower bound)."""


def layers_per_visit(figs: ModelFigures) -> float:
    """The layers a visit of the plan trains on average: the model's decoder layers over its visits (row visits
    share a layer: fewer than 1)."""
    return max(b.layers[1] for b in figs.blocks) / len(figs.blocks)


def measured_bf(layers: float) -> float:
    """:data:`MEASURED_BF` at ``layers`` a visit: linear between the measured points, the nearest outside them."""
    xs = sorted(MEASURED_BF)
    if layers <= xs[0] or layers >= xs[-1]:
        return MEASURED_BF[xs[0] if layers <= xs[0] else xs[-1]]
    lo = max(x for x in xs if x <= layers)
    hi = min(x for x in xs if x >= layers)
    if lo == hi:
        return MEASURED_BF[lo]
    return MEASURED_BF[lo] + (MEASURED_BF[hi] - MEASURED_BF[lo]) * (layers - lo) / (hi - lo)


def duration_text(s: float) -> str:
    """Seconds for a person: hours from 0.01 h (``1.25 h``), else seconds, a sub-second one with a digit (``0.3s``,
    ``<0.1s``), so a small run's plan does not read ``0s`` everywhere; nothing at all is ``0s``."""
    if s >= 36:
        return f"{s / 3600:,.2f} h"
    return "0s" if s <= 0 else "<0.1s" if s < 0.05 else f"{s:.1f}s" if s < 9.95 else f"{s:.0f}s"


def small_text(x: float, digits: int = 2) -> str:
    """A positive figure below 0.01 with two significant digits, in fixed point (``0.00031``, not ``3.1e-04``)."""
    return f"{x:.{max(digits, 1 - math.floor(math.log10(x)))}f}"


def usd_text(x: float) -> str:
    """Dollars for a person: cents from a cent on (``$1,234.50``), else two significant digits (``$0.00031``) or
    ``<$0.000001``, so a small run's plan does not read ``$0.00`` everywhere; nothing at all is ``$0.00``."""
    if x >= 0.01 or x <= 0:
        return f"${max(x, 0.0):,.2f}"
    return "<$0.000001" if x < 1e-6 else f"${small_text(x)}"


class PlanInputError(BadInput):
    """A dataset size, rate or price that is not a positive finite number."""


def positive(name: str, value, integer: bool = False) -> float:
    """``value`` as a positive finite number, else one line naming ``name`` (exit 2)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise PlanInputError(f"{name}: must be a positive number, got {value!r}") from None
    if not (math.isfinite(v) and v > 0) or (integer and v != int(v)):
        raise PlanInputError(f"{name}: must be a positive {'whole ' if integer else ''}number, got {value!r}")
    return v


@dataclass(frozen=True)
class BlockFigures:
    """What the model layer says about one block's visit (``flows/plan.figures`` fills it from models/holding)."""
    block: int
    layers: tuple[int, int]
    params: int
    """Parameters its block file holds."""
    trainable: int
    """Parameters the visit trains (less ``bcd.freeze``)."""
    prefix_flops: float
    """Forward FLOPs per token of the embeddings and layers ``[0, lo)`` (0 for the first block)."""
    step_s: float
    """One training step as held, reading the prefix's stored activations (the first block: from tokens)."""
    step_computed_s: float
    """One training step as held, computing the prefix on the training card (no pre-inference)."""
    fits: bool = True
    fits_computed: bool = True
    holding: str = ""
    holding_computed: str = ""
    loaded_params: int = 0
    """Parameters the visit loads from the store reading activations (blocks >= b, a tied embedding)."""
    own: bool = True
    """The stored block's own visit; False: another kind's (``models/plan.VISIT_KINDS``: a row visit), whose
    ``params`` is the stored block its commit rewrites and ``trainable`` what it trains: it expands nothing and is no
    other visit's suffix."""
    grad_bytes: int = 0
    """Gradient bytes a step all-reduces with several processes: what trains (the block, and ``bcd.expand``'s
    adapters), at the bytes the optimizer keeps them in."""
    backward_share: float = 0.0
    """The share of a step's time its backward produces those gradients in (the block's layers, and the suffix's
    where adapters train): what the all-reduce overlaps (core/cluster.py)."""
    sharded: bool = False
    """Its processes shard the visit (``train.parallel=fsdp``): each step gathers the weights it holds, forward and
    backward, and reduce-scatters the gradients (core/cluster.Cluster.zero3), instead of all-reducing them."""


@dataclass(frozen=True)
class FullHeld:
    """One way of holding full training: one process's step on its slice of the batch (compute, and for the
    single-card recipes their host traffic and CPU optimizer), its peak, and whether activation checkpointing was
    needed to fit (tried only where the step without it does not)."""
    step_s: float
    peak: int
    fits: bool
    checkpointed: bool = False
    host_bytes: int = 0
    """Host memory the recipe holds (its offloaded or paged state)."""


@dataclass(frozen=True)
class FullFigures:
    """Full training of the same model on the same cluster at the same tokens a step (``core/figures``)."""
    ddp: FullHeld
    """A replica a GPU (one GPU: the card alone)."""
    zero3: FullHeld
    """Weights, gradients and optimizer state sharded over every GPU."""
    grad_bytes: int
    """Every gradient, at the dtype the step computes in (what data parallel all-reduces and ZeRO-3 reduce-scatters:
    mixed-precision recipes reduce bf16 gradients; a BCD visit reduces what its optimizer keeps, e.g. fp32)."""
    param_bytes: int
    """Every weight at the dtype it computes in (what ZeRO-3 gathers)."""
    offload: FullHeld | None = None
    """One card: ZeRO-3 with parameters and optimizer offloaded to the host (DeepSpeed ZeRO-Infinity's recipe)."""
    paged: FullHeld | None = None
    """One card: bf16 weights, 8-bit AdamW paged to the host, the optimizer in backward, checkpointing (torchtune's
    single-device full fine-tune)."""


@dataclass(frozen=True)
class ModelFigures:
    d_model: int
    params: int
    forward_flops: float
    """Forward FLOPs per token of the whole model (an evaluation)."""
    blocks: tuple[BlockFigures, ...]
    tensors: int = 0
    """Tensors of the model (each block file's safetensors header holds one entry a tensor)."""
    full: FullFigures | None = None
    """Full training's, for the comparison on the same cluster (None: not compared)."""
    compute_bytes: int = 4
    """Bytes of a weight as a step computes with it (``train.precision``: bf16 2, else 4): what a gather moves."""
    layer_bytes: int = 0
    """The largest layer's weights at those bytes."""


@dataclass(frozen=True)
class Dataset:
    tokens: int
    n_train: int
    n_val: int

    @classmethod
    def of_tokens(cls, tokens: float, seq_len: int, val_fraction: float) -> "Dataset":
        """Rows as ``storage/tokens.py`` packs a text corpus: non-overlapping rows of ``seq_len + 1`` tokens, the tail
        ``round(rows x val_fraction)`` held out."""
        tokens = int(positive("--tokens", tokens))
        n = tokens // (seq_len + 1)
        if n < 2:
            raise PlanInputError(f"--tokens: {tokens} tokens make {n} row(s) of {seq_len + 1}; need 2")
        n_val = min(n - 1, max(1, round(n * val_fraction)))
        return cls(tokens, n - n_val, n_val)


@dataclass(frozen=True)
class Rates:
    """The rates the plan assumes (stated on the command line or measured by ``bcdflow plan --probe``)."""
    write_gbs: float
    """Store write bandwidth, GB/s: pre-inference's writers together, the training box's commits."""
    read_gbs: float
    """Store read bandwidth at the training box (and at each pre-inference GPU), GB/s."""
    preinfer_gpus: int
    """GPUs computing pre-inference."""
    preinfer_tflops: float
    """One pre-inference GPU's forward throughput, TFLOP/s (:func:`preinfer_tflops`)."""
    train_tflops: float
    """The training card's forward throughput (evaluation), TFLOP/s (:func:`train_tflops`)."""
    preinfer_elsewhere: bool = False
    """Pre-inference runs on GPUs of its own (a Dask fleet of cheap GPUs): the training box waits, billed."""
    measured: dict | None = None
    """What ``--probe`` measured (the rates came from it)."""

    def check(self) -> "Rates":
        positive("--write-gbs", self.write_gbs), positive("--read-gbs", self.read_gbs)
        positive("--preinfer-gpus", self.preinfer_gpus, integer=True)
        positive("--preinfer-tflops", self.preinfer_tflops), positive("--tflops", self.train_tflops)
        return self


def train_tflops(cfg: RunConfig) -> float:
    """The training card's TFLOP/s at ``train.precision``: ``train.tflops``, else ``spend.train_device``'s
    (models/specs.CARD_RATES; the step times of ``cfg.step_shape()`` use the same)."""
    return tflops_for(cfg.train.precision, cfg.train.tflops, cfg.spend.train_device)


def preinfer_tflops(cfg: RunConfig, elsewhere: bool) -> float:
    """One pre-inference GPU's TFLOP/s: on GPUs of its own (``elsewhere``: a Dask fleet, ``bcdflow plan
    --preinfer-gpus``), ``spend.preinfer_device``'s (models/specs.CARD_RATES); on the training box, or a kind the
    rates do not know (priced only: ``bcdflow plan --preinfer-tflops`` states it), the training card's
    (:func:`train_tflops`). The box computes its own pre-inference whatever kind ``spend.preinfer_device`` prices it
    as (the default kind unless set)."""
    kind = cfg.spend.preinfer_device
    if not elsewhere or kind == cfg.spend.train_device or kind not in CARD_RATES:
        return train_tflops(cfg)
    return tflops_for(cfg.train.precision, None, kind)


def run_rates(cfg: RunConfig, store_gbs: float | None = None, write_gbs: float | None = None,
              read_gbs: float | None = None, preinfer_gpus: float | None = None,
              preinfer_tflops_: float | None = None, measured: dict | None = None) -> Rates:
    """The rates a forecast plans with, built and checked once: the store's (each way as given, else what
    ``measured`` found, else ``store_gbs``, else ``train.store_gbs``), the GPUs pre-inference uses (as given, which
    puts them beside the box; else ``spend.preinfer_gpus``, else ``core/spend.gpus_used``: a Dask fleet's beside the
    box) at :func:`preinfer_tflops` unless given, evaluation at the training card's. A run's own ``bcd.preinfer=auto`` takes
    them with nothing given; ``bcdflow plan`` with its flags. A bad value: one line naming its flag."""
    elsewhere = preinfer_gpus is not None or cfg.fleet.preinfer == "dask"
    store = store_gbs if store_gbs is not None else cfg.train.store_gbs
    rates = Rates(
        write_gbs=write_gbs if write_gbs is not None else (measured["write_gbs"] if measured else store),
        read_gbs=read_gbs if read_gbs is not None else (measured["read_gbs"] if measured else store),
        preinfer_gpus=preinfer_gpus if preinfer_gpus is not None else (
            cfg.spend.preinfer_gpus or gpus_used(cfg)["preinfer"]),
        preinfer_tflops=preinfer_tflops_ if preinfer_tflops_ is not None else preinfer_tflops(cfg, elsewhere),
        train_tflops=train_tflops(cfg), preinfer_elsewhere=elsewhere, measured=measured).check()
    return replace(rates, preinfer_gpus=int(rates.preinfer_gpus))


def default_rates(cfg: RunConfig) -> Rates:
    """The rates a run's own ``bcd.preinfer=auto`` plans with (:func:`run_rates` with nothing given)."""
    return run_rates(cfg)


@dataclass
class VisitForecast:
    block: int
    layers: tuple[int, int]
    rows: int
    steps: int
    preinfer: bool
    why: str
    written: int = 0
    """Activation bytes pre-inference writes (both arrays' chunk objects)."""
    read: int = 0
    """Activation bytes training reads back."""
    chunk_rows: int = 0
    objects_written: int = 0
    preinfer_s: float = 0.0
    preinfer_compute_s: float = 0.0
    preinfer_write_s: float = 0.0
    prefix_load_s: float = 0.0
    load_s: float = 0.0
    train_s: float = 0.0
    train_compute_s: float = 0.0
    read_s: float = 0.0
    checkpoint_s: float = 0.0
    eval_s: float = 0.0
    commit_s: float = 0.0
    wall_s: float = 0.0
    step_s: float = 0.0
    """One step's compute (several processes: each on its slice of the batch)."""
    comm: dict = field(default_factory=dict)
    """One step's all-reduce (core/cluster.Comm: bytes, wire_bytes, seconds, exposed_s); the exposed seconds are
    in ``train_compute_s``."""
    fits: bool = True
    holding: str = ""
    block_bytes: int = 0
    """Block files the commit writes (the block, and with ``bcd.expand`` the suffix blocks it rewrites)."""
    checkpoint_bytes: int = 0
    """One mid-visit checkpoint (the block's weights and optimizer state, fp32)."""
    checkpoints: int = 0
    loaded_bytes: int = 0
    cached: bool = False
    """Its loads read the training box's own copies (``bcd.block_cache``): no egress, the disk's speed; the run
    reads the model from the store once (``RunForecast``)."""
    gpu_hours: dict = field(default_factory=dict)
    """Device kind -> GPU-hours (training box, pre-inference GPUs)."""
    gpu_usd: float = 0.0
    puts: int = 0
    gets: int = 0
    request_usd: float = 0.0
    """Its PUTs and GETs at the store's prices (an object store's; a local path bills none)."""
    egress_usd: float = 0.0
    """Egress on what it reads: its activations and the model part it loads (``RunConfig.egress_usd_gb``)."""
    usd: float = 0.0
    """What the visit costs in all: its GPUs, requests and egress, and holding its activations for its time."""
    alternative: dict | None = None
    """The other way (pre-inference on or off) as planned, for the reason."""


@dataclass
class Totals:
    wall_s: float = 0.0
    gpu_hours: dict = field(default_factory=dict)
    gpu_usd: float = 0.0
    storage_usd: float = 0.0
    request_usd: float = 0.0
    egress_usd: float = 0.0
    written: int = 0
    read: int = 0
    store_written: int = 0
    """Every byte written to the store (activations, checkpoints, block files)."""
    store_peak: int = 0

    @property
    def usd(self) -> float:
        return self.gpu_usd + self.storage_usd + self.request_usd + self.egress_usd

    def to_dict(self) -> dict:
        return {**asdict(self), "usd": self.usd}


@dataclass
class RunForecast:
    dataset: Dataset
    rates: Rates
    visits: list[VisitForecast]
    cycle: Totals
    run: Totals
    cycles: int
    dataset_bytes: int
    model_bytes: int
    notes: list[str] = field(default_factory=list)
    full: dict | None = None
    """Full training on the same cluster to the same loss (:func:`full_training`)."""

    def to_dict(self) -> dict:
        return {"dataset": asdict(self.dataset), "rates": asdict(self.rates), "cycles": self.cycles,
                "dataset_bytes": self.dataset_bytes, "model_bytes": self.model_bytes,
                "visits": [asdict(v) for v in self.visits], "cycle": self.cycle.to_dict(), "run": self.run.to_dict(),
                "full": self.full, "notes": self.notes}


def full_training(cfg: RunConfig, figs: ModelFigures, visits: list[VisitForecast], run: Totals, bf: float) -> dict | None:
    """Full training of the same model on the same cluster (``train.nodes`` x ``train.gpus``), at the same tokens a
    step, to the loss the run's BCD steps reach: ``steps / bf`` steps (B-F: BCD's steps to full training's loss over
    full training's), each way it can be held (data parallel: a replica a GPU; ZeRO-3: sharded over all) with its
    communication (core/cluster.py), its wall time and money at the training card's price; beside bcdflow's run
    (every stage: pre-inference, store transfers, checkpoints, evaluation). The ways that do not fit the card are
    listed, marked; ``best``: the fastest that fits, and how it compares."""
    f = figs.full
    if f is None:
        return None
    c = Cluster.of(cfg)
    bcd_steps = sum(v.steps for v in visits) * cfg.bcd.cycles
    steps = bcd_steps / positive("--bf", bf)
    price = catalog(cfg.spend)[cfg.spend.train_device]
    d, z = f.ddp, f.zero3
    single = [(name, h, c.allreduce(0, 0.0)) for name, h in (
        ("ZeRO-3 + CPU offload", f.offload), ("bf16 + 8-bit paged (torchtune)", f.paged)) if h is not None]
    held = [("one card", d, c.allreduce(0, 0.0)), *single] if c.world == 1 else [
        ("data parallel (DDP)", d, c.allreduce(f.grad_bytes, 2 * d.step_s / 3)),  # backward: twice the forward
        ("ZeRO-3", z, c.zero3(f.param_bytes, f.grad_bytes, figs.layer_bytes, z.step_s / 3, 2 * z.step_s / 3))]
    ways = []
    for name, h, comm in held:
        step = h.step_s + comm.exposed_s
        wall = steps * step
        ways.append({"way": name, "fits": h.fits, "peak": h.peak, "checkpointed": h.checkpointed,
                     "host_bytes": h.host_bytes, "step_s": step,
                     "compute_s": h.step_s, "comm": comm.to_dict(), "steps": steps, "wall_s": wall,
                     "gpu_hours": wall * c.world / 3600, "usd": wall * c.world / 3600 * price})
    fit = [w for w in ways if w["fits"]]
    best = min(fit, key=lambda w: w["wall_s"]) if fit else None
    return {"cluster": c.words(), "gpus": c.world, "bf": bf, "bcd_steps": bcd_steps, "steps": steps, "ways": ways,
            "bcd": {"wall_s": run.wall_s, "usd": run.usd},
            "best": None if best is None else {"way": best["way"], "time_x": run.wall_s / best["wall_s"],
                                               "usd_x": run.usd / best["usd"] if best["usd"] else None}}


def _add(d: dict, k: str, v: float) -> None:
    d[k] = d.get(k, 0.0) + v


def _visit(cfg: RunConfig, figs: ModelFigures, bf: BlockFigures, ds: Dataset, rates: Rates, pre: bool,
           protect_s: float | None = None) -> VisitForecast:
    """Block ``bf``'s visit with pre-inference ``pre`` (on only where the block has a prefix); its mid-visit
    checkpoints are those of ``protect_s`` seconds of training (default its own training time), so that the two ways
    of one visit compare with the same protection against a kill (:func:`choose_preinfer`)."""
    b, t = cfg.bcd, cfg.train
    pre = pre and bf.layers[0] > 0
    cached = block_cached(cfg, figs)
    rows, steps, T = visit_row_count(cfg, ds.n_train), b.max_steps, cfg.data.seq_len
    v = VisitForecast(bf.block, bf.layers, rows, steps, pre, "")
    wr, rd = rates.write_gbs * GB, rates.read_gbs * GB
    act_wr, act_rd = (b.act_store_gbs * GB,) * 2 if b.act_store else (wr, rd)  # the activations' own store
    act_puts = act_gets = 0
    load_rd = DISK_GBS * GB if cached else rd  # the training box's loads: its own copies (bcd.block_cache)
    if pre:
        act_puts, act_gets = _preinfer(v, cfg, figs, bf, rates, act_wr, rd if rates.preinfer_elsewhere else load_rd)
    else:
        v.step_s = bf.step_s if bf.layers[0] == 0 else bf.step_computed_s
        v.fits = bf.fits if bf.layers[0] == 0 else bf.fits_computed
        v.holding = bf.holding if bf.layers[0] == 0 else bf.holding_computed
        v.loaded_bytes = figs.params * STORED_BYTES
    v.load_s = v.loaded_bytes / load_rd
    v.cached = cached
    cluster = Cluster.of(cfg)
    if bf.sharded:  # FSDP: the held weights gathered forward and backward, the gradients reduce-scattered
        held = (bf.loaded_params if pre or bf.layers[0] == 0 else figs.params) * figs.compute_bytes
        comm = cluster.zero3(held, bf.grad_bytes, figs.layer_bytes, v.step_s / 3, 2 * v.step_s / 3)
    else:
        comm = cluster.allreduce(bf.grad_bytes, bf.backward_share * v.step_s)
    v.comm = comm.to_dict()
    v.train_compute_s = steps * (v.step_s + comm.exposed_s)
    v.read_s = v.read / act_rd
    v.train_s = max(v.train_compute_s, v.read_s)
    state = OPTIMIZERS[cfg.optim.name].state
    v.checkpoint_bytes = bf.trainable * (STORED_BYTES + 4 * state)  # what trains (fp32) and its state
    # the loop's own rule (models/specs.CheckpointSchedule) in closed form: by steps or seconds, held to its share
    guarded = v.train_s if protect_s is None else protect_s
    v.checkpoints = cfg.checkpoint_schedule().count(steps, guarded, v.checkpoint_bytes / wr)
    v.checkpoint_s = v.checkpoints * v.checkpoint_bytes / wr
    suffix = [o for o in figs.blocks if o.block > bf.block and o.own] if b.expand != "off" and bf.own else []
    v.block_bytes = sum(o.params * STORED_BYTES for o in [bf, *suffix])
    moments = bf.trainable * 4 * state if b.moments == "keep" else 0
    v.commit_s = (v.block_bytes + moments) * (1 / wr + (1 / (DISK_GBS * GB) if cached else 0))  # + the box's copy
    v.eval_s = t.eval_rows * T * figs.forward_flops / (rates.train_tflops * 1e12 * t.world)
    v.wall_s = v.preinfer_s + v.load_s + v.train_s + v.checkpoint_s + v.eval_s + v.commit_s
    v.puts += v.checkpoints * 2 + len(suffix) + 1 + (1 if moments else 0) + 4  # + state, manifest, records
    v.gets += len(figs.blocks) + 4
    _bill(v, cfg, rates, act_puts, act_gets)
    return v


def _preinfer(v: VisitForecast, cfg: RunConfig, figs: ModelFigures, bf: BlockFigures, rates: Rates, act_wr: float,
              rd: float) -> tuple[int, int]:
    """Visit ``v``'s pre-inference and its reads of what it wrote: the activation bytes and objects (the layout
    pre-inference writes), its time (the prefix loaded, computed on the pre-inference GPUs, written), the step as
    held reading them; returns the activation objects put and got."""
    b, T, rows, steps = cfg.bcd, cfg.data.seq_len, v.rows, v.steps
    lay = group_layout(rows, T, figs.d_model, b.shard_rows, b.act_dtype)
    epochs = steps * cfg.train.batch_size / rows  # the reader fetches each chunk object once per pass over the rows
    whole = int(epochs)
    rest = -(-round((epochs - whole) * rows) // lay.chunk_rows)
    v.written, v.chunk_rows, v.objects_written = lay.array_bytes, lay.chunk_rows, lay.objects
    v.read = whole * lay.array_bytes + min(rest, lay.n_chunks) * (lay.hidden_chunk_bytes + lay.targets_chunk_bytes)
    v.preinfer_compute_s = rows * T * bf.prefix_flops / (rates.preinfer_tflops * 1e12 * rates.preinfer_gpus)
    v.preinfer_write_s = v.written / act_wr
    prefix_params = figs.params - bf.loaded_params
    v.prefix_load_s = prefix_params * STORED_BYTES / rd
    v.preinfer_s = v.prefix_load_s + max(v.preinfer_compute_s, v.preinfer_write_s)
    v.step_s, v.fits, v.holding = bf.step_s, bf.fits, bf.holding
    v.loaded_bytes = bf.loaded_params * STORED_BYTES
    return lay.objects, whole * 2 * lay.n_chunks + 2 * min(rest, lay.n_chunks)


def _bill(v: VisitForecast, cfg: RunConfig, rates: Rates, act_puts: int, act_gets: int) -> None:
    """Visit ``v``'s GPU-hours by kind (the training box waits, rented, for pre-inference elsewhere) and its money:
    GPUs, store requests (the run's store and the activations'), egress, the activations held."""
    sp, t, pre = cfg.spend, cfg.train, v.preinfer
    prices = catalog(sp)
    box = v.wall_s - v.preinfer_s
    pre_kind, box_kind = sp.preinfer_device, sp.train_device
    box_gpus = sp.train_gpus or t.world
    pre_gpus = rates.preinfer_gpus if rates.preinfer_elsewhere else box_gpus
    if pre and rates.preinfer_elsewhere:
        _add(v.gpu_hours, pre_kind, v.preinfer_s * pre_gpus / 3600)
        box += v.preinfer_s  # the training box waits for pre-inference, rented all the while
    elif pre:
        _add(v.gpu_hours, pre_kind, v.preinfer_s * box_gpus / 3600)
    _add(v.gpu_hours, box_kind, box * box_gpus / 3600)
    v.gpu_usd = sum(h * prices[k] for k, h in v.gpu_hours.items())
    v.request_usd = (cfg.object_store() * (v.puts / 1000 * sp.put_usd_per_1k + v.gets / 1000 * sp.get_usd_per_1k)
                     + cfg.act_object_store() * (act_puts / 1000 * sp.put_usd_per_1k
                                                 + act_gets / 1000 * sp.get_usd_per_1k))
    v.puts, v.gets = v.puts + act_puts, v.gets + act_gets
    v.egress_usd = v.read / GB * cfg.act_egress_usd_gb() + (not v.cached) * v.loaded_bytes / GB * cfg.egress_usd_gb()
    held_usd = cfg.act_object_store() * v.written / GB * (v.wall_s - v.load_s) / MONTH_S * sp.storage_usd_gb_month
    v.usd = v.gpu_usd + v.request_usd + v.egress_usd + held_usd


def _both(cfg: RunConfig, figs: ModelFigures, bf: BlockFigures, ds: Dataset, rates: Rates
          ) -> tuple[VisitForecast, VisitForecast]:
    """Block ``bf``'s visit pre-inferred and with its prefix on the card, with the same checkpoints: those of the
    longer training (a visit that trains faster from stored activations would otherwise also write fewer
    checkpoints, and win on protection it gave up)."""
    guard = max(_visit(cfg, figs, bf, ds, rates, p).train_s for p in (True, False))
    return _visit(cfg, figs, bf, ds, rates, True, guard), _visit(cfg, figs, bf, ds, rates, False, guard)


def _auto_preinfers(on: VisitForecast, off: VisitForecast) -> bool:
    """``bcd.preinfer=auto``'s rule: the way that fits; where both do, pre-inference only where it is faster by more
    than :data:`TIE` and no dearer, or as fast (within :data:`TIE`) and cheaper."""
    if on.fits != off.fits:
        return on.fits
    if on.wall_s < (1 - TIE) * off.wall_s:
        return on.usd <= off.usd
    return on.wall_s <= (1 + TIE) * off.wall_s and on.usd < off.usd


def _flip(cfg: RunConfig, figs: ModelFigures, bf: BlockFigures, ds: Dataset, rates: Rates, now: bool) -> str:
    """What would flip ``auto``'s choice for this visit: the bandwidth of the store the activations cross
    (``bcd.act_store_gbs``, else the store's both ways) at which it would choose the other way, found by bisection on
    a log scale within 1e-4x..1e4x of today's; or that none in that range does."""
    gbs = cfg.bcd.act_store_gbs if cfg.bcd.act_store else rates.read_gbs

    def preinfers(f: float) -> bool:
        if cfg.bcd.act_store:
            c = cfg.model_copy(update={"bcd": cfg.bcd.model_copy(update={"act_store_gbs": cfg.bcd.act_store_gbs * f})})
            return _auto_preinfers(*_both(c, figs, bf, ds, rates))
        r = Rates(**{**rates.__dict__, "write_gbs": rates.write_gbs * f, "read_gbs": rates.read_gbs * f})
        return _auto_preinfers(*_both(cfg, figs, bf, ds, r))

    lo, hi = (1e-4, 1.0) if now else (1.0, 1e4)
    if preinfers(lo if now else hi) == now:
        return "; no store bandwidth within 10,000x of this one changes that"
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if preinfers(mid) else (mid, hi)
    return (f"; it would compute the prefix on the card below {gbs * lo:.3g} GB/s" if now
            else f"; it would pre-infer from {gbs * hi:.3g} GB/s")


def choose_preinfer(cfg: RunConfig, figs: ModelFigures, bf: BlockFigures, ds: Dataset, rates: Rates) -> VisitForecast:
    """Block ``bf``'s visit as ``bcd.preinfer`` says: on, off, or ``auto``: the faster of the two (then the cheaper),
    with the reason in words and, for ``auto``, the store bandwidth that would flip it (:func:`_flip`)."""
    setting = cfg.bcd.preinfer
    if bf.layers[0] == 0:
        v = _visit(cfg, figs, bf, ds, rates, False)
        v.why = "the first block has no prefix"
        return v
    on, off = _both(cfg, figs, bf, ds, rates)

    def words(a: VisitForecast, b: VisitForecast) -> str:
        return (f"pre-inference {duration_text(on.wall_s)} {usd_text(on.usd)} (writes {on.written / GB:.1f} GB), "
                f"prefix on the card {duration_text(off.wall_s)} {usd_text(off.usd)}")

    if setting == "auto":
        faster = on.wall_s < (1 - TIE) * off.wall_s
        pick = on if _auto_preinfers(on, off) else off
        if on.fits != off.fits:
            how = "the only way that fits"
        elif pick is on:
            how = "faster and not dearer" if faster else f"as fast (within {TIE:.0%}) and cheaper"
        elif faster:  # time against money: the card's way stores nothing and crosses no paid link
            how = (f"cheaper by {usd_text(on.usd - off.usd)} (pre-inference is {duration_text(off.wall_s - on.wall_s)} "
                   "faster; it pre-infers where it is both)")
        elif on.wall_s <= (1 + TIE) * off.wall_s:
            how = f"as fast (within {TIE:.0%}) and not dearer"
        else:
            how = "faster and stores nothing"
        flip = _flip(cfg, figs, bf, ds, rates, pick is on) if on.fits == off.fits else ""
        pick.why = ("auto: " + ("pre-infer" if pick is on else "compute the prefix on the card") + f" is {how}: "
                    + words(on, off) + flip)
    else:
        pick = on if setting else off
        pick.why = f"bcd.preinfer={'true' if setting else 'false'}: {words(on, off)}"
    other = off if pick is on else on
    pick.alternative = {"preinfer": other.preinfer, "wall_s": other.wall_s, "gpu_usd": other.gpu_usd,
                        "usd": other.usd, "written": other.written, "read": other.read, "fits": other.fits}
    return pick


def forecast_run(cfg: RunConfig, figs: ModelFigures, ds: Dataset, rates: Rates, bf: float | None = None) -> RunForecast:
    """Every visit of one cycle (they repeat each cycle: the same rows counted, the same blocks), the cycle, and
    the run of ``bcd.cycles`` cycles with the store's peak and the storage bill; full training beside it on the same
    cluster to the same loss (``bf``: B-F, :func:`full_training`)."""
    rates.check()
    sp, T = cfg.spend, cfg.data.seq_len
    visits = [choose_preinfer(cfg, figs, bf, ds, rates) for bf in figs.blocks]
    dataset_bytes = (ds.n_train + ds.n_val) * (T + 1) * 4
    model_bytes = figs.params * STORED_BYTES + figs.tensors * HEADER_BYTES
    cycle = Totals()
    start = held = dataset_bytes + model_bytes  # the store before the first visit: the token dataset and version 0
    gb_s = act_gb_s = 0.0  # GB-seconds held in the first cycle, for the storage bill (the run's store, the acts')
    here = 0 if cfg.bcd.act_store else 1  # activations on a store of their own (bcd.act_store) are not the run's
    for v in visits:
        working = here * v.written + min(2, v.checkpoints) * v.checkpoint_bytes
        cycle.store_peak = max(cycle.store_peak, held + working + v.block_bytes)
        gb_s += (held + working) / GB * v.wall_s
        act_gb_s += (1 - here) * v.written / GB * v.wall_s
        held += v.block_bytes
        cycle.wall_s += v.wall_s
        for k, h in v.gpu_hours.items():
            _add(cycle.gpu_hours, k, h)
        cycle.gpu_usd += v.gpu_usd
        cycle.written += v.written
        cycle.read += v.read
        cycle.store_written += here * v.written + v.checkpoints * v.checkpoint_bytes + v.block_bytes
        cycle.request_usd += v.request_usd
        cycle.egress_usd += v.egress_usd
    billed = sp.storage_usd_gb_month * cfg.object_store()  # a local path or memory:// bills no storage
    act_billed = sp.storage_usd_gb_month * cfg.act_object_store()
    cycle.storage_usd = (gb_s * billed + act_gb_s * act_billed) / MONTH_S
    # every cycle repeats the first but for the store, which holds one cycle's block files more each time (``grown``
    # bytes): the run's figures are the first cycle's times the cycles, in closed form (a loop over cycles never
    # answered at bcd.cycles=1e9); the k-th later cycle holds k * grown more for its whole wall time
    n, grown = cfg.bcd.cycles, held - start
    run = Totals(wall_s=cycle.wall_s * n, gpu_hours={k: h * n for k, h in cycle.gpu_hours.items()},
                 gpu_usd=cycle.gpu_usd * n, request_usd=cycle.request_usd * n, egress_usd=cycle.egress_usd * n,
                 written=cycle.written * n, read=cycle.read * n, store_written=cycle.store_written * n,
                 store_peak=cycle.store_peak + (n - 1) * grown)
    run.storage_usd = ((gb_s * n + grown / GB * cycle.wall_s * n * (n - 1) / 2) * billed
                       + act_gb_s * n * act_billed) / MONTH_S
    if block_cached(cfg, figs):  # the box's copies start empty: the model crosses the store's link once
        run.wall_s += model_bytes / (rates.read_gbs * GB)
        run.egress_usd += model_bytes / GB * cfg.egress_usd_gb()
    notes = _notes(cfg, figs, visits, model_bytes)
    given = bf is not None
    per_visit = layers_per_visit(figs)
    bf = bf if given else measured_bf(per_visit)
    full = full_training(cfg, figs, visits, run, bf)
    if full is not None:
        notes.append(f"full training to the same loss: the run's {full['bcd_steps']:,} BCD steps / B-F {bf:.3g} = "
                     f"{full['steps']:,.0f} steps" + (" (--bf)" if given else (
                         f" (B-F at {per_visit:.3g} layers a visit from the validity suite's l8-d128, measured at "
                         f"{', '.join(f'{x:.3g}' for x in sorted(MEASURED_BF))} layers a visit, "
                         "docs/results/rates-2026-11-28; --bf gives yours, from bcdflow compare)")))
    return RunForecast(ds, rates, visits, cycle, run, cfg.bcd.cycles, dataset_bytes, model_bytes, notes, full)


def block_cached(cfg: RunConfig, figs: ModelFigures) -> bool:
    """Whether the training box loads the model from its own copies of the block files: ``bcd.block_cache`` on a store
    that is not its disk already (core/context.open_store), holding at least the model (fewer bytes: the least
    recently used parts go before they are read again, so loads read the store as without it) and one machine (the
    others read each block a visit commits from the store: not counted as cached)."""
    return (bool(cfg.bcd.block_cache) and cfg.object_store() and cfg.train.nodes == 1
            and cfg.bcd.block_cache_gb * GB >= figs.params * STORED_BYTES)


def _notes(cfg: RunConfig, figs: ModelFigures, visits: list[VisitForecast], model_bytes: int) -> list[str]:
    """What a reader of the plan should know about its figures: the step cap, the box's block copies, the
    activations' own store, compression, the activations' dtype."""
    notes = [f"steps are the cap bcd.max_steps={cfg.bcd.max_steps} per visit (a visit may stop sooner: the plateau "
             "or the adaptive budget), so times and money are upper bounds"]
    loaded = sum(v.loaded_bytes for v in visits)
    if block_cached(cfg, figs):
        notes.append(f"bcd.block_cache={cfg.bcd.block_cache}: visits load the model from the box's copies at "
                     f"{DISK_GBS:g} GB/s, no egress; the run reads it from the store once ({model_bytes / GB:,.1f} GB, "
                     "in the run's figures); a visit on another box reads the store")
    elif cfg.bcd.block_cache and cfg.object_store() and cfg.train.nodes > 1:
        notes.append(f"bcd.block_cache on {cfg.train.nodes} machines: each reads the blocks another commits from the "
                     "store, so visits' loads are priced as without it")
    elif cfg.bcd.block_cache and cfg.object_store():
        notes.append(f"bcd.block_cache_gb={cfg.bcd.block_cache_gb:g} holds less than the model ({model_bytes / GB:,.1f} "
                     "GB): its parts go before they are read again, so visits load from the store as without it")
    elif cfg.object_store() and loaded and cfg.egress_usd_gb() > 0:
        notes.append(f"visits load {loaded / GB:,.0f} GB of the model from the store a cycle "
                     f"(${loaded / GB * cfg.egress_usd_gb():,.2f} egress): bcd.block_cache=DIR keeps the box's own "
                     "copies and reads the model once a run")
    if cfg.bcd.act_store and any(v.preinfer for v in visits):
        most = max(v.written for v in visits)
        notes.append(f"activations on bcd.act_store={cfg.bcd.act_store} at {cfg.bcd.act_store_gbs:g} GB/s (at most "
                     f"{most / GB:,.1f} GB at once, not in the run store's peak); a visit resumed on a machine "
                     "without them pre-infers them again (its pre-inference time once more)")
    if cfg.bcd.act_compression != "none":
        notes.append("bcd.act_compression=zstd: activation bytes are before compression (they barely compress)")
    if any(v.preinfer for v in visits) and cfg.bcd.act_dtype == "float32":
        notes.append("bcd.act_dtype=bfloat16 halves the activation bytes written and read (rounded activations: the "
                     "weights then differ from computing the prefix by that rounding, docs/DESIGN.md I2)")
    return notes
