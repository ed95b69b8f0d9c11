"""The run configuration: typed sections, each check next to its field (docs/CONVENTIONS.md 3).

Keys are addressed as ``section.field`` on the command line (``--set bcd.blocks=4``) and in YAML.
Every error names the key: ``bcd.sample_rate: must be in (0, 1], got 1.5``.

A config is data plus validation: it reads no file, opens no store and looks at no device. What needs those
(the model of a Hugging Face checkpoint, the store, the device's memory) is resolved by the run context
(``core/context.py``), which checks a checkpoint's model against the config with :func:`check_model`.
"""
from __future__ import annotations

import codecs
import copy
import difflib
import enum
import json
import math
import os
import re
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bcdflow.constants import MAX_LEASE_SECONDS, MAX_MEMORY_GB
from bcdflow.errors import BadInput
from bcdflow.core.orders import ORDERS
from bcdflow.core.spend import DEFAULT_KIND, DEFAULT_PRICES, parse_prices
from bcdflow.models.model_config import MAX_VOCAB, REGISTRY, SIZE_LIMITS, ModelConfig, get_config
from bcdflow.models.errors import ConfigError
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.plan import layer_bounds
from bcdflow.models.specs import (CARD_RATES, PCIE_GBS, CheckpointSchedule, OptimSpec, StepShape, StopRule,
                                  card_rates, pcie_gbs_for, tflops_for)
from bcdflow.storage import layout, runs
from bcdflow.storage.backends import backend_of
from bcdflow.storage.store import check_url

# the fixed choice sets, once: the config's fields and the flat Prefect form (flows/params.py) both use these
ModelName = Literal[tuple(REGISTRY)]
Order = Literal[tuple(ORDERS)]
OptimName = Literal[tuple(OPTIMIZERS)]


SUFFIX_RULES = ("sign", "normalized")
"""The state-free rules ``bcd.expand`` can move the frozen suffix with (models/suffix.py); the planner holds them alike
(``StepShape.suffix="sign"``: one suffix weight's gradient and a chunk's temporaries at a time)."""

class Resume(enum.Enum):
    """Whether a resumed run must keep a config field (``Annotated[type, SAME]``) or may change it (``FREE``)."""
    SAME = "same"
    """It defines what the run computes: the model, the data, the block plan, the optimizer and its schedule's
    shape, the batch, the seed, when a visit stops and what it starts from. A resume that differs is refused."""
    FREE = "free"
    """Where and how the run runs (device, precision, memory, parallelism, machines, stores, checkpoint cadence, the
    fleet), what it is billed, the rates it may lower after a divergence (``optim.lr``, ``bcd.lr_scales``,
    ``bcd.expand_lr``), or how far a finished run is trained further (``bcd.cycles``, ``train.steps``, ``stop.*``,
    ``spend.budget_usd``: core/rules.FURTHER)."""


SAME, FREE = Resume.SAME, Resume.FREE


def field_resume(field) -> Resume | None:
    """The mark a pydantic field carries (None: none)."""
    return next((m for m in field.metadata if isinstance(m, Resume)), None)


class _Section(BaseModel):
    # attribute docstrings become field descriptions: the Prefect UI form shows them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)


# the bounds of the model sizes (SIZE_LIMITS) and of data.vocab_size (MAX_VOCAB) live with the model config, so a
# Hugging Face checkpoint's config.json is held to the same ones (models/hf_names.config_from_hf)


class ModelSection(_Section):
    name: ModelName = "tiny"
    """A registry name: tiny, tiny-llama, gpt2-124m, G-1.6B ... L-23B."""
    n_layer: int | None = None
    """Decoder layers; None = the named model's."""
    d_model: int | None = None
    """Width of the residual stream; None = the named model's."""
    n_head: int | None = None
    """Attention heads; None = the named model's."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention, LLaMA); None = the named model's."""
    d_ff: int | None = None
    """Width of the feed-forward layer; None = the named model's."""
    n_ctx: int | None = None
    """Longest context the model takes (positions); None = the named model's."""
    from_hf: str | None = None
    """A Hugging Face checkpoint directory to fine-tune (config.json, model.safetensors or a sharded index,
    tokenizer.json), or a hub id already in the local HF cache (nothing is downloaded). Sizes, context and
    vocabulary come from its config.json, the tokenizer is its tokenizer.json; ``name`` is then ignored."""

    @field_validator(*SIZE_LIMITS)
    @classmethod
    def _size(cls, v: int | None, info) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        if v is not None and v > SIZE_LIMITS[info.field_name]:
            raise ValueError(f"{v} is beyond any model this trains (at most {SIZE_LIMITS[info.field_name]})")
        return v

    def overrides(self) -> dict:
        """The size fields set here (None = the registry's), as ``get_config`` takes them."""
        return self.model_dump(exclude={"name", "from_hf"})


class DataSection(_Section):
    files: str | list[str] | None = None
    """Local text/json/parquet files: one glob string or a list. None and no ``path`` = built-in corpus."""
    path: str | None = None
    """A Hugging Face datasets path (hub name or local dataset dir), used when ``files`` is unset."""
    name: str | None = None
    """The datasets config name that goes with ``path``."""
    split: str = "train"
    """The split of ``path`` to read."""
    text_field: str = "text"
    """The field of a record (json, jsonl, parquet, ``path``) that holds the text."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training sequence (at most the model's context)."""
    vocab_size: int = Field(2048, ge=260)
    """Size of the BPE vocabulary trained on the corpus (at most 2**21: the trainer allocates for all of it)."""
    tokenizer: str | None = None
    """A local tokenizer.json to use instead of training a byte-level BPE on the corpus."""
    format: Literal["text", "prompt_completion", "chat"] = "text"
    """``text``: documents (``text_field``); ``prompt_completion``: records with ``prompt`` and ``completion``
    strings; ``chat``: records with a ``messages`` list rendered by the checkpoint's chat template. The
    two supervised formats train on completion/assistant tokens only (prompt tokens are masked)."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Share of the rows held out for validation."""
    max_chars: int | None = None
    """Read at most this many characters of the corpus; None = all of it."""
    builtin_bytes: int = 1_500_000
    """How much of the built-in (Python standard library) corpus to read."""

    @field_validator("files")
    @classmethod
    def _files(cls, v):
        if v is not None and not (v.strip() if isinstance(v, str) else v):
            raise ValueError("empty (no files given; leave it unset for the built-in corpus)")
        return v

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        if v > MAX_VOCAB:
            raise ValueError(f"{v} is beyond what the tokenizer trainer can allocate (at most {MAX_VOCAB})")
        return v


