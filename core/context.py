"""The run context: what every task of a run needs, built once per process (docs/CONVENTIONS.md 12).

    ctx = RunContext.of(cfg, run_id, dataset_id)    # the same object for every later call in this process
    ctx.store, ctx.dataset, ctx.model_cfg, ctx.plan, ctx.device
    model = ctx.load_part(ctx.manifest(v), layers=(lo, ctx.model_cfg.n_layer), embed=False, head=True)

Tasks take plain, serializable inputs (the run config and ids: what Prefect records and Dask ships) and
look their context up here, so no task rebuilds the store, dataset, plan or device. Each part is made on
first use: a parent flow that only needs the plan never opens the token arrays or a device. A context
pickles as its three inputs and is looked up again on arrival.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import replace
from functools import cached_property
from typing import Collection, Iterator

import psutil
import torch
import zarr

from bcdflow.core import hf_import
from bcdflow.core.config import RunConfig
from bcdflow.errors import BadInput
from bcdflow.models import Plan, build_model, model_plan
from bcdflow.models.base import Decoder
from bcdflow.models.build import materialize, param_count, param_shapes
from bcdflow.models.model_config import ModelConfig, get_config
from bcdflow.models.holding import Holding, choose_holding, fit_holding, no_grad_holding
from bcdflow.models.memory import (CONTEXT_BYTES, GB, Budget, NoGradPass, device_budget, host_phases, no_grad_memory,
                                   reading_bytes, stage_bytes)
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.stream import LayerStream, host_buffer
from bcdflow.storage import checkpoints, layout
from bcdflow.storage.block_cache import BlockCache
from bcdflow.storage.corpus import builtin_corpus_files, check_text_files, resolve_files
from bcdflow.storage.store import Store
from bcdflow.storage.tokens import TokenDataset

_CACHE: dict[tuple[str, str, str], "RunContext"] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 4


def model_config(cfg: RunConfig, vocab_size: int | None = None) -> ModelConfig:
    """The run's model config: a registry size with the ``model`` overrides (vocabulary from the tokenizer when
    known), or with ``model.from_hf`` the checkpoint's (config.json; vocabulary = its embedding rows, whatever the
    tokenizer's size), checked against the run config."""
    if cfg.model.from_hf:
        return hf_import.checkpoint_model(cfg)
    return get_config(cfg.model.name, **cfg.model.overrides(), vocab_size=vocab_size or cfg.data.vocab_size)


def block_plan(cfg: RunConfig, mcfg: ModelConfig) -> Plan:
    """The block plan of the run's ``bcd`` section over model ``mcfg``."""
    return model_plan(mcfg, cfg.bcd.blocks, cfg.bcd.boundaries, cfg.bcd.split, cfg.bcd.freeze, cfg.bcd.vocab_blocks)


def open_store(cfg: RunConfig) -> Store:
    """The run's store (``store`` with the ``s3`` options), with Zarr's requests in flight set from
    ``bcd.store_concurrency`` and this box's copies of its block files where ``bcd.block_cache`` is set."""
    zarr.config.set({"async.concurrency": cfg.bcd.store_concurrency})
    store = Store(cfg.store, cfg.storage_options())
    if cfg.bcd.block_cache and not store.is_local:  # a local store is the box's disk already
        store.block_cache = BlockCache(cfg.bcd.block_cache, cfg.bcd.block_cache_gb * 1e9)
    return store


def open_act_store(cfg: RunConfig) -> Store:
    """Where a visit's activations live: ``bcd.act_store`` (a local disk, a bucket beside the GPUs), else the run's
    store."""
    if not cfg.bcd.act_store:
        return open_store(cfg)
    zarr.config.set({"async.concurrency": cfg.bcd.store_concurrency})
    return Store(cfg.bcd.act_store, cfg.act_storage_options())


def memory_budget(cfg: RunConfig, device: torch.device) -> Budget | None:
    """What a visit may hold on ``device`` (models/memory.device_budget: the memory free once the CUDA context exists,
    less a reserve): a card of ``train.memory_gb``, else the CUDA device as measured, else (the CPU) None."""
    gpus = cfg.train.world  # several processes reserve NCCL's buffers
    if cfg.train.memory_gb is not None:
        return device_budget(cfg.train.memory_gb * GB, gpus=gpus)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)  # creates the context first: what is free after it
        # what this process's caching allocator holds (cached blocks, live tensors) is the visit's to use, not
        # someone else's: mem_get_info counts it as used
        return device_budget(total, free + torch.cuda.memory_reserved(device), gpus=gpus)
    return None


