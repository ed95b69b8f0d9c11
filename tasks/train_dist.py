"""A visit on several GPUs of this machine (``train.gpus=N``): the train task launches ``torchrun`` with one process
per GPU, each runs :func:`train_rank`, and rank 0 writes the checkpoints, the block file and the result.

    train.gpus=2 -> python -m torch.distributed.run --standalone --nproc-per-node 2 -m bcdflow.tasks.train_dist SPEC.json

The engines (models/parallel.py): ``ddp`` when a replica of the visit fits ``train.memory_gb`` (the planner says),
``fsdp`` (FSDP2) when it does not, or as ``train.parallel`` says. Each process reads its slice of every batch: the
global batch is the one-process batch, so the weights match one process to float rounding. NCCL on CUDA, gloo on
the CPU (the tests: 2 processes).

Preemption: a SIGTERM or SIGINT to the train task, or a SIGTERM to any process, makes every process stop after the
same step (``parallel.StopSync``), rank 0 checkpoints once (unsharded: resumable on any GPU count) and the task
then hands the signal on as one process would (``tasks.preemption.after_checkpoint``). The processes run in their
own session, so a terminal's Ctrl-C reaches the task, which forwards it; if the task dies, torchrun gets SIGTERM
(Linux PR_SET_PDEATHSIG) and its processes checkpoint and exit. A lease of the task's process that could expire
(``storage/lease.lost_lease``, docs/DESIGN.md §9) kills every process at once, with no checkpoint, and the task
raises LeaseLost.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from bcdflow.core import failpoints, preempt
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, check_gpus, memory_budget
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.models import build_model
from bcdflow.models import parallel as par
from bcdflow.models.errors import Diverged
from bcdflow.models.memory import visit_memory
from bcdflow.models.trainer import LoopState, make_optimizer, run_steps
from bcdflow.storage import activations, checkpoints, trainckpt
from bcdflow.storage.lease import lost_lease
from bcdflow.constants import IGNORE_INDEX
from bcdflow.tasks import preemption
from bcdflow.tasks.data import batch_ranges, visit_rows
from bcdflow.tasks.engine import (TrainResult, compile_layers, diverged_message, evaluate_model, optimizer_state,
                                  optimizer_tensors, prefetched, use_recompute, visit_val_batches, window_logger)
from bcdflow.tasks.progress import visit_progress
from bcdflow.tracking.tracker import TrackTarget

ERRORS = {"BadInput": BadInput, "DamagedArtifact": DamagedArtifact}


# -- the train task's side ------------------------------------------------------------------------------------

def _die_with_parent() -> None:  # in the child, before exec: SIGTERM to torchrun when the train task dies
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(ctx: RunContext, cycle: int, block: int, version: int, track: TrackTarget | None = None,
           global_step: int = 0, min_rate: float | None = None, moments: dict | None = None) -> TrainResult:
    """Train the visit with ``train.gpus`` processes and return rank 0's result (as ``train_block`` does)."""
    cfg, run_id, dataset_id = ctx.cfg, ctx.run_id, ctx.dataset_id
    n = cfg.train.gpus
    check_gpus(cfg)  # a worker that picked this visit up may have fewer GPUs than the one that planned it
    base = os.environ.get("BCDFLOW_DIST_DIR")
    work = tempfile.mkdtemp(prefix=f"visit-c{cycle}-b{block}-", dir=base) if base else tempfile.mkdtemp(
        prefix="bcdflow-visit-")
    spec = {"cfg": cfg.model_dump(mode="json"), "run_id": run_id, "cycle": cycle, "block": block, "version": version,
            "dataset_id": dataset_id, "work": work, "global_step": global_step, "min_rate": min_rate,
            "moments": moments,
            "track": None if track is None else {f.name: getattr(track, f.name) for f in dataclasses.fields(track)
                                                 if not f.name.startswith("_")}}
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "bcdflow.tasks.train_dist", os.path.join(work, "spec.json")]
    forwarded: set[int] = set()
    lost = None
    with preempt.training():  # the task's own SIGTERM/SIGINT: forwarded to every process as SIGTERM
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
        while proc.poll() is None:
            if (lost := lost_lease()) is not None:  # it could expire: every process stops now, no checkpoint (§9)
                for pid in [*_pids(work), -proc.pid]:  # the ranks, then torchrun's process group
                    _signal(pid, signal.SIGKILL)
                proc.wait()
                break
            if preempt.requested():
                for pid in _pids(work):
                    if pid not in forwarded:
                        forwarded.add(pid)
                        _signal(pid)
            time.sleep(0.1)
    try:
        if lost is not None:
            raise lost
        return _result(work, proc.returncode, run_id, cfg.fleet.reschedule_delay_s)
    finally:
        if not os.environ.get("BCDFLOW_DIST_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


def _pids(work: str) -> list[int]:
    out = []
    for name in os.listdir(work):
        if name.startswith("pid-"):
            try:
                out.append(int(open(os.path.join(work, name)).read()))
            except (OSError, ValueError):
                pass
    return out


def _signal(pid: int, sig: int = signal.SIGTERM) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _result(work: str, returncode: int, run_id: str, reschedule_delay_s: float) -> TrainResult:
    path = os.path.join(work, "result.json")
    res = json.load(open(path)) if os.path.exists(path) else None
    if res is None or res.get("status") == "error":
        errs = [json.load(open(os.path.join(work, f))) for f in sorted(os.listdir(work)) if f.startswith("error-")]
        err = res if res is not None else (errs[0] if errs else None)
        if err is None:
            raise RuntimeError(f"torchrun exited {returncode} without a result (see its output above)")
        raise ERRORS.get(err["type"], RuntimeError)(err["message"])
    if res["status"] == "diverged":
        raise BadInput(res["message"])
    result = TrainResult(**res["result"])
    if result.stopped_by == "interrupted":  # rank 0 wrote the checkpoint: as one process does from here
        preemption.after_checkpoint(reschedule_delay_s)
    return result


# -- one process of the visit -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    spec = json.load(open((argv or sys.argv[1:])[0]))
    work = spec["work"]
    with open(os.path.join(work, f"pid-{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    with preempt.training():  # from the start: a SIGTERM while loading is a checkpoint after the first step
        cfg = RunConfig.model_validate(spec["cfg"])
        cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        device = par.local_device() if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        rank = dist.get_rank()
        try:
            out = {"status": "done", "result": train_rank(cfg, spec, device).model_dump()}
        except Diverged as e:
            out = {"status": "diverged", "message": diverged_message(cfg, spec["run_id"], spec["cycle"],
                                                                     spec["block"], e)}
        except BaseException as e:  # noqa: BLE001 - reported to the task, which raises it there
            kind = next((k for k, cls in ERRORS.items() if isinstance(e, cls)), type(e).__name__)
            err = {"status": "error", "type": kind, "message": str(e).splitlines()[0] if str(e) else kind,
                   "traceback": traceback.format_exc()}
            with open(os.path.join(work, f"error-{rank}.json"), "w") as f:
                json.dump(err, f)
            traceback.print_exc()
            os._exit(1)  # do not wait in collectives the others will never reach
        if rank == 0:
            with open(os.path.join(work, "result.json.tmp"), "w") as f:
                json.dump(out, f)
            os.replace(os.path.join(work, "result.json.tmp"), os.path.join(work, "result.json"))
        dist.destroy_process_group()
    return 0


def choose_parallel(cfg: RunConfig, ctx: RunContext, block: int, world: int, recompute: bool) -> str:
    """``train.parallel``, or (auto) ddp when the planner says one replica of the visit, with its 1/N of the batch,
    fits ``train.memory_gb``; else fsdp."""
    if cfg.train.parallel != "auto":
        return cfg.train.parallel
    budget = memory_budget(cfg, ctx.device)
    if budget is None:
        return "ddp"
    est = visit_memory(ctx.model_cfg, ctx.plan, block, cfg.train.batch_size, ctx.dataset.seq_len,
                       cfg.train.precision, cfg.optim.name, recompute, cfg.bcd.preinfer,
                       chunk_rows=cfg.train.loss_chunk_rows, weight_decay=cfg.optim.weight_decay, gpus=world,
                       parallel="ddp")
    return "ddp" if est.peak <= budget else "fsdp"


def _load(ctx: RunContext, version: int, layers, embed: bool, active: set[str], low: bool, mode: str, lo: int,
          hi: int, from_acts: bool, recompute: bool, precision: str, device):
    """The visit's model wrapped for ``mode``: DDP loads it whole on this process's device; FSDP builds it on the
    meta device, shards it, and copies each block's tensors into this process's shards one block at a time."""
    if mode == "ddp":
        model = ctx.load_part(ctx.manifest(version), layers, embed=embed, head=True, trainable=active)
    else:
        model = build_model(ctx.model_cfg, layers=layers, embed=embed, head=True, device="meta", init=False,
                            frozen_dtype=torch.bfloat16 if low else None, trainable=active)
    for name, p in model.named_parameters():
        p.requires_grad_(name in active)
    model.loss_chunk_rows = ctx.cfg.train.loss_chunk_rows
    if ctx.cfg.train.compile:  # before DDP/FSDP wrap the layers (torchtitan's order)
        compile_layers(model)
    step = par.VisitStep(model, lo, hi, from_acts, recompute, precision)
    step.recompute_active = ctx.cfg.bcd.recompute == "all"
    if mode == "ddp":
        return model, step, par.wrap_ddp(step, device)
    par.shard_fsdp(step, device)
    step.to_empty(device=device)
    model._init_buffers()
    manifest = ctx.manifest(version)
    names = [n for n, _ in model.named_parameters()]
    for b in sorted({ctx.plan.owner(n) for n in names}):  # host memory: one block's tensors at a time
        par.load_sharded(model, checkpoints.load_from_manifest(ctx.store, ctx.run_id, manifest, [b], names=names,
                                                               device="cpu"))
    return model, step, step


def train_rank(cfg: RunConfig, spec: dict, device: torch.device) -> TrainResult:
    """One process of a distributed visit: ``tasks.train.train_block``'s loop with a wrapped model, a slice of each
    batch, the global loss, a synchronized stop flag and clock, and unsharded checkpoints written by rank 0."""
    run_id, cycle, block, version = spec["run_id"], spec["cycle"], spec["block"], spec["version"]
    rank, world = par.world()
    ctx = RunContext.of(cfg, run_id, spec["dataset_id"])
    ctx.device = device  # this process's GPU (the context is this process's own)
    ds, n_layer = ctx.dataset, ctx.model_cfg.n_layer
    lo, hi = ctx.plan[block].layers
    from_acts = ctx.from_acts(block)
    active = ctx.trainable(block)
    recompute = use_recompute(cfg, ctx, block, gpus=world, parallel="ddp")
    mode = choose_parallel(cfg, ctx, block, world, recompute)
    val = visit_val_batches(cfg, ctx, version, block) if cfg.bcd.eval_every else []
    ctx.release_prefix()
    low = cfg.train.precision == "bf16"
    model, step, mod = _load(ctx, version, (lo if from_acts else 0, n_layer), not from_acts, active, low, mode, lo,
                             hi, from_acts, recompute, cfg.train.precision, device)
    named = [(n, p) for n, p in model.named_parameters() if n in active]
    params = [p for _, p in named]
    step.train()

    rows = visit_rows(cfg, ds.n_train, cycle, block)
    if from_acts:
        reader = activations.ActivationReader(ctx.store, ctx.acts_key(cycle, block), pin=device.type == "cuda")

        def read(a: int, b: int):
            return reader.read(a, b)
    else:
        def read(a: int, b: int):
            return ds.train_pairs(rows[a:b])

    def fetch(a: int, b: int):
        la, lb = par.slice_rows(a, b, rank, world)
        x, y = read(la, lb) if lb > la else par.empty_slice_batch(*read(a, a + 1))
        return x, y, ds.trained_tokens(rows[a:b])  # this process's slice; the whole batch's trained tokens

    def loss_fn(batch):
        x, y, _ = batch
        return par.global_mean(mod(x, y), (y != IGNORE_INDEX).sum())

    track = TrackTarget(**spec["track"]) if spec.get("track") and rank == 0 else None
    val_points: list[tuple[int, float]] = []
    on_window = window_logger(track, cfg.bcd.eval_every, step,  # every process evaluates every batch: collectives
                              lambda: evaluate_model(functools.partial(mod, reduction="mean"), val, cfg, device),
                              val_points)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt_spec = cfg.optim_spec(block)
    opt = make_optimizer(params, opt_spec)
    vkey = ctx.visit_key(cycle, block)
    state = None
    ck = trainckpt.load(ctx.store, vkey, "cpu")  # unsharded: written by one process or by rank 0 of any count
    if ck is not None and ck[0]["meta"].get("base_version") == version:
        pointer, saved, opt_state = ck
        par.load_sharded(model, {n: saved[n] for n in active})
        par.load_optim_state(opt, opt_state)
        for g in opt.param_groups:
            g["lr"] = opt_spec.base_lr
        state = LoopState.from_dict(pointer["meta"]["loop"])
    elif spec.get("moments"):  # bcd.moments=keep: the block's last visit's optimizer state, cut to this process
        saved = checkpoints.load_file(ctx.store, run_id, spec["moments"], f"the optimizer moments of block {block}")
        par.load_optim_state(opt, optimizer_state(saved, [n for n, _ in named], opt.state_dict()["param_groups"]))

    def checkpoint(st: LoopState, why: str) -> None:
        tensors, opt_full = par.full_params(named), par.full_optim_state(opt)  # collectives under FSDP
        if rank == 0:
            trainckpt.save(ctx.store, vkey, st.steps, tensors, opt_full,
                           {"loop": st.to_dict(), "base_version": version, "why": why, "gpus": world})
            failpoints.hit("train-checkpoint")
        dist.barrier()

    resumed_at = state.steps if state else 0
    ranges = itertools.islice(batch_ranges(len(rows), cfg.train.batch_size, cfg.seed, cycle, block), resumed_at, None)
    sync = par.StopSync(preempt.requested)
    progress = visit_progress(cfg, run_id, cycle, block, ctx.store) if rank == 0 else None  # the live line
    res = run_steps(loss_fn, params, prefetched(ranges, fetch, device), opt, opt_spec,
                    cfg.stop_rule(spec.get("min_rate")), on_window=on_window, should_stop=sync, state=state,
                    checkpoint=checkpoint, ckpt_steps=cfg.checkpoint.every_steps,
                    ckpt_seconds=cfg.checkpoint.every_seconds, clock=sync.clock, progress=progress,
                    global_step=spec.get("global_step", 0))
    if progress is not None:
        progress.close()
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0],
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=sync.group)
    block_file, moments_file = {}, None
    if res.stopped_by != "interrupted":
        tensors = par.full_params(named)
        opt_full = par.full_optim_state(opt) if cfg.bcd.moments == "keep" else None  # collectives under FSDP
        if rank == 0:
            block_file = checkpoints.save_block(ctx.store, run_id, {n: tensors[n] for n in ctx.plan[block].params})
            if opt_full is not None:
                moments_file = checkpoints.save_block(ctx.store, run_id,
                                                      optimizer_tensors(opt_full, [n for n, _ in named]))
    return TrainResult(
        steps=res.steps, first_loss=res.losses[0] if res.losses else float("nan"), train_loss=res.final_loss,
        stopped_by=res.stopped_by, seconds=res.seconds, resumed_at=resumed_at, tokens=res.tokens, rows=len(rows),
        val_points=val_points, peak_mem_bytes=int(peak.item()) if device.type == "cuda" else None,
        block_file=block_file, recompute=recompute, gpus=world, rate=res.rate, moments_file=moments_file)


if __name__ == "__main__":
    sys.exit(main())