class BcdSection(_Section):
    blocks: Annotated[int, SAME] = Field(3, ge=1)
    """How many blocks the layers are cut into (one trains per visit)."""
    boundaries: Annotated[list[int] | None, SAME] = None
    """Explicit layer cut points (e.g. [4, 8] for 12 layers); overrides ``blocks``. ``bcdflow plan-memory``
    recommends them where blocks sized to fit need fewer than equal splits."""

    @field_validator("boundaries", mode="before")
    @classmethod
    def _whole_layers(cls, v):
        """A cut point is a layer index: one between layers, never inside one (a block is whole layers)."""
        for c in v if isinstance(v, list) else ():
            if isinstance(c, str) and c.strip().lstrip("-").isdigit():
                continue  # "4" from a quoted YAML value: an index
            if isinstance(c, bool) or not isinstance(c, (int, float)) or c != int(c):
                raise ValueError(f"bcd.boundaries: cut points are layer indices, a block is whole layers (a cut "
                                 f"cannot split a layer), got {c!r} in {v}")
        return v
    split: Annotated[Literal["params", "layers"], SAME] = "params"
    """How ``blocks`` cuts the layers: equal parameter counts (embeddings and head included; the
    paper updates one third of the parameters per visit) or equal layer counts."""
    freeze: Annotated[list[Literal["embeddings", "head"]], SAME] = []
    """Parameters no visit trains: ``embeddings`` (token and position), ``head`` (the output projection; a tied head
    is the token embedding). BAdam's default: the 128k-row embedding and untied head of a Llama-3-sized model are
    a large part of the blocks that own them, so freezing them makes those visits as small as the others, and a
    ``params`` split balances what trains. A trade-off: the run is no longer full-parameter training."""
    vocab_blocks: Annotated[int, SAME] = Field(1, ge=1)
    """Row blocks per vocabulary matrix: > 1 splits the token embedding and an untied head (not one ``freeze`` keeps)
    each into that many blocks of rows, numbered after the layer blocks; a visit trains its rows only (gradient and
    optimizer state for those rows), the block that stores the matrix trains the rest of its parameters, and the
    rows' visit commits the whole matrix (its other rows unchanged) into that block's file. Full-parameter training
    where a 128k-row matrix would not fit whole (docs/guide/row-blocks.md)."""
    cycles: Annotated[int, FREE] = Field(2, ge=1)
    """Passes over all blocks."""
    order: Annotated[Order, SAME] = "cyclic"
    """The order of the blocks in a cycle: ``cyclic``, ``reverse``, ``random`` (seeded per cycle) or ``greedy``
    (the largest gradient norm first)."""
    sample_rate: Annotated[float, SAME] = 0.9
    """Per-visit data sampling rate (paper §3.2.3)."""
    preinfer: Annotated[bool | Literal["auto"], SAME] = True
    """Pre-compute the frozen prefix's activations to Zarr (paper §3.2.2). ``auto``: per visit, where the run planner
    (core/forecast.choose_preinfer, ``bcdflow plan``) says the visit is faster with it than computing the prefix on the
    training card every step, at ``train.store_gbs``; the visit's record says why."""
    max_steps: Annotated[int, SAME] = Field(200, ge=1)
    """A visit's step cap (local convergence: it may end sooner on a plateau or its budget)."""
    eval_every: Annotated[int | None, FREE] = Field(None, ge=1)
    """Also validate every N steps within a visit, at the end of the first window past each multiple (None = once,
    after the visit); the baseline's is ``train.eval_every``."""
    patience: Annotated[int, SAME] = Field(3, ge=0)
    """Plateau rule (models/trainer.StopRule): a visit has converged once a least-squares line through its last
    ``patience`` windows of step losses (half the visit once that is longer) lowers the loss by less than
    ``min_delta`` per window even at the optimistic end of its noise (two standard errors); 0 = off."""
    min_delta: Annotated[float, SAME] = Field(1e-2, ge=0)
    """The plateau rule's smallest fall of the loss per window that still counts as progress."""
    window: Annotated[int, SAME] = Field(20, ge=1)
    """Steps per window: the loss is synced to the host and the stop rules are read once per window."""
    budget: Annotated[Literal["fixed", "adaptive"], SAME] = "adaptive"
    """``adaptive``: a visit also ends (``stopped_by: budget``) once it lowers the training loss more slowly per
    step than the other blocks did on average over their last visits, so steps go where the loss falls; ``fixed``:
    visits run to ``max_steps`` or the plateau rule."""
    moments: Annotated[Literal["reset", "keep"], SAME] = "keep"
    """The optimizer state a visit starts from: ``reset`` (a fresh optimizer, paper Algorithm 1 and BAdam);
    ``keep``: the block's own state (AdamW moments and step count) from its last visit, stored with the committed
    version, so a block picks up where it left off (a visit on several GPUs gathers and cuts it like a mid-visit
    checkpoint)."""
    lr_scales: Annotated[list[float] | None, FREE] = None
    """Per-block multipliers of ``optim.lr`` (one per block), e.g. a lower rate for the embedding block."""
    shard_rows: Annotated[int, FREE] = Field(256, ge=1)
    """Rows per pre-inference shard (the unit of work and of concurrent writes)."""
    act_dtype: Annotated[Literal["float32", "float16", "bfloat16"], FREE] = "float32"
    """The dtype pre-inferred activations are stored in (bfloat16 halves the bytes, rounding them)."""
    act_compression: Annotated[Literal["none", "zstd"], FREE] = "none"
    """Activations barely compress; zstd (level 1) trades CPU for bytes on a slow link."""
    act_store: Annotated[str | None, FREE] = None
    """Where pre-inference writes a visit's activations and training reads them back: a local path (the training
    box's own disk: they never cross a paid link) or a bucket beside the GPUs; None = the run's ``store``. Versions,
    checkpoints and records stay on the run's store. A visit's activations (and their shards' markers) are its
    working objects: a visit that resumes on a machine without them pre-infers them again."""
    act_store_gbs: Annotated[float, FREE] = Field(2.0, gt=0)
    """The activation store's bandwidth both ways, GB/s, that ``bcdflow plan`` and ``bcd.preinfer=auto`` assume
    where ``act_store`` is set (2: a rented box's NVMe disk)."""
    block_cache: Annotated[str | None, FREE] = None
    """A local directory where each box keeps copies of the block files (the model's versions, kept moments) it
    writes to or reads from the run's store, named by their sha256 and checked against it on every read: a visit then
    loads the model from the box's disk, not through the bucket's paid, slow link (storage/block_cache.py). None =
    every load reads the store. Each box has its own; a box without a copy reads the store once."""
    block_cache_gb: Annotated[float, FREE] = Field(64.0, ge=0)
    """The most ``block_cache`` holds, GB; past it the least recently used copies go (0: keep none)."""
    preinfer_batch_size: Annotated[int | None, FREE] = Field(None, ge=1)
    """Rows per pre-inference forward (no gradients); None = the most that fit the device's budget with the
    prefix held as it must be (models/holding.no_grad_holding), up to ``shard_rows`` (16k tokens on the CPU)."""
    preinfer_workers: Annotated[int | None, FREE] = Field(None, ge=1)
    """Pre-inference shard tasks run at once in this process; None = 1 on CPU (torch already uses every
    core per shard), 2 on GPU (one shard's I/O overlaps the next one's compute)."""
    store_concurrency: Annotated[int, FREE] = Field(16, ge=1)
    """Zarr's async concurrency: object-store requests in flight per shard read/write."""
    recompute: Annotated[Literal["auto", "on", "off", "all"], FREE] = "auto"
    """Recompute the frozen layers after the active block in backward instead of keeping their activations
    (activation checkpointing; the gradients are bitwise the same). ``auto``: per visit, off when it fits the device's budget as
    it is, else whichever of recompute or streaming frozen layers (``train.offload=auto``) the planner says fits and
    is faster (models/holding.choose_holding); ``all``: the active block's own layers too (long sequences:
    each layer keeps only its input, at the cost of a second forward of the block)."""

    expand: Annotated[Literal["off", "lora", "sign", "normalized"], SAME] = "lora"
    """Landscape expansion, partial (BREAD): ``lora``: low-rank adapters on the linear maps of the frozen layers
    after the active block (its suffix) train beside it, on the gradients its backward computes anyway, and the
    visit's end merges them into those layers (in fp32, cast to each block's stored dtype): a visit then commits
    its block and the suffix blocks (docs/DESIGN.md I1). The prefix, and so the stored activations, stay exact.
    The default since it took 17-20% fewer steps to full training's loss on both corpora of the validity suite
    (README). ``sign``: the suffix's full weights move too, state-free (FRUGAL's idea): each step, as backward
    produces each suffix weight's gradient, the weight takes a sign-descent step of ``bcd.expand_lr`` and the gradient
    is dropped (no optimizer state, no gradient kept; bf16-held weights rounded stochastically; models/suffix.py);
    ``normalized``: the same with normalized SGD, each suffix weight stepped along its gradient scaled to an RMS of
    ``bcd.expand_lr`` (``w -= lr * sqrt(n) * g / ||g||``: sign's step size, the gradient's direction); both run in
    one process, every suffix layer on the device (not with ``train.offload=stream``, ``train.gpus`` > 1 or
    ``bcd.vocab_blocks`` > 1). ``off``: a visit changes its block only (a run stored before ``lora`` was the default
    ran ``off``)."""
    expand_rank: Annotated[int, SAME] = Field(16, ge=1)
    """The adapters' rank (``bcd.expand=lora``): each adapted (out, in) matrix trains r × (out + in) numbers."""
    expand_lr: Annotated[float | None, FREE] = Field(None, gt=0)
    """The adapters' learning rate, or the suffix's sign-descent step with ``sign`` (warmed up and decayed as the
    block's); None = the block's own (``optim.lr`` × its ``bcd.lr_scales`` entry)."""

    @field_validator("preinfer", mode="before")
    @classmethod
    def _preinfer(cls, v):
        words = {"auto": "auto", "true": True, "false": False, "yes": True, "no": False, "on": True, "off": False,
                 "1": True, "0": False}
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in words:
            return words[v.strip().lower()]
        raise ValueError(f"must be true, false or auto, got {v!r}")

    @field_validator("block_cache")
    @classmethod
    def _local_dir(cls, v: str | None) -> str | None:
        if v is not None and ("://" in v and not v.startswith("file://") or not v.strip()):
            raise ValueError(f"must be a local directory (this box's disk), got {v!r}")
        return v.removeprefix("file://") if v else v

    @field_validator("expand", mode="before")
    @classmethod
    def _expand_off(cls, v):
        return "off" if v is False else v  # YAML reads off as false

    @field_validator("recompute", mode="before")
    @classmethod
    def _on_off(cls, v):
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML reads on/off as booleans

    @field_validator("sample_rate")
    @classmethod
    def _rate(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


MIN_LR = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny: the smallest rate fp32 holds as a normal number


class OptimSection(_Section):
    name: Annotated[OptimName, SAME] = "adamw"
    """The optimizer of the active block (paper §4.2.1; models/optimizers.py)."""
    lr: Annotated[float | None, FREE] = Field(None, gt=0)
    """None = the paper's §4.2.1 default (AdamW 1e-4, SGD 0.1)."""
    weight_decay: Annotated[float, SAME] = Field(1e-5, ge=0)
    """Decoupled weight decay (AdamW) or L2 (SGD); the paper's 1e-5."""
    momentum: Annotated[float, SAME] = Field(0.9, ge=0)
    """SGD's momentum (unused by AdamW)."""
    grad_clip: Annotated[float, SAME] = Field(1.0, ge=0)
    """Clip the active block's gradient norm to this before each step; 0 = off."""
    warmup_steps: Annotated[int, SAME] = Field(0, ge=0)
    """Linear warmup over each visit's first steps (a visit starts with a fresh optimizer); the baseline's run is
    one visit."""
    schedule: Annotated[Literal["constant", "cosine"], SAME] = "constant"
    """``cosine``: decay the rate over ``decay_steps`` optimizer steps, counted across visits, down to
    ``min_lr_ratio`` × ``lr`` (and stay there)."""
    decay_steps: Annotated[int | None, SAME] = Field(None, ge=1)
    """The planned step count a cosine schedule decays over, the same for the baseline and BCD (so a BCD run that
    stops at a target or on the adaptive budget decays as the baseline does); None = ``train.steps``."""
    min_lr_ratio: Annotated[float, SAME] = Field(0.1, ge=0, le=1)
    """Where ``cosine`` ends, as a fraction of ``lr``."""
    switch_every: Annotated[int | None, SAME] = Field(None, ge=1)
    """``badam``/``lisa`` (baseline peers): steps between block or layer switches; None = the authors' (BAdam 100,
    LISA 20)."""
    rank: Annotated[int | None, SAME] = Field(None, ge=1)
    """``galore``/``apollo``: projection rank (None = a quarter of the model width; ``apollo-mini``: 1); ``lora``:
    the adapters' rank (None = 8)."""
    lisa_layers: Annotated[int, SAME] = Field(1, ge=1)
    """``lisa``: decoder layers sampled per period (gamma; LMFlow's 1)."""

    @field_validator("lr")
    @classmethod
    def _lr(cls, v: float | None) -> float | None:
        # the rate is applied in fp32: below its smallest normal number it is 0 or subnormal there (1e-310 trained
        # nothing, or made a NaN on every attempt), so it is refused before anything is written
        if v is not None and v < MIN_LR:
            raise ValueError(f"{v:g} is below {MIN_LR:.4g}, the smallest normal fp32 number (a rate is applied in "
                             "fp32, where a smaller one is 0 or subnormal); typical rates are 1e-5 to 1e-2")
        return v


class TrainSection(_Section):
    batch_size: Annotated[int, SAME] = Field(16, ge=1)
    """Sequences per optimizer step (the global batch, however many processes train it)."""
    steps: Annotated[int, FREE] = Field(300, ge=1)
    """Step count of the full-parameter baseline: it trains them all unless ``patience`` asks for a stop rule."""
    patience: Annotated[int, FREE] = Field(0, ge=0)
    """The baseline's plateau rule (as ``bcd.patience``, with ``bcd.min_delta`` and ``bcd.window``); 0 = off."""
    eval_every: Annotated[int | None, FREE] = Field(None, ge=1)
    """Baseline: validate every N steps (at the end of the first window past each multiple); None = ``steps`` / 25,
    so ``bcdflow compare`` can place where the baseline crosses L* (BCD validates after each visit)."""
    eval_rows: Annotated[int, FREE] = Field(256, ge=1)
    """Validation rows every validation loss is measured on."""
    device: Annotated[str, FREE] = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; checked against the machine
    that trains before anything runs."""
    precision: Annotated[Literal["fp32", "bf16"], FREE] = "fp32"
    """``bf16``: autocast, fp32 master weights and optimizer state for the active block, frozen weights stored in
    bf16 on the device (the stored block files are unchanged)."""
    memory_gb: Annotated[float | None, FREE] = Field(None, gt=0, le=MAX_MEMORY_GB)
    """The device's memory, in GB (1e9 bytes; at most a petabyte, past any device), to plan for (a 24 GB card on a
    bigger one): a visit may use it less the CUDA context and a reserve for workspaces and fragmentation
    (models/memory.device_budget); ``bcd.recompute=auto``, ``offload=auto`` and the choice between data parallel and
    sharding use it. None = the CUDA device's free memory as measured (less the reserve), unlimited on the CPU."""
    gpus: Annotated[int, FREE] = Field(1, ge=1)
    """Processes (GPUs) that train one visit, launched with torchrun on this machine; 1 = this process. Rank 0
    writes the checkpoints and the block; a SIGTERM to any rank checkpoints once. On the CPU: gloo processes."""
    nodes: Annotated[int, FREE] = Field(1, ge=1)
    """Machines a visit spans, ``gpus`` processes on each (``bcdflow plan`` prices the cluster: each step all-reduces
    the visit's trained gradients over ``link_gbs``; core/cluster.py). The machine whose task trains the visit is the
    first (torchrun node 0, rank 0 writes); each other one runs ``bcdflow join RUN --node-rank K``
    (docs/guide/memory.md), which joins every visit of the run at ``rdzv_endpoint``."""
    rdzv_endpoint: Annotated[str, FREE] = "127.0.0.1:29400"
    """``host:port`` of the first machine as the others reach it (torchrun's rendezvous, ``--master-addr`` and
    ``--master-port``) when ``nodes`` > 1."""
    link_gbs: Annotated[float, FREE] = Field(1.25, gt=0)
    """Bandwidth between two machines of the cluster, GB/s each way (1.25: 10 Gbit/s Ethernet, rented boxes'
    usual; 25 Gbit/s is 3.1, 100 Gbit/s InfiniBand 12.5). Only ``train.nodes`` > 1 uses it."""
    gpu_link_gbs: Annotated[float | None, FREE] = Field(None, gt=0)
    """All-reduce bandwidth between the GPUs of one machine, GB/s (nccl-tests' bus bandwidth); None =
    ``spend.train_device``'s (models/specs.CARD_RATES: about 10 for PCIe cards without NVLink, 230-360 over NVLink)."""
    parallel: Annotated[Literal["auto", "ddp", "fsdp"], FREE] = "auto"
    """With ``gpus`` > 1: ``ddp`` replicates the visit and all-reduces the active block's gradients (each process
    holds every weight), ``fsdp`` shards weights, gradients and optimizer state (FSDP2); ``auto``: ddp when the
    planner says a replica fits ``memory_gb``, else fsdp."""
    offload: Annotated[Literal["auto", "off", "stream"], FREE] = "auto"
    """Where a visit's frozen layers live: ``off``: on the device; ``stream``: all in pinned host memory, copied
    through ``stream_window`` device slots ahead of use (forward, backward and recompute; models/stream.py);
    ``auto``: as many resident as the budget allows and only the rest streamed, per visit (and with
    ``bcd.recompute=auto``, whichever of recompute or streaming the planner's time model says is faster). The
    no-grad passes (pre-inference, evaluation) hold their model the same way. One process per visit (not with
    ``train.gpus`` > 1 or ``train.compile``)."""
    stream_window: Annotated[int, FREE] = Field(2, ge=1)
    """Device slots for streamed layers (the one computing and the ones copied in ahead of it)."""
    pcie_gbs: Annotated[float | None, FREE] = Field(None, gt=0)
    """Host-to-device bandwidth the planner's time model assumes, GB/s; None = ``spend.train_device``'s host link in
    practice (models/specs.CARD_RATES: PCIe 4.0 x16 25, PCIe 5.0 50); ``make gpu-check`` measures it."""
    store_gbs: Annotated[float, FREE] = Field(0.2, gt=0)
    """The store's bandwidth the planner assumes, GB/s, both ways (``bcd.preinfer=auto``, ``bcdflow plan``'s default;
    0.2: a rented box's ~1.6 Gbit/s)."""
    tflops: Annotated[float | None, FREE] = Field(None, gt=0)
    """Matmul throughput the planner's time model assumes, TFLOP/s, at ``precision``; None = ``spend.train_device``'s
    (models/specs.CARD_RATES: about half its dense peak, e.g. an RTX 4090 fp32 40, bf16 80; an A100 9.75, 156);
    ``make gpu-check`` measures a matmul's."""
    compile: Annotated[bool, FREE] = False
    """torch.compile each layer of the visit (CUDA graphs are left to ``mode=reduce-overhead`` users: batches of a
    visit are not all the same shape)."""
    loss_chunk_rows: Annotated[int | None, FREE] = Field(None, ge=1)
    """Rows of the loss over the vocabulary computed at once; None = 128 MB of fp32 logits per chunk."""
    eval_batch_size: Annotated[int | None, FREE] = Field(None, ge=1)
    """Rows per validation forward (no gradients); None = the most that fit what a training step used (inside a
    visit) or the device's budget (a whole-model evaluation), up to ``eval_rows`` (16k tokens on the CPU)."""

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in v):
            raise ValueError(f"must be HOST:PORT (e.g. 10.0.0.1:29400), got {v!r}")
        return v

    @property
    def world(self) -> int:
        """Processes training one visit: ``gpus`` on each of ``nodes`` machines."""
        return self.gpus * self.nodes

    @field_validator("offload", mode="before")
    @classmethod
    def _off(cls, v):
        return {True: "stream", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML reads off as false

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu(:0)?|cuda(:\d+)?", v):
            raise ValueError(f"unknown device {v!r} (choose from auto, cpu, cuda, cuda:N)")
        return v


class S3Section(_Section):
    """Object-store connection for ``s3://`` stores. Credentials are never config values: they come from
    the standard AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or a
    named ``profile``, so they cannot leak into the store, MLflow params or logs."""
    endpoint_url: Annotated[str | None, FREE] = None
    """S3-compatible endpoint (MinIO, R2, a test server); None = AWS."""
    region: Annotated[str | None, FREE] = None
    """The bucket's region; None = the endpoint's default."""
    profile: Annotated[str | None, FREE] = None
    """A named AWS profile to take credentials from."""
    anon: Annotated[bool, FREE] = False
    """Read a public bucket without credentials."""


class CheckpointSection(_Section):
    every_steps: Annotated[int, FREE] = Field(50, ge=1)
    """Mid-visit checkpoint every N optimizer steps ..."""
    every_seconds: Annotated[float, FREE] = Field(300.0, gt=0, le=86400)
    """... and at least every S seconds (whichever comes first)."""
    max_share: Annotated[float, FREE] = Field(0.1, gt=0, le=1)
    """... but writing them takes at most this share of a visit's time: after a checkpoint that took W seconds, one
    that falls due waits (postponed, not dropped) for W x (1 - share) / share seconds of training (a 2.7B-parameter
    block's 32 GB at 0.2 GB/s: 160 s to write, so one every 24 min at 0.1, at most that much training lost to a
    kill -9). 1: the cadence above exactly. A SIGTERM's checkpoint is never held back."""


EGRESS_USD_GB = 0.09
"""Egress a rented GPU box off the bucket's cloud pays per GB read (S3 Standard to the internet, first 10 TB/month)."""


class SpendSection(_Section):
    """What the GPUs cost (docs/DESIGN.md §7): spend of a stage = wall seconds x GPUs x USD per GPU-hour."""
    prices: Annotated[list[str], FREE] = []
    """Catalog additions/overrides as KIND=USD per GPU-hour, e.g. ["h100=2.49"]; built in (paper §4.4.2):
    rtx4090=0.29, a800=0.69, a100=1.20. A YAML mapping {h100: 2.49} works too."""
    preinfer_device: Annotated[str, FREE] = DEFAULT_KIND
    """Device kind of pre-inference (a key of the price catalog)."""
    preinfer_gpus: Annotated[int | None, FREE] = Field(None, ge=1)
    """GPUs billed for pre-inference; None = what the run uses (``fleet.dask_workers`` on a local Dask cluster,
    else the training box's ``train.gpus``)."""
    train_device: Annotated[str, FREE] = DEFAULT_KIND
    """Device kind of block training; the planner's time model takes its rates (models/specs.CARD_RATES) unless
    ``train.tflops`` and ``train.pcie_gbs`` say otherwise."""
    train_gpus: Annotated[int | None, FREE] = Field(None, ge=1)
    """GPUs billed for training; None = ``train.gpus``."""
    eval_device: Annotated[str, FREE] = DEFAULT_KIND
    """Device kind of validation."""
    eval_gpus: Annotated[int | None, FREE] = Field(None, ge=1)
    """GPUs billed for validation (it runs on the training box); None = ``train.gpus``."""
    budget_usd: Annotated[float | None, FREE] = Field(None, gt=0)
    """Stop before a visit whose predicted spend (the block's last visit) exceeds what is left; None = no budget."""
    storage_usd_gb_month: Annotated[float, FREE] = Field(0.023, ge=0)
    """Object storage, USD per GB-month held (``bcdflow plan``; default: S3 Standard's first tier, us-east-1)."""
    put_usd_per_1k: Annotated[float, FREE] = Field(0.005, ge=0)
    """Object storage, USD per 1,000 writes (PUT; S3 Standard's)."""
    get_usd_per_1k: Annotated[float, FREE] = Field(0.0004, ge=0)
    """Object storage, USD per 1,000 reads (GET; S3 Standard's)."""
    egress_usd_gb: Annotated[float | None, FREE] = Field(None, ge=0)
    """USD per GB read out of the store's region; None = by where the store is: 0 for a local path or
    ``memory://`` (nothing crosses a paid link), :data:`EGRESS_USD_GB` (S3's first tier to the internet) for an object
    store, since the box this tool is for is a rented GPU off the bucket's cloud; set 0 where the GPUs sit beside
    the bucket (``RunConfig.egress_usd_gb``)."""

    @field_validator("prices", mode="before")
    @classmethod
    def _prices(cls, v):
        if isinstance(v, dict):
            v = [f"{k}={p}" for k, p in v.items()]
        elif isinstance(v, str):
            v = [e for e in v.split(",") if e.strip()]
        if isinstance(v, list):
            return [f"{k}={p:g}" for k, p in parse_prices(v).items()]
        return v

    @field_validator("preinfer_device", "train_device", "eval_device")
    @classmethod
    def _kind(cls, v: str, info) -> str:
        known = {**DEFAULT_PRICES, **parse_prices(info.data.get("prices") or [])}
        if v not in known:
            raise ValueError(f"unknown device kind {v!r} (catalog: {', '.join(known)}; "
                             "add one with spend.prices=[KIND=USD])")
        return v


class StopSection(_Section):
    """Global stop rules (docs/DESIGN.md §2): a run ends at the first of cycles done, target validation loss,
    budget (``spend.budget_usd``), no validation improvement over whole cycles."""
    target_val_loss: Annotated[float | None, FREE] = Field(None, gt=0)
    """Stop once a visit's validation loss is at or below this; None = off."""
    patience_cycles: Annotated[int, FREE] = Field(1, ge=0)
    """Stop after this many whole cycles without a new best validation loss; 0 = off."""
    min_delta: Annotated[float, FREE] = Field(0.0, ge=0)
    """How much lower than the best so far a validation loss must be to count as an improvement."""


class FleetSection(_Section):
    """Where a run's work goes beyond this process (docs/DESIGN.md §6). Unset, everything runs here (the default)."""
    visit_pool: Annotated[str | None, FREE] = None
    """A Prefect work pool of GPU machines: each visit runs as a run of the deployment ``bcd-visit/{visit_pool}``
    (prefect.yaml), picked up by any worker on the pool, the store being all they share; None = each visit is
    an in-process subflow."""
    visit_retries: Annotated[int, FREE] = Field(2, ge=0)
    """Resubmissions of a visit whose flow run crashed or failed for a machine reason (its worker killed, its
    box gone); it continues from its mid-visit checkpoint. Bad input is never resubmitted."""
    job_variables: Annotated[str, FREE] = "{}"
    """Job variables of the visit runs, a JSON object (e.g. {"env": {"NCCL_DEBUG": "WARN"}}), merged over the
    deployment's."""
    poll_seconds: Annotated[float, FREE] = Field(5.0, gt=0, le=86400)
    """How often the parent polls a dispatched visit's state."""
    preinfer: Annotated[Literal["local", "dask"], FREE] = "local"
    """Where a visit's pre-inference shards run: threads of the visit's process, or a Dask cluster
    (prefect-dask; one worker per GPU, Dask resource GPU=1)."""
    dask_address: Annotated[str | None, FREE] = None
    """An existing Dask scheduler (tcp://host:8786); None = a LocalCluster of ``dask_workers`` processes."""
    dask_workers: Annotated[int, FREE] = Field(2, ge=1)
    """Worker processes of the local Dask cluster (no ``dask_address``)."""
    lease_seconds: Annotated[float, FREE] = Field(60.0, ge=2, le=MAX_LEASE_SECONDS)
    """How long a run's (or a visit's) lease lasts without renewal (renewed every third of it): after a crash
    elsewhere, the wait before another process may take the run over. At most a day: longer can only be a
    mistake (and overflows the keep-alive thread's timer)."""
    reschedule_delay_s: Annotated[float, FREE] = Field(30.0, ge=0, le=86400)
    """A preempted visit (SIGTERM under a worker) is rescheduled this far ahead, so the worker of the machine
    going away does not pick it up again."""

    @field_validator("job_variables")
    @classmethod
    def _job_variables(cls, v: str) -> str:
        try:
            parsed = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object, got {v!r}")
        return v


class RunConfig(_Section):
    """The run's settings. Each field says whether a resumed run must match it (``SAME``: it defines what the run
    computes) or may change it (``FREE``: where and how the run runs, what it is billed, how far it trains); a
    section either says so as a whole (``model``, ``data``) or field by field. ``tasks/run.IDENTITY`` is derived from
    the marks (:func:`identity_keys`); tests/test_config.py fails on a field with none."""
    model: Annotated[ModelSection, SAME] = ModelSection()
    data: Annotated[DataSection, SAME] = DataSection()
    bcd: BcdSection = BcdSection()  # its fields say
    optim: OptimSection = OptimSection()  # its fields say
    train: TrainSection = TrainSection()  # its fields say
    s3: S3Section = S3Section()  # its fields say
    checkpoint: CheckpointSection = CheckpointSection()  # its fields say
    spend: SpendSection = SpendSection()  # its fields say
    stop: StopSection = StopSection()  # its fields say
    fleet: FleetSection = FleetSection()  # its fields say
    seed: Annotated[int, SAME] = Field(0, ge=0)
    """Seeds every random choice (numpy's SeedSequence takes non-negative integers only)."""
    store: Annotated[str, FREE] = "./bcdflow-store"
    """Any fsspec URL: a local path, memory://, s3://bucket/prefix."""
    tracking_uri: Annotated[str | None, FREE] = None
    """MLflow tracking URI; None = ``MLFLOW_TRACKING_URI`` from the environment, else a SQLite file next to a local
    store; "none" = tracking off."""
    experiment: Annotated[str, FREE] = "bcdflow"
    """The MLflow experiment runs are logged to."""
    log_model: Annotated[bool, FREE] = True
    """Log the final model (model.safetensors + config.json, as ``bcdflow export`` writes) to MLflow."""

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        return check_url(v)

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        if self.model.from_hf:
            sized = [k for k in ModelSection.model_fields if k not in ("name", "from_hf")
                     and getattr(self.model, k) is not None]
            if sized:
                raise ValueError(f"model.{sized[0]}: cannot be set with model.from_hf (the checkpoint's "
                                 "config.json decides the model)")
        elif self.data.format == "chat":
            raise ValueError("data.format: chat needs model.from_hf (a checkpoint whose tokenizer has a chat "
                             "template)")
        if self.bcd.act_store is not None:
            try:
                check_url(self.bcd.act_store)
            except BadInput as e:  # it names the run's store: this is the activations'
                raise BadInput("bcd.act_store" + str(e).removeprefix("store")) from None
            if (backend_of(self.bcd.act_store) is None and self.fleet.preinfer == "dask"
                    and self.fleet.dask_address):
                raise ValueError("bcd.act_store: a local path is the training box's disk, but pre-inference runs on "
                                 "the Dask cluster's machines (fleet.dask_address); use a bucket beside them, or "
                                 "fleet.preinfer=local")
        if self.train.world > self.train.batch_size:
            key = "train.gpus" if self.train.nodes == 1 else "train.nodes"
            raise ValueError(f"{key}: {self.train.world} processes need at least one row each of a batch, but "
                             f"train.batch_size={self.train.batch_size}")
        if self.bcd.lr_scales is not None:
            if len(self.bcd.lr_scales) != self.n_blocks:
                raise ValueError(f"bcd.lr_scales: {len(self.bcd.lr_scales)} value(s) for {self.n_blocks} blocks "
                                 "(one per block)")
            if any(not (math.isfinite(v) and v > 0) for v in self.bcd.lr_scales):
                raise ValueError(f"bcd.lr_scales: each must be a positive number, got {self.bcd.lr_scales}")
        self._cross_visit()
        t, kind = self.train, self.spend.train_device
        if kind not in CARD_RATES and (t.tflops is None or t.pcie_gbs is None):
            card_rates(kind)  # raises: spend.train_device, the known kinds, what to set
        if not self.model.from_hf:  # a registry model is data: check against it now (a checkpoint's: core/hf_import.py)
            check_model(self, get_config(self.model.name, **self.model.overrides(), vocab_size=self.data.vocab_size))
        return self

    def _cross_visit(self) -> None:
        """How a visit is held and what it trains, checked against each other: streaming, ``bcd.expand``, row
        visits (``bcd.vocab_blocks``)."""
        if self.train.offload == "stream" and (self.train.world > 1 or self.train.compile):
            raise ValueError("train.offload: stream runs a visit in one process without torch.compile (set "
                             "train.gpus=1 and train.compile=false, or train.offload=off)")
        if self.bcd.expand != "off" and self.train.compile:
            raise ValueError("bcd.expand: the adapters' hooks are not compiled; set train.compile=false (or "
                             "bcd.expand=off)")
        if self.bcd.expand != "off" and self.train.world > 1 and self.train.parallel == "fsdp":
            raise ValueError("bcd.expand: FSDP does not shard the adapters; set train.parallel=ddp (or auto, which "
                             "then takes ddp) or bcd.expand=off")
        if self.bcd.expand in SUFFIX_RULES:
            why = ("train.offload=stream (a streamed suffix layer has no weight on the device to step; set "
                   "train.offload=auto or off)" if self.train.offload == "stream" else
                   "train.gpus > 1 (each process would step its own suffix)" if self.train.world > 1 else
                   "bcd.vocab_blocks > 1 (a row block's visit has no suffix of its own)" if self.bcd.vocab_blocks > 1
                   else None)
            if why:
                raise ValueError(f"bcd.expand: {self.bcd.expand} runs in one process with its suffix on the device, "
                                 f"not with {why}"
                                 "; or set bcd.expand=lora or off")
        if self.bcd.vocab_blocks > 1:
            why = ("train.gpus > 1 (a row block's visit runs in one process)" if self.train.world > 1 else
                   "bcd.order=greedy (its probe ranks stored blocks)" if self.bcd.order == "greedy" else
                   f"optim.name={self.optim.name} (a baseline peer trains one block)"
                   if OPTIMIZERS[self.optim.name].peer else None)
            if why:
                raise ValueError(f"bcd.vocab_blocks: row blocks are not for {why}; set bcd.vocab_blocks=1")

    @property
    def n_blocks(self) -> int:
        """Blocks the run's plan has (``bcd.boundaries`` or ``bcd.blocks``)."""
        return len(self.bcd.boundaries) + 1 if self.bcd.boundaries else self.bcd.blocks

    def optim_spec(self, block: int | None = None) -> OptimSpec:
        """The optimizer of a visit of ``block`` (None: without its ``bcd.lr_scales`` entry)."""
        o, b = self.optim, self.bcd
        return OptimSpec(o.name, o.lr, o.weight_decay, o.momentum, grad_clip=o.grad_clip,
                         warmup_steps=o.warmup_steps, schedule=o.schedule, min_lr_ratio=o.min_lr_ratio,
                         total_steps=o.decay_steps or self.train.steps,
                         lr_scale=b.lr_scales[block] if b.lr_scales and block is not None else 1.0,
                         switch_every=o.switch_every, rank=o.rank, lisa_layers=o.lisa_layers, seed=self.seed)

    def stop_rule(self, min_rate: float | None = None) -> StopRule:
        """A visit's stop rule; ``min_rate``: the adaptive budget's rate to beat (``bcd.budget``)."""
        b = self.bcd
        return StopRule(b.max_steps, b.patience, b.min_delta, b.window,
                        min_rate=min_rate if b.budget == "adaptive" else None)

    def checkpoint_schedule(self) -> CheckpointSchedule:
        """When a visit's loop writes its mid-visit checkpoint (the ``checkpoint`` section)."""
        c = self.checkpoint
        return CheckpointSchedule(c.every_steps, c.every_seconds, c.max_share)

    def step_shape(self, no_grad: bool = False, preinfer: bool | None = None) -> StepShape:
        """One training step of a visit as the planner sees it (models/memory.py, models/holding.py). Several
        processes (``train.gpus``) or ``train.compile`` stream nothing; ``no_grad``: a no-grad pass's (pre-inference,
        an evaluation), held by one process as ``train.offload`` says whatever the visit's processes; ``preinfer``: a
        visit's own choice (``bcd.preinfer=auto``, which is otherwise planned as on). The time model's rates are
        ``spend.train_device``'s (models/specs.CARD_RATES), ``train.tflops`` and ``train.pcie_gbs`` where set."""
        t, b, kind = self.train, self.bcd, self.spend.train_device
        one = t.world == 1 and not t.compile
        return StepShape(t.batch_size, self.data.seq_len, t.precision, self.optim.name, self.optim.weight_decay,
                         t.loss_chunk_rows, recompute=b.recompute,
                         preinfer=(b.preinfer is not False) if preinfer is None else preinfer, freeze=tuple(b.freeze),
                         offload=t.offload if no_grad or one and b.expand not in SUFFIX_RULES else "off",
                         window=t.stream_window, expand_rank=b.expand_rank if b.expand == "lora" else 0,
                         suffix="sign" if b.expand in SUFFIX_RULES else "off", gpus=t.world,
                         pcie_gbs=pcie_gbs_for(t.pcie_gbs, kind), tflops=tflops_for(t.precision, t.tflops, kind))

    def object_store(self) -> bool:
        """Whether the store is an object store that bills storage, requests and egress (``s3://`` and the other
        ``storage/backends.py`` entries); a local path or ``memory://`` bills none of them."""
        return backend_of(self.store) is not None

    def egress_usd_gb(self) -> float:
        """What a GB read from the store costs in egress: ``spend.egress_usd_gb``, else by the store (see there)."""
        if self.spend.egress_usd_gb is not None:
            return self.spend.egress_usd_gb
        return EGRESS_USD_GB if self.object_store() else 0.0

    def act_object_store(self) -> bool:
        """Whether activations go to an object store (billed: storage, requests, egress): ``bcd.act_store``'s, else
        the run's store's."""
        return backend_of(self.bcd.act_store) is not None if self.bcd.act_store else self.object_store()

    def act_egress_usd_gb(self) -> float:
        """What a GB of activations read back costs in egress: a local ``bcd.act_store`` nothing, else as
        :meth:`egress_usd_gb` says of the store they are on (``spend.egress_usd_gb`` where set)."""
        if not self.bcd.act_store:
            return self.egress_usd_gb()
        if backend_of(self.bcd.act_store) is None:
            return 0.0
        return self.spend.egress_usd_gb if self.spend.egress_usd_gb is not None else EGRESS_USD_GB

    def act_storage_options(self) -> dict:
        """fsspec options for ``bcd.act_store`` (its backend's section, as :meth:`storage_options`)."""
        backend = backend_of(self.bcd.act_store)
        return backend.options(getattr(self, backend.name)) if backend is not None else {}

    def storage_options(self) -> dict:
        """fsspec options for the store URL: its backend's, from the section named as the backend
        (``storage/backends.py``; ``s3.*`` for an ``s3://`` store); none for a local path or ``memory://``."""
        backend = backend_of(self.store)
        return backend.options(getattr(self, backend.name)) if backend is not None else {}

    def resolved_tracking_uri(self) -> str:
        """``tracking_uri``, else ``MLFLOW_TRACKING_URI`` from the environment (as MLflow itself honours it), else a
        SQLite database in a local store (or the working directory)."""
        if self.tracking_uri:
            return self.tracking_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        if "://" not in self.store or self.store.startswith("file://"):
            root = os.path.abspath(os.path.expanduser(self.store.removeprefix("file://")))
            return f"sqlite:///{root}/mlflow.db"
        return f"sqlite:///{os.path.abspath('bcdflow-mlflow.db')}"


def store_config(url: str, endpoint_url: str | None = None) -> RunConfig:
    """The run config of a store named on the command line (``--store``, ``--endpoint-url``): the endpoint is the
    option its backend names (``storage/backends.Backend.endpoint``: an S3-compatible server for ``s3://``), and is
    left out for a store whose backend takes none (a local path, ``memory://``)."""
    backend = backend_of(url)
    if endpoint_url is None or backend is None or backend.endpoint is None:
        return RunConfig(store=url)
    return RunConfig(store=url, **{backend.name: {backend.endpoint: endpoint_url}})


# defaults changed after runs were stored without the key: such a run ran the former value, and continues with it
FORMER_DEFAULTS = {"bcd": {"expand": "off"}}


def with_former_defaults(stored: dict) -> dict:
    """A stored run config (``config.json``) with each key it lacks whose default has since changed filled with the
    value the run was trained with (``FORMER_DEFAULTS``)."""
    out = dict(stored)
    for sec, keys in FORMER_DEFAULTS.items():
        if isinstance(out.get(sec), dict):
            out[sec] = {**keys, **out[sec]}
    # the time model's rates were an RTX 4090's whatever the kind: a run priced as a kind with none planned with those
    t, sp = out.get("train"), out.get("spend")
    if isinstance(t, dict) and isinstance(sp, dict) and sp.get("train_device", DEFAULT_KIND) not in CARD_RATES:
        out["train"] = {**t, "tflops": t.get("tflops") or tflops_for(str(t.get("precision", "fp32"))),
                        "pcie_gbs": t.get("pcie_gbs") or PCIE_GBS}
    return out


def stored_config(stored: dict, where: str, store: str | None = None) -> RunConfig:
    """The settings a stored run was trained with: its ``config.json`` (``stored``, a dict as
    ``storage/runs.read_config`` returns it) through ``RunConfig``, each key it lacks whose default has since changed
    filled with the former one, the run record's own keys (mode, dataset, plan, ...) left aside; ``store``: the URL it
    is read from (a run can move between stores). Every command that reads a stored run takes its settings from here,
    so a default is its field's and never spelled again; a config that does not parse is damaged (RunStateError
    naming ``where``, the object)."""
    raw = {k: v for k, v in with_former_defaults(stored).items() if k in RunConfig.model_fields and k != "store"}
    try:
        return parse_config({**raw, **({"store": store} if store else {})})
    except BadInput as e:
        raise runs.RunStateError(f"run config {where} is damaged ({e}); restore the object or start a new run with "
                                 "another --run-id") from None


def read_settings(store, run_id: str) -> RunConfig:
    """:func:`stored_config` of run ``run_id`` of ``store`` (``storage/store.Store``): its config.json read and checked
    by ``storage/runs.read_config``."""
    return stored_config(runs.read_config(store, run_id), store.url_of(layout.config_key(run_id)), store.url)


def check_model(cfg: RunConfig, mcfg: ModelConfig) -> None:
    """The keys whose valid range depends on the model: the block cuts and the sequence length."""
    layer_bounds(mcfg.n_layer, cfg.bcd.blocks, cfg.bcd.boundaries)  # raises naming bcd.blocks/boundaries
    if cfg.bcd.vocab_blocks > mcfg.vocab_size:
        raise ConfigError(f"bcd.vocab_blocks: {cfg.bcd.vocab_blocks} row blocks of a {mcfg.vocab_size}-row vocabulary "
                          "matrix leave some empty; at most one per row")
    if cfg.data.seq_len > mcfg.n_ctx:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds the model's context n_ctx={mcfg.n_ctx}")


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        keys = config_keys(sections=True)
        same = [k for k in keys if k.rpartition(".")[2] == key.rpartition(".")[2] and "." in key]
        near = same[:1] or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)  # the same name in another section
        return f"{key}: unknown config key" + (f" (did you mean {near[0]}?)" if near else "")
    if e["type"] == "literal_error":  # a choice field: "bcd.order: unknown order 'x' (choose from cyclic, ...)"
        noun = e["loc"][-2] if e["loc"][-1] == "name" and len(e["loc"]) > 1 else e["loc"][-1]
        choices = ", ".join(re.findall(r"'([^']*)'", e["ctx"]["expected"]))
        return f"{key}: unknown {noun} {e['input']!r} (choose from {choices})"
    msg = _flat(e["msg"].removeprefix("Value error, "))
    return msg if not key or msg.startswith(f"{key}:") else f"{key}: {msg}"


