"""A visit on several GPUs (``train.gpus=N`` on this machine, ``train.nodes=M`` machines): the train task launches
``torchrun`` with one process per GPU, each runs :func:`train_rank`, and rank 0 writes the checkpoints, the block file
and the result.

    train.gpus=2 -> python -m torch.distributed.run --standalone --nproc-per-node 2 -m bcdflow.tasks.train_dist SPEC.json
    train.nodes=2 -> node 0 (the task): torchrun --nnodes 2 --node-rank 0 --master-addr H --master-port P ...;
                     each other machine: bcdflow join RUN --node-rank 1 (reads the job from the store, runs the same)

Across machines a lost machine fails the whole visit (gloo and NCCL collectives fail when a peer goes away): the
visit resumes from its last mid-visit checkpoint on its next attempt, as after any failure.

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
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import torch
import torch.distributed as dist

from bcdflow.core import stop_signals
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, check_gpus, resolve_device
from bcdflow.core.rules import VisitSpec
from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.models import build_model
from bcdflow.models import parallel as par
from bcdflow.models.errors import ConfigError, Diverged
from bcdflow.models.memory import visit_memory
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.storage import checkpoints
from bcdflow.storage.layout import nodes_key
from bcdflow.storage.lease import lost_lease
from bcdflow.constants import IGNORE_INDEX
from bcdflow.tasks import preemption
from bcdflow.tasks.engine import (TrainResult, VisitLayout, as_stored, device_peak, diverged_message, prepare_model,
                                  run_visit)
from bcdflow.tasks.expand import suffix_adapters
from bcdflow.tasks.progress import visit_progress
from bcdflow.tracking.tracker import TrackTarget

ERRORS = {"BadInput": BadInput, "DamagedArtifact": DamagedArtifact}


# -- the train task's side ------------------------------------------------------------------------------------

def _die_with_parent() -> None:  # in the child, before exec: SIGTERM to torchrun when the train task dies
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(ctx: RunContext, spec: VisitSpec, track: TrackTarget | None = None) -> TrainResult:
    """Train visit ``spec`` with ``train.gpus`` processes and return rank 0's result (as ``train_block`` does). Their
    ``spec.json`` is the visit's record (``visit``: ``VisitSpec.to_dict``) with the run's config, ids and tracking.
    Across ``train.nodes`` machines this one is torchrun's node 0 (rank 0: it writes): the job goes to the store
    (``storage/layout.nodes_key``) for the others' ``bcdflow join`` (:func:`join`) while it trains."""
    cfg, run_id, dataset_id = ctx.cfg, ctx.run_id, ctx.dataset_id
    cycle, block = spec.cycle, spec.block
    check_gpus(cfg)  # a worker that picked this visit up may have fewer GPUs than the one that planned it
    work = _work_dir(f"visit-c{cycle}-b{block}-")
    job = {"visit": spec.to_dict(), "cfg": cfg.model_dump(mode="json"), "run_id": run_id, "dataset_id": dataset_id,
           "work": work,
           "track": None if track is None else {f.name: getattr(track, f.name) for f in dataclasses.fields(track)
                                                if not f.name.startswith("_")}}
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(job, f)
    shared = nodes_key(run_id, cycle, block) if cfg.train.nodes > 1 else None
    if shared:  # what the other machines join: no tracking (rank 0's), a new attempt each launch
        ctx.store.write_json({**job, "work": None, "track": None, "attempt": uuid.uuid4().hex}, shared)
    try:
        returncode, lost = _torchrun(_command(cfg, 0, work), work, lost_lease)
        if lost is not None:
            raise lost
        try:
            return _result(work, returncode, run_id, cfg.fleet.reschedule_delay_s)
        except RuntimeError as e:
            if not shared:
                raise
            first = (str(e).splitlines() or [""])[0][:400]
            raise RuntimeError(f"visit c{cycle}-b{block} across {cfg.train.nodes} machines failed: a machine's "
                               f"processes failed or went away ({first}); its next attempt resumes from its last "
                               f"checkpoint, joined by `bcdflow join {run_id} --node-rank K` on the other machines"
                               ) from None
    finally:
        if shared:
            try:
                ctx.store.rm(shared)
            except OSError:
                pass  # a store that went away: the next launch writes a new attempt over it
        if not os.environ.get("BCDFLOW_DIST_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


def _work_dir(prefix: str) -> str:
    base = os.environ.get("BCDFLOW_DIST_DIR")
    return tempfile.mkdtemp(prefix=prefix, dir=base) if base else tempfile.mkdtemp(prefix="bcdflow-visit-")


def _command(cfg: RunConfig, node_rank: int, work: str) -> list[str]:
    """torchrun for this machine's ``train.gpus`` processes: standalone on one machine, else node ``node_rank`` of
    ``train.nodes`` meeting at ``train.rdzv_endpoint`` (global rank = node rank x gpus + local rank: node 0 holds
    rank 0)."""
    t = cfg.train
    if t.nodes == 1:
        where = ["--standalone"]
    else:
        host, _, port = t.rdzv_endpoint.rpartition(":")
        where = [f"--nnodes={t.nodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={t.gpus}",
            "-m", "bcdflow.tasks.train_dist", os.path.join(work, "spec.json")]


def _torchrun(cmd: list[str], work: str, lease=lambda: None) -> tuple[int, BaseException | None]:
    """Run torchrun and wait: a SIGTERM or SIGINT to this process is forwarded to each of its processes as SIGTERM
    (they stop after the same step, rank 0 checkpoints); a lease that could expire (``lease()`` not None) kills
    them all at once. Returns torchrun's exit code and the lost lease, if any."""
    forwarded: set[int] = set()
    lost = None
    with stop_signals.training():  # the task's own SIGTERM/SIGINT: forwarded to every process as SIGTERM
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
        while proc.poll() is None:
            if (lost := lease()) is not None:  # it could expire: every process stops now, no checkpoint (§9)
                for pid in [*_pids(work), -proc.pid]:  # the ranks, then torchrun's process group
                    _signal(pid, signal.SIGKILL)
                proc.wait()
                break
            if stop_signals.requested():
                for pid in _pids(work):
                    if pid not in forwarded:
                        forwarded.add(pid)
                        _signal(pid)
            time.sleep(0.1)
    return proc.returncode, lost


def join(store, run_id: str, node_rank: int, once: bool = False, poll_s: float = 1.0) -> int:
    """``bcdflow join RUN --node-rank K``: on another machine of a visit across ``train.nodes`` machines, join every
    visit of run ``run_id`` as torchrun's node ``node_rank`` (its ``train.gpus`` processes), until the run is done
    (``once``: after one visit; its torchrun's exit code). A visit that fails or loses a machine fails as a whole
    and resumes from its last checkpoint on its next attempt, which this joins again."""
    from bcdflow.storage import runs
    from bcdflow.storage.layout import config_key, parse_visit, visits_key

    joined: set[str] = set()
    while True:
        state = runs.read_state(store, run_id) if store.exists(config_key(run_id)) else None
        if state is not None and state.status == "done":
            return 0
        names = store.listdir(visits_key(run_id)) if store.exists(visits_key(run_id)) else []
        for name in sorted(n for n in names if parse_visit(n)):
            key = f"{visits_key(run_id)}/{name}/nodes.json"
            try:
                job = store.read_json(key)
            except (FileNotFoundError, OSError, ValueError):
                continue  # not across machines, or its attempt ended meanwhile
            if job.get("attempt") in joined:
                continue
            joined.add(job["attempt"])
            code = _join_one(job, node_rank)
            if once:
                return code
        time.sleep(poll_s)


def _join_one(job: dict, node_rank: int) -> int:
    cfg = RunConfig.model_validate(job["cfg"])
    if not 0 < node_rank < cfg.train.nodes:
        raise BadInput(f"--node-rank: {node_rank} is not one of the other machines of a visit on "
                       f"train.nodes={cfg.train.nodes} (1 to {cfg.train.nodes - 1}; node 0 is the visit's task)")
    check_gpus(cfg)
    work = _work_dir(f"join-c{job['visit']['cycle']}-b{job['visit']['block']}-")
    try:
        with open(os.path.join(work, "spec.json"), "w") as f:
            json.dump({**job, "work": work}, f)
        return _torchrun(_command(cfg, node_rank, work), work)[0]
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
    with stop_signals.training():  # from the start: a SIGTERM while loading is a checkpoint after the first step
        cfg = RunConfig.model_validate(spec["cfg"])
        cuda = resolve_device(cfg.train.device).type == "cuda"
        device = par.local_device() if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        rank = dist.get_rank()
        try:
            out = {"status": "done", "result": train_rank(cfg, spec, device).model_dump()}
        except Diverged as e:
            visit = spec["visit"]
            out = {"status": "diverged", "message": diverged_message(cfg, spec["run_id"], visit["cycle"],
                                                                     visit["block"], e)}
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


def choose_parallel(cfg: RunConfig, ctx: RunContext, block: int, world: int, recompute: bool,
                    expand: int = 0) -> str:
    """``train.parallel``, or (auto) ddp when the planner says one replica of the visit, with its 1/N of the batch,
    fits ``train.memory_gb``; else fsdp, which a visit with adapters (``expand``: their rank) cannot take."""
    if cfg.train.parallel != "auto":
        return cfg.train.parallel
    budget = ctx.budget()  # with NCCL's buffers in the reserve
    if budget is None:
        return "ddp"
    shape = dataclasses.replace(cfg.step_shape(), recompute="on" if recompute else "off", gpus=world,
                                parallel="ddp")  # with its adapters (bcd.expand), as the visit holds them
    est = visit_memory(ctx.model_cfg, ctx.plan, block, shape)
    if est.peak > budget and expand:
        raise ConfigError(f"bcd.expand: a replica of block {block}'s visit does not fit the device "
                          f"({est.peak / 1e9:.1f} GB predicted) and FSDP does not shard the adapters; set "
                          "bcd.expand=off, or more blocks, or bcd.recompute=on")
    if est.peak > budget and OPTIMIZERS[cfg.optim.name].light:
        raise ConfigError(f"optim.name: a replica of block {block}'s visit does not fit the device "
                          f"({est.peak / 1e9:.1f} GB predicted) and FSDP does not shard {cfg.optim.name}'s 8-bit "
                          "state; use more blocks, bcd.recompute=on, or optim.name=adamw")
    return "ddp" if est.peak <= budget else "fsdp"


class Distributed:
    """The visit's model held by one of several processes (a ``tasks.engine.VisitHolding``): DDP loads it
    whole on this process's device; FSDP2 builds it on the meta device, shards it, and copies each block's tensors
    into this process's shards one block at a time. Each process reads its slice of every batch, the loss is the
    global mean, the stop flag and clock are synchronized, and rank 0 writes."""

    def __init__(self, ctx: RunContext, vs: VisitLayout):
        cfg, device = ctx.cfg, ctx.device
        self.ctx, self.vs, self.device = ctx, vs, device
        self.rank, self.world = par.world()
        self.writer = self.rank == 0
        self.mode = choose_parallel(cfg, ctx, vs.block, self.world, vs.recompute, vs.expand)
        low = cfg.train.precision == "bf16"
        if self.mode == "ddp":
            model = ctx.load_part(ctx.manifest(vs.version), vs.layers, embed=vs.embed, head=True, trainable=vs.active)
        else:
            model = build_model(ctx.model_cfg, layers=vs.layers, embed=vs.embed, head=True, device="meta",
                                init=False, frozen_dtype=torch.bfloat16 if low else None, trainable=vs.active)
        self.named = prepare_model(model, vs.active, cfg.train.loss_chunk_rows, cfg.train.compile)
        step = par.VisitStep(model, vs.lo, vs.hi, vs.from_acts, vs.recompute, cfg.train.precision)
        step.recompute_active = vs.recompute_active
        # bcd.expand: the adapters, a submodule of the step (not of the model), so DDP all-reduces their gradients
        self.adapters = suffix_adapters(ctx, vs, model) if self.mode == "ddp" else None
        if self.adapters is not None:
            step.expand = self.adapters
        if self.mode == "ddp":
            mod = par.wrap_ddp(step, device)
        else:
            par.shard_fsdp(step, device)
            step.to_empty(device=device)
            model._init_buffers()
            names = [n for n, _ in model.named_parameters()]
            for b in sorted({ctx.plan.owner(n) for n in names}):  # host memory: one block's tensors at a time
                par.load_sharded(model, checkpoints.load_from_manifest(ctx.store, ctx.run_id,
                                                                       ctx.manifest(vs.version), [b], names=names,
                                                                       device="cpu"))
            self.named = [(n, p) for n, p in model.named_parameters() if n in vs.active]  # the shards
            mod = step
        step.train()
        self.model, self.module, self.mod = model, step, mod
        self.eval_loss = functools.partial(mod, reduction="mean")  # every process runs the whole batch
        self.ckpt_device = "cpu"
        self.sync = par.StopSync(stop_signals.requested)
        self.should_stop, self.clock = self.sync, self.sync.clock

    def fetch(self, read, rows):
        ds = self.ctx.dataset

        def fetch_slice(a: int, b: int):
            la, lb = par.slice_rows(a, b, self.rank, self.world)
            x, y = read(la, lb) if lb > la else par.empty_slice_batch(*read(a, a + 1))
            return x, y, ds.trained_tokens(rows[a:b])  # this process's slice; the whole batch's trained tokens
        return fetch_slice

    def loss(self, batch):
        x, y, _ = batch
        return par.global_mean(self.mod(x, y), (y != IGNORE_INDEX).sum())

    def set_params(self, tensors):
        par.load_sharded(self.model, tensors)

    def load_optim(self, opt, state):
        par.load_optim_state(opt, state)

    def params(self):
        return par.full_params(self.named)  # collectives under FSDP

    def optim_state(self, opt):
        return par.full_optim_state(opt)

    def block_tensors(self):
        owned = set(self.ctx.plan.blocks[self.vs.block].params)  # with what bcd.freeze keeps frozen: as stored
        return as_stored(self.ctx, self.vs, par.full_params([(n, p) for n, p in self.model.named_parameters()
                                                             if n in owned]))

    def barrier(self):
        dist.barrier(group=self.sync.group)  # the host group: rank 0 may be writing a checkpoint for minutes

    def peak(self):
        """The largest (allocated, reserved, retries) of any process (CUDA), from one all-reduce on the host group."""
        mine = device_peak(self.device)
        peak = torch.tensor(mine or (0, 0, 0), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.sync.group)
        return tuple(int(v) for v in peak.tolist()) if mine is not None else None

    def comm_bytes(self, steps: int) -> int:
        count = getattr(self.mod, "comm", None)  # DDP's counting hook (models/parallel.wrap_ddp); FSDP: none
        return count.bytes // steps if count is not None and steps > 0 else 0

    def close(self):
        pass


def train_rank(cfg: RunConfig, job: dict, device: torch.device) -> TrainResult:
    """One process of a distributed visit: ``tasks.engine.run_visit`` with the model held by :class:`Distributed`."""
    run_id, spec = job["run_id"], VisitSpec.from_dict(job["visit"])
    rank, world = par.world()
    ctx = RunContext.of(cfg, run_id, job["dataset_id"])
    ctx.device = device  # this process's GPU (the context is this process's own)
    track = TrackTarget(**job["track"]) if job.get("track") and rank == 0 else None
    progress = visit_progress(cfg, run_id, spec.cycle, spec.block, ctx.store) if rank == 0 else None  # the live line
    return run_visit(ctx, spec, Distributed, gpus=world, track=track, progress=progress)


if __name__ == "__main__":
    sys.exit(main())