def cap_fraction(memory_gb: float, total: int) -> float:
    """The share of a ``total``-byte GPU its caching allocator may use to stand for a ``memory_gb`` card: that card
    less the CUDA context (what its allocator would get), so a plan made for 24 GB is held to 24 GB on an 80 GB GPU;
    a card larger than the GPU is bad input (its plan would be proven by nothing)."""
    allowed = memory_gb * GB - CONTEXT_BYTES
    if allowed > total:
        raise BadInput(f"train.memory_gb: {memory_gb:g} GB asked for, but this GPU has {total / GB:.1f} GB (plan for "
                       "a card no larger than the one that trains, or leave train.memory_gb unset)")
    return allowed / total


def cap_allocator(cfg: RunConfig, device: torch.device) -> None:
    """``train.memory_gb`` on CUDA: cap this process's caching allocator at that card (:func:`cap_fraction`), so an
    allocation past it fails as it would on the card planned for instead of borrowing the bigger GPU's memory. The cap
    is the process's, so it is set for every visit (the whole GPU without the key: tasks/engine.run_visit, every
    process of a distributed visit on its own device): a worker that served a capped run does not keep the cap for
    the next, and one whose context outlived a visit gets it again. The allocator's cache is emptied first, so the
    visit starts under the cap with nothing an earlier visit cached counted against it."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        frac = 1.0 if cfg.train.memory_gb is None else cap_fraction(cfg.train.memory_gb, total)
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(frac, device)


def usable(cfg: RunConfig, device: torch.device) -> float | None:
    """Bytes a visit may use on ``device`` (None: no limit)."""
    b = memory_budget(cfg, device)
    return None if b is None else b.usable


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when present, else the CPU; a device this machine lacks is bad input.

    A CUDA device is always resolved with its index (``cuda`` and ``auto`` -> ``cuda:N``, N the current device), the
    name its tensors report: ``torch.device("cuda") != torch.device("cuda", 0)``, so an unindexed name breaks every
    comparison with a tensor's device. The code compares device types, never devices; ``cpu:0`` (an indexed name
    whose tensors report ``cpu``) is accepted so the CPU tests run that mismatch through the same code paths."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise BadInput(f"train.device: unknown device {name!r} (choose from auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise BadInput(f"train.device: {name!r} asked for, but this machine has no CUDA device "
                           "(use train.device=cpu or auto)")
        if dev.index is not None and dev.index >= n:
            raise BadInput(f"train.device: {name!r} asked for, but this machine has {n} CUDA device(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise BadInput(f"train.device: unsupported device type {dev.type!r} (choose from auto, cpu, cuda, cuda:N)")
    return dev


def data_files(cfg: RunConfig) -> list[str] | None:
    """The local files a run reads: ``data.files``, or the built-in corpus when no source is set."""
    if cfg.data.files:
        return resolve_files(cfg.data.files)
    if cfg.data.path:
        return None
    return builtin_corpus_files(cfg.data.builtin_bytes)


_checked: list[str] = []  # the config the CLI checked for the flow it starts next in this process (one at most)
_checked_lock = threading.Lock()


def preflight(cfg: RunConfig, *, in_flow: bool = False, store: Store | None = None) -> None:
    """The checks that need the machine, the file system or the store, before anything is written (nothing written
    on failure, docs/DESIGN.md §8): the device and the plan's fit (unless visits go to a pool: they train on the
    workers' devices), the tokenizer and Hugging Face checkpoint files, the model's size, the corpus files, the store
    (``store``: the one the caller opened for ``cfg``, else opened here).

    Once per run start: the CLI checks before its flow starts (``in_flow=False``, which marks the config checked),
    and the flow's own call (``in_flow=True``) takes the mark and checks nothing more when it names the same config;
    a flow with no caller before it (a deployment's run, a test) or another config checks here (the CLI checks a
    baseline's one-block config, the one its flow runs). The mark is taken by the next flow whatever its config, so a later start
    checks again (its files or store may have changed meanwhile)."""
    key = cfg.model_dump_json()
    if in_flow:
        with _checked_lock:
            mine = key in _checked
            _checked.clear()
        if mine:
            return
    # a peer method (models/peers.py): its package, one block (the baseline), one process; a lighter state
    # (models/light.py): its package, one process, a device and precision it runs with
    OPTIMIZERS[cfg.optim.name].check(cfg.optim.name, cfg.n_blocks, cfg.train.world,
                                     resolve_device(cfg.train.device).type, cfg.train.precision, cfg.train.parallel)
    if OPTIMIZERS[cfg.optim.name].peer:  # its settings against the model: LISA's layers, a rank (models/peers.py)
        from bcdflow.models import peers

        mcfg = model_config(cfg)
        peers.check_model(cfg.optim.name, cfg.optim.rank, cfg.optim.lisa_layers, mcfg.n_layer,
                          param_shapes(mcfg.replace(n_layer=1)))
    if not cfg.fleet.visit_pool:
        check_gpus(cfg)  # the device, and train.gpus against this machine
        check_model_size(cfg)  # before the plan's fit: a model no machine builds says so, not its host peak
        check_plan_fits(cfg)  # the visits fit the device; the host holds what they stream and load
    if cfg.data.tokenizer and not os.path.isfile(cfg.data.tokenizer):
        raise BadInput(f"data.tokenizer: no such file {cfg.data.tokenizer!r}")
    if cfg.model.from_hf:  # every shard, tensor and the tokenizer
        hf_import.check_checkpoint(cfg)
    if cfg.fleet.visit_pool:
        check_model_size(cfg)  # version 0 is built by the run's process, whoever trains the visits
    if cfg.data.files:
        files = data_files(cfg)
        if sum(os.path.getsize(f) for f in files) == 0:
            raise BadInput(f"data.files: corpus is empty (0 bytes in {len(files)} files)")
        check_text_files(files)
    (store if store is not None else open_store(cfg)).probe()  # one clear line (no retries) when it cannot be used
    if cfg.bcd.act_store:  # the activations' store too, before anything is written, one line naming its key
        try:
            open_act_store(cfg).probe()
        except BadInput as e:
            msg = str(e)
            raise BadInput("bcd.act_store" + msg[5:] if msg.startswith("store") else f"bcd.act_store: {msg}") from None
    if not in_flow:
        with _checked_lock:
            _checked[:] = [key]


def check_gpus(cfg: RunConfig) -> None:
    """``train.gpus`` against this machine: on CUDA no more processes than GPUs (on the CPU, gloo processes)."""
    dev = resolve_device(cfg.train.device)
    if dev.type == "cuda" and cfg.train.gpus > torch.cuda.device_count():
        raise BadInput(f"train.gpus: {cfg.train.gpus} asked for, but this machine has {torch.cuda.device_count()} "
                       "CUDA device(s)")
    if dev.type == "cuda" and cfg.train.memory_gb is not None:  # a card larger than the GPU: refused here
        cap_fraction(cfg.train.memory_gb, torch.cuda.get_device_properties(dev).total_memory)


def check_model_size(cfg: RunConfig) -> None:
    """Refuse, before anything is written, a model this machine cannot even build: version 0 is made here one block
    at a time in fp32, and the largest block holds at least 1/blocks of the parameters."""
    mcfg = model_config(cfg)
    n = param_count(mcfg)
    blocks = len(cfg.bcd.boundaries) + 1 if cfg.bcd.boundaries else cfg.bcd.blocks
    need, have = 4 * n / min(blocks, mcfg.n_layer), psutil.virtual_memory().total
    if need > have:
        key = "model.from_hf" if cfg.model.from_hf else "model"
        raise BadInput(f"{key}: {n / 1e9:,.1f}B parameters (n_layer={mcfg.n_layer}, d_model={mcfg.d_model}): one of "
                       f"{blocks} blocks alone needs {need / 1e9:,.0f} GB to build, and this machine has "
                       f"{have / 1e9:,.0f} GB of memory")


def check_plan_fits(cfg: RunConfig) -> None:
    """Refuse, before anything is written, a run whose visits cannot fit the device even held the leanest way it
    allows (recompute and every frozen layer streamed, as the settings permit), naming the figures; and a host whose
    available memory cannot hold a visit's host peak: its streamed layers' flat buffers (pinned as allocated) and, on
    CUDA, its page-locked batch slots (``stage_bytes``), held all visit, with the largest of its phases beside them
    (``models/memory.host_phases``: loading, a mid-visit checkpoint written or resumed, the commit); pre-inference's
    the same with its output buffers. The device fit is not checked on the
    CPU without ``train.memory_gb``."""
    if cfg.train.world > 1:
        return  # several processes: data parallel or sharded (tasks/train_dist.choose_parallel)
    budget = memory_budget(cfg, resolve_device(cfg.train.device))
    mcfg = model_config(cfg)
    plan = block_plan(cfg, mcfg)
    shape, seq = cfg.step_shape(), cfg.data.seq_len
    holds = [fit_holding(mcfg, plan, b, shape, None if budget is None else budget.usable) for b in range(len(plan.visits))]
    if budget is not None:
        bad = [(b, h) for b, h in enumerate(holds) if not h.fits]
        if bad:
            b, h = max(bad, key=lambda x: x[1].estimate.peak)
            raise BadInput(f"train.memory_gb: visit of block {b} needs {h.estimate.peak / GB:.1f} GB held the leanest "
                           f"way the settings allow ({h.words()}), and the device has {budget.line()}; use more "
                           "blocks (bcdflow plan-memory recommends a count), train.offload=auto, "
                           "bcd.recompute=auto, a smaller train.batch_size or train.gpus=N")
    cuda = resolve_device(cfg.train.device).type == "cuda"
    # a visit's host peak: its streamed layers' page-locked buffers and on CUDA its two page-locked batch slots,
    # held for the whole visit, and the largest of what it takes in phases beside them: the largest block file it
    # reads while loading (one at a time), a mid-visit checkpoint written or read back, its commit
    need, what = 0, ""
    words = {"load": "to read its largest block file", "checkpoint": "to write or resume a mid-visit checkpoint",
             "commit": "to commit its block file"}
    for b, h in enumerate(holds):
        phases = host_phases(mcfg, plan, b, shape, h.estimate)
        phase = max(phases, key=phases.get)
        parts = (h.estimate.host_bytes, phases[phase], stage_bytes(mcfg, plan, b, shape) if cuda else 0)
        if sum(parts) > need:
            need = sum(parts)
            what = (f"block {b}'s visit: {parts[0] / 1e9:.1f} GB of streamed layers (pinned, as allocated), "
                    f"{parts[1] / 1e9:.1f} GB {words[phase]}, {parts[2] / 1e9:.2f} GB of batch slots")
    if cfg.bcd.preinfer:  # pre-inference: its prefix's streamed layers and the shards' page-locked output buffers
        passes = cfg.step_shape(no_grad=True)
        workers = cfg.bcd.preinfer_workers or (2 if cuda else 1)
        staging = workers * cfg.bcd.shard_rows * seq * mcfg.d_model * 4
        for b in range(1, len(plan.visits)):
            lo = plan.visits[b].layers[0]
            part = NoGradPass((0, lo), True, False, cfg.bcd.shard_rows, cfg.bcd.preinfer_batch_size)
            streamed, rows = no_grad_holding(mcfg, part, passes, None if budget is None else budget.usable)
            prefix = no_grad_memory(mcfg, part, replace(passes, batch=rows, streamed=streamed)).host_bytes \
                if streamed else 0
            loading = reading_bytes(mcfg, plan, range(min(b, len(plan.blocks))))  # blocks [0, b): a file at a time
            if prefix + staging + loading > need:
                need = prefix + staging + loading
                what = (f"block {b}'s pre-inference: {prefix / 1e9:.1f} GB of streamed prefix layers, "
                        f"{staging / 1e9:.1f} GB of output buffers, {loading / 1e9:.1f} GB of the largest block file")
    have = psutil.virtual_memory().available
    if need > have:
        raise BadInput(f"train.offload: the streamed frozen layers of a visit (or its pre-inference prefix and "
                       f"output buffers) and what it loads take {need / 1e9:.1f} GB of host memory at their peak "
                       f"({what}) and this machine has {have / 1e9:.1f} GB available (use more blocks, "
                       "train.precision=bf16, a smaller bcd.shard_rows, or a machine with more memory)")


class RunContext:
    """One run's store, token dataset, model config, block plan and device, each built on first use."""

    def __init__(self, cfg: RunConfig, run_id: str, dataset_id: str):
        self.cfg, self.run_id, self.dataset_id = cfg, run_id, dataset_id
        self._lock = threading.Lock()
        self._prefix: tuple[tuple, Decoder] | None = None
        self._holdings: dict[int, Holding] = {}
        self._preinfer: dict[int, tuple[bool, str | None]] = {}
        self._staging: list[torch.Tensor] = []
        self._budget: tuple[float | None] | None = None
        self.prefix_lock = threading.Lock()
        """Held by a pre-inference shard while it runs the kept prefix: shard tasks in threads share one prefix,
        whose stream (and device memory sized for one batch) is not for two at once."""

    @classmethod
    def of(cls, cfg: RunConfig, run_id: str, dataset_id: str) -> "RunContext":
        """The process's context for this run (made on the first call, then shared)."""
        key = (cfg.model_dump_json(), run_id, dataset_id)
        with _CACHE_LOCK:
            ctx = _CACHE.get(key)
            if ctx is None:
                if len(_CACHE) >= _CACHE_SIZE:
                    _CACHE.pop(next(iter(_CACHE)))
                ctx = _CACHE[key] = cls(cfg, run_id, dataset_id)
            return ctx

    def __reduce__(self):
        return _context_of, (self.cfg, self.run_id, self.dataset_id)

    def __repr__(self) -> str:
        return f"RunContext({self.run_id!r}, dataset={self.dataset_id!r}, store={self.cfg.store!r})"

    @cached_property
    def store(self) -> Store:
        return open_store(self.cfg)

    @cached_property
    def act_store(self) -> Store:
        """Where this run's activations are written and read (:func:`open_act_store`)."""
        return open_act_store(self.cfg) if self.cfg.bcd.act_store else self.store

    @cached_property
    def dataset(self) -> TokenDataset:
        return TokenDataset.open(self.store, self.dataset_id)

    @cached_property
    def model_cfg(self) -> ModelConfig:
        return model_config(self.cfg, self.dataset.vocab_size)

    @cached_property
    def plan(self) -> Plan:
        return block_plan(self.cfg, self.model_cfg)

    @cached_property
    def device(self) -> torch.device:
        """The run's device, indexed (``cuda:N``), its allocator capped at ``train.memory_gb`` (:func:`cap_allocator`)."""
        dev = resolve_device(self.cfg.train.device)
        cap_allocator(self.cfg, dev)
        return dev

    # -- weights ------------------------------------------------------------------------------------
    def manifest(self, version: int) -> dict:
        return checkpoints.read_manifest(self.store, self.run_id, version)

    def load_part(self, manifest: dict, layers: tuple[int, int], embed: bool, head: bool,
                  trainable: Collection[str] | None = None, stream: Collection[int] = (),
                  grad_from: int | None = None) -> Decoder:
        """A part of the model with the weights of ``manifest``: only the tensors that part holds are read.

        A visit to block b with pre-inference holds layers of blocks >= b and the head (invariant I6); the
        tied GPT-2 head also needs ``wte.weight``, which block 0 owns, so that one tensor comes along frozen.

        ``trainable``: the names that will train (fp32 master weights); with ``train.precision=bf16`` every other
        weight matrix lives on the device in bf16 (I6; ``()`` = all frozen: the pre-inference prefix, evaluation).
        None keeps every weight fp32 (a probe that needs every gradient). Tensors are read to the host and copied
        into the part's storage one by one, so the device never holds a second copy of the weights.

        ``stream``: frozen layers whose weights stay in host memory and are copied through the device's slot buffers
        as they compute (``train.offload``; models/stream.py; ``grad_from``: the first layer a backward reaches);
        the part's ``stream`` attribute holds them. The other layers are resident.

        The part is built on the meta device and each layer's storage made where it lives (the device, or a streamed
        layer's flat host buffer); the stored tensors are read one block file at a time and copied straight there.
        So the host holds the streamed buffers and one block file at most (``host_load_bytes``, which the plan check
        counts), never the whole part nor every tensor it loads at once."""
        low = torch.bfloat16 if self.cfg.train.precision == "bf16" and trainable is not None else None
        # fp32 master weights for what trains, unless the optimizer keeps bf16 ones (optim.name=adamw8bit-bf16)
        fp32 = trainable or () if OPTIMIZERS[self.cfg.optim.name].master == 4 else ()
        model = build_model(self.model_cfg, layers=layers, embed=embed, head=head, device="meta", init=False,
                            frozen_dtype=low, trainable=fp32)
        model.stream = None
        if stream:
            for i in stream:
                model.h[str(i)].requires_grad_(False)
            # flat host buffers from the meta shapes; the layers' parameters point at device placeholders
            model.stream = LayerStream(model, stream, self.device, self.cfg.train.stream_window, grad_from=grad_from)
        materialize(model, self.device)  # what is not streamed: storage on the device, never on the host first
        names = [n for n, _ in model.named_parameters()]
        params = dict(model.named_parameters())
        owners = sorted({self.plan.owner(n) for n in names})
        loaded: set[str] = set()
        with torch.no_grad():  # one block file on the host at a time, each tensor copied where it lives
            for name, t in checkpoints.iter_from_manifest(self.store, self.run_id, manifest, owners, names=names):
                dst = model.stream.host_tensor(name) if model.stream is not None else None
                (params[name] if dst is None else dst).copy_(t)
                loaded.add(name)
                del t  # a view of its block file's bytes: not kept while the next file is read
        if missing := [n for n in names if n not in loaded]:
            raise checkpoints.CheckpointError(f"version {manifest.get('version')} of run {self.run_id!r} lacks "
                                              f"{len(missing)} tensor(s) of the part it loads: {missing[:3]}")
        return model

    def budget(self) -> float | None:
        """Bytes a visit may hold on this process's device (``usable``); None on the CPU without a set budget.
        Measured once per process and run (the memory free to it then), so every visit, pass and resume in this
        process plans against the same figure whatever its allocator has cached since."""
        if self._budget is None:
            self._budget = (usable(self.cfg, self.device),)
        return self._budget[0]

    def holding(self, block: int) -> Holding:
        """How block ``block``'s visit holds its model on this device (models/holding.choose_holding with the run's
        ``bcd.recompute``, ``train.offload`` and time-model keys: recompute, streamed layers), chosen once."""
        if block not in self._holdings:
            self._holdings[block] = choose_holding(self.model_cfg, self.plan, block,
                                                   self.cfg.step_shape(preinfer=self.preinfer_on(block)),
                                                   self.budget())
        return self._holdings[block]

    def no_grad_pass(self, part: NoGradPass, extra: int = 0) -> tuple[tuple[int, ...], int]:
        """(streamed layers, rows per forward) of a no-grad pass over a model part on this device: pre-inference's
        prefix, an evaluation model (models/holding.no_grad_holding; ``extra``: bytes held beside it)."""
        budget = self.budget()
        return no_grad_holding(self.model_cfg, part, self.cfg.step_shape(no_grad=True),
                               None if budget is None else budget - extra)

    def trainable(self, block: int) -> set[str]:
        """The parameters block ``block``'s visit trains (``Block.trainable``: less what ``bcd.freeze`` keeps)."""
        return self.plan.visits[block].trainable(self.cfg.bcd.freeze, self.model_cfg.tied)

    def preinfer_on(self, block: int) -> bool:
        """Whether block ``block``'s visit pre-infers: ``bcd.preinfer``, or with ``auto`` the run planner's choice
        (:meth:`preinfer_why`)."""
        return self._preinfer_choice(block)[0]

    def preinfer_why(self, block: int) -> str | None:
        """Why ``bcd.preinfer=auto`` chose as it did for block ``block``'s visit, in words (None: not ``auto``)."""
        return self._preinfer_choice(block)[1]

    def _preinfer_choice(self, block: int) -> tuple[bool, str | None]:
        """``bcd.preinfer=auto``: core/forecast.choose_preinfer on the planner's figures, the run's token dataset and
        rates (``train.store_gbs``, the GPUs pre-inference uses, the time model's TFLOP/s) and ``train.memory_gb`` (not
        the measured device, so every process of a visit decides alike); chosen once a block."""
        setting = self.cfg.bcd.preinfer
        if setting != "auto":
            return bool(setting), None
        if block not in self._preinfer:
            from bcdflow.core import forecast  # the planner's arithmetic: only for auto
            from bcdflow.core.figures import figures

            t = self.cfg.train
            budget = device_budget(t.memory_gb * GB, gpus=t.gpus).usable if t.memory_gb else None
            figs = figures(self.cfg, self.model_cfg, self.plan, budget)
            ds = forecast.Dataset(0, self.dataset.n_train, self.dataset.n_val)
            rates = forecast.default_rates(self.cfg)
            for b, bf in enumerate(figs.blocks):
                v = forecast.choose_preinfer(self.cfg, figs, bf, ds, rates)
                self._preinfer[b] = (v.preinfer, v.why)
        return self._preinfer[block]

    def from_acts(self, block: int) -> bool:
        """Whether block ``block``'s visit trains from the prefix's stored activations (``Block.reads_activations``)."""
        return self.plan.visits[block].reads_activations(self.preinfer_on(block))

    def frozen_layers(self, block: int) -> list[int]:
        """The frozen layers block ``block``'s visit holds (``Block.frozen_layers``)."""
        return self.plan.visits[block].frozen_layers(self.model_cfg.n_layer, self.preinfer_on(block))

    def frozen_prefix(self, version: int, block: int) -> Decoder:
        """Embeddings and layers before ``block`` of ``version``, in eval mode without grads, held as its no-grad
        pass allows (``preinfer_rows``); kept for the next shard of the same visit (pre-inference shard tasks run in
        threads and share it)."""
        key = (version, block)
        with self._lock:
            if self._prefix is None or self._prefix[0] != key:
                self.release_prefix(locked=True)  # free the previous visit's prefix before loading this one
                lo = self.plan.visits[block].layers[0]
                streamed, _ = self._prefix_pass(block)
                model = self.load_part(self.manifest(version), (0, lo), embed=True, head=False, trainable=(),
                                       stream=streamed)
                self._prefix = (key, model.eval().requires_grad_(False))
            return self._prefix[1]

    def _prefix_pass(self, block: int) -> tuple[tuple[int, ...], int]:
        lo = self.plan.visits[block].layers[0]
        return self.no_grad_pass(NoGradPass((0, lo), True, False, self.cfg.bcd.shard_rows,
                                            self.cfg.bcd.preinfer_batch_size))

    def preinfer_rows(self, block: int) -> int:
        """Rows per pre-inference forward of block ``block``'s prefix (``bcd.preinfer_batch_size``, else the most
        that fit the device, up to a shard)."""
        return self._prefix_pass(block)[1]

    @contextlib.contextmanager
    def staging(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
        """A host tensor of ``shape`` for device-to-host copies (page-locked exactly, on CUDA, so the copies are
        asynchronous), its buffer kept for the next shard of the visit (one per shard task in flight) and dropped
        with the prefix."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fit = [b for b in self._staging if b.numel() >= nbytes]
            buf = min(fit, key=lambda b: b.numel()) if fit else None
            if buf is not None:
                self._staging.remove(buf)
        if buf is None:
            buf = host_buffer(nbytes, pin=self.device.type == "cuda", device=self.device)
        try:
            yield buf[:nbytes].view(dtype).view(shape)
        finally:
            if self.device.type == "cuda":  # copies into it may still land (an exception mid-shard)
                torch.cuda.current_stream(self.device).synchronize()
            with self._lock:
                self._staging.append(buf)

    def release_prefix(self, locked: bool = False) -> None:
        """Forget the kept prefix (its device slots and host buffers freed at once): training the visit does not
        need it, and on the one-machine default (shards and training in one process) it would otherwise hold the
        prefix's weights through the whole visit."""
        with contextlib.nullcontext() if locked else self._lock:
            if self._prefix is not None and self._prefix[1].stream is not None:
                self._prefix[1].stream.close()
            self._prefix = None
            self._staging.clear()

    # -- store keys -----------------------------------------------------------------------------------
    def visit_key(self, cycle: int, block: int) -> str:
        return layout.visit_key(self.run_id, cycle, block)

    def acts_key(self, cycle: int, block: int) -> str:
        return layout.acts_key(self.run_id, cycle, block)


def _context_of(cfg: RunConfig, run_id: str, dataset_id: str) -> RunContext:
    """What a pickled context becomes on arrival: that process's context of the same run (a module-level function,
    so cloudpickle, which Dask uses, ships it by reference; the classmethod it calls would be pickled by value)."""
    return RunContext.of(cfg, run_id, dataset_id)