def config_keys(sections: bool = False) -> list[str]:
    """Every key of the run config, dotted (``bcd.blocks``, ``seed``), in the config's order; ``sections``: the
    section names too."""
    out = []
    for sec, f in RunConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += [sec] if sections else []
            out += [f"{sec}.{name}" for name in f.annotation.model_fields]
        else:
            out.append(sec)
    return out


def parse_config(raw: dict) -> RunConfig:
    """Validate a nested dict; any problem becomes a ConfigError naming the key."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def _set_key(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    if not all(p.strip() for p in parts):
        raise ConfigError(f"--set {dotted!r}: not a key (section.field, e.g. bcd.blocks)")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently: a
    section pasted twice would drop the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise yaml.MarkedYAMLError(problem=f"key {key!r} appears twice in one mapping",
                                               problem_mark=key_node.start_mark)
                seen.add(key)
            except TypeError:  # an unhashable key (a list): the safe loader's own check words it
                break
        return super().construct_mapping(node, deep)


def parse_text(text: str | bytes, where: str):
    """The one place config text is parsed, whatever it holds: YAML (safe loader, no key twice) from a ``-c`` file's
    bytes or a ``--set`` value. Anything that is not UTF-8 YAML (another encoding, control characters, bad syntax,
    a date that does not exist, nesting deeper than the parser's stack) is a ConfigError naming ``where`` (the file,
    or the ``--set`` item) and, when YAML says, the line and column."""
    if isinstance(text, bytes):
        for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                          (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
            if text.startswith(bom):  # e.g. PowerShell's `>` writes UTF-16
                raise ConfigError(f"{where} is {name} text (it starts with a {name} byte order mark); save it as "
                                  "UTF-8")
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save "
                              "it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML{at}: {_flat(e.problem or e.context or e)}") from None
    except (yaml.YAMLError, ValueError, TypeError) as e:  # ValueError: a date such as 2024-02-30
        raise ConfigError(f"{where} is not valid YAML: {_flat(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where} is not valid YAML: nested too deeply") from None


def _flat(msg) -> str:
    return " ".join(str(msg).split())


MAX_CONFIG_BYTES = 1 << 20  # a run config is a few kB; anything near this is not one (a corpus given as -c)


def _read_config_file(file: str) -> dict:
    if not os.path.isfile(file):
        what = "is not a regular file" if os.path.exists(file) else "does not exist"
        raise ConfigError(f"config file {file!r} {what}")
    if (size := os.path.getsize(file)) > MAX_CONFIG_BYTES:  # refused before it is read
        raise ConfigError(f"config file {file!r} is {size} bytes: a run config is at most {MAX_CONFIG_BYTES} bytes "
                          "(is it the right file?)")
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"config file {file!r} cannot be read ({e.strerror or e})") from None
    loaded = parse_text(data, f"config file {file!r}")
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {file!r} must hold a mapping of sections")
    return loaded


def identity_keys() -> tuple[str, ...]:
    """The config keys a resumed run must match, in declaration order: each field marked ``SAME``, a section marked
    as a whole by its name (``model``, ``data``). Every field carries a mark (tests/test_config.py)."""
    keys = []
    for name, f in RunConfig.model_fields.items():
        mark = field_resume(f)
        if mark is SAME:
            keys.append(name)
        elif mark is None:  # a section whose fields say
            keys += [f"{name}.{k}" for k, g in f.annotation.model_fields.items() if field_resume(g) is SAME]
    return tuple(keys)


def load_config(file: str | None = None, sets: list[str] | None = None, base: dict | None = None) -> RunConfig:
    """YAML file (optional), then ``KEY=VALUE`` overrides (values parsed as YAML scalars/lists), both through
    :func:`parse_text`, over ``base`` (a nested dict: a stored run's settings, flows/like.py); every problem is one
    ConfigError line."""
    return parse_config(config_tree(file, sets, base))


def config_tree(file: str | None = None, sets: list[str] | None = None, base: dict | None = None) -> dict:
    """The nested dict :func:`load_config` validates: ``base`` (copied), the file's keys, the overrides, unchecked
    but for their syntax (flows/like.py reads the store a stored run is in from it before the settings exist)."""
    raw: dict = copy.deepcopy(base or {})
    if file:
        for k, v in _flatten(_read_config_file(file)).items():
            _set_key(raw, k, v)
    for item in sets or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        _set_key(raw, key.strip(), parse_text(value, f"--set {item!r}: the value") if value != "" else None)
    return raw


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in RunConfig.model_fields and prefix == "":
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
