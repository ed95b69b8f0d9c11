"""Train the active block of a visit (DESIGN §2.3), and evaluate a version on the validation set.

Only blocks b..M-1 (and the head) of version v are loaded when training from pre-inferred
activations; ``requires_grad`` is set on block b only, and the optimizer holds block b only, so
gradients and optimizer state exist for the active block alone (invariant I6).
"""
from __future__ import annotations

import itertools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from models.trainer import LoopState, make_optimizer, run_steps
from storage import activations, checkpoints, trainckpt
from storage.store import Store
from storage.tokens import TokenDataset
from tasks.config import RunConfig
from tasks.data import batch_ranges, sample_rows, visit_rows
from tasks import failpoints, preempt
from tasks.preinfer import acts_key, visit_key
from tasks.run import plan_for
from tasks.tracking import Tracker
from tasks.weights import autocast, block_tensors, load_part, resolve_device
from tasks.retry import retrying


def prefetched(ranges: Iterator[tuple[int, int]], fetch: Callable, device) -> Iterator:
    """Read batch k+1 from the store while batch k trains."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fetch, *next(ranges))
        while True:
            x, y = fut.result()
            fut = pool.submit(fetch, *next(ranges))
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_visit(cfg: RunConfig, run_id: str, cycle: int, block: int, version: int, dataset_id: str,
                step_offset: int = 0, mlflow_runs: tuple = (),
                eval_every: int | None = None) -> dict:
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    mcfg, plan = plan_for(cfg, ds.vocab_size)
    device = resolve_device(cfg.train.device)
    lo = plan[block].layers[0]
    from_acts = cfg.bcd.preinfer and block > 0
    manifest = checkpoints.read_manifest(store, run_id, version)
    model = load_part(store, run_id, manifest, mcfg, plan, (lo if from_acts else 0, mcfg.n_layer),
                      embed=not from_acts, head=True, device=device)
    active = set(plan[block].params)
    for name, p in model.named_parameters():
        p.requires_grad_(name in active)
    params = [p for n, p in model.named_parameters() if n in active]
    model.train()

    rows = visit_rows(cfg, ds.n_train, cycle, block)
    if from_acts:
        reader = activations.ActivationReader(store, acts_key(run_id, cycle, block))
        fetch = reader.read  # (B, T, C) float32, (B, T) long
    else:
        def fetch(a: int, b: int):
            t = torch.from_numpy(ds.train_rows(rows[a:b])).long()  # (B, T+1)
            return t[:, :-1], t[:, 1:]

    def loss_fn(batch):
        x, y = batch
        with autocast(device, cfg.train.precision):
            if from_acts:
                h = x
            elif block == 0:
                h = model.embed(x)
            else:  # pre-inference off: the frozen prefix runs here, off the gradient path
                with torch.no_grad():
                    h = model.run_layers(model.embed(x), 0, lo)
            return model.loss(model.run_layers(h, lo, mcfg.n_layer), y)

    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment) if mlflow_runs else None
    val_points: list[tuple[int, float]] = []

    def on_window(step: int, losses: list[float]) -> None:
        if tracker:
            pts = [(step_offset + step - len(losses) + i + 1, v) for i, v in enumerate(losses)]
            for rid in mlflow_runs:
                tracker.metric_series(rid, {"train_loss": pts})
        if eval_every and step // eval_every > (step - len(losses)) // eval_every:
            model.eval()
            val = evaluate_model(model, ds, cfg, device)
            model.train()
            val_points.append((step_offset + step, val))
            if tracker:
                for rid in mlflow_runs:
                    tracker.metrics(rid, {"val_loss": val, "val_ppl": math.exp(min(val, 50))}, step_offset + step)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    spec = cfg.optim_spec()
    opt = make_optimizer(params, spec)
    vkey = visit_key(run_id, cycle, block)
    state = None
    ck = trainckpt.load(store, vkey, device)
    if ck is not None and ck[0]["meta"].get("base_version") == version:  # resume mid-visit
        pointer, saved, opt_state = ck
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in active:
                    p.copy_(saved[n])
        opt.load_state_dict(opt_state)
        state = LoopState.from_dict(pointer["meta"]["loop"])

    def checkpoint(st: LoopState) -> None:
        trainckpt.save(store, vkey, st.steps, {n: p for n, p in model.named_parameters() if n in active},
                       opt.state_dict(), {"loop": st.to_dict(), "base_version": version})
        failpoints.hit("train-checkpoint")

    # the data cursor: a resumed loop skips the batches it already trained on
    ranges = itertools.islice(batch_ranges(len(rows), cfg.train.batch_size, cfg.seed, cycle, block),
                              state.steps if state else 0, None)
    batches = prefetched(ranges, fetch, device)
    resumed_at = state.steps if state else 0  # run_steps advances the state it is given
    with preempt.training():
        res = run_steps(loss_fn, params, batches, opt, spec, cfg.stop_rule(), on_window=on_window,
                        should_stop=preempt.requested, state=state, checkpoint=checkpoint,
                        ckpt_steps=cfg.checkpoint.every_steps, ckpt_seconds=cfg.checkpoint.every_seconds)
    if res.stopped_by == "interrupted":
        preempt.finish()  # hands SIGTERM on (Prefect reschedules) or exits 143
    block_file = checkpoints.save_block(store, run_id, block_tensors(model, plan, block))
    return {
        "steps": res.steps, "train_loss": res.final_loss, "first_loss": res.losses[0],
        "stopped_by": res.stopped_by, "train_seconds": res.seconds, "resumed_at": resumed_at,
        "tokens": res.tokens,
        "tokens_per_s": res.tokens / max(res.seconds, 1e-9), "block_file": block_file,
        "rows": int(len(rows)), "val_points": val_points,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


train_block = task(train_visit, name="train-block", **retrying(2))


@torch.no_grad()
def evaluate_model(model, ds: TokenDataset, cfg: RunConfig, device) -> float:
    """Token-weighted mean validation loss over the first ``train.eval_rows`` validation rows."""
    val = torch.from_numpy(ds.val_rows()[: cfg.train.eval_rows]).long()
    total, count = 0.0, 0
    for t in val.split(cfg.train.batch_size):
        t = t.to(device)
        with autocast(device, cfg.train.precision):
            loss = model(t[:, :-1], t[:, 1:])
        total += float(loss) * t[:, 1:].numel()
        count += t[:, 1:].numel()
    return total / count


def evaluate_version(cfg: RunConfig, run_id: str, base_version: int, dataset_id: str,
                     changed: dict[int, dict] | None = None) -> dict:
    """Validation loss and perplexity of version ``base_version`` with ``changed`` blocks replaced."""
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    mcfg, plan = plan_for(cfg, ds.vocab_size)
    device = resolve_device(cfg.train.device)
    manifest = checkpoints.read_manifest(store, run_id, base_version)
    manifest = {**manifest, "blocks": {**manifest["blocks"], **{str(b): f for b, f in (changed or {}).items()}}}
    model = load_part(store, run_id, manifest, mcfg, plan, (0, mcfg.n_layer), True, True, device).eval()
    t0 = time.perf_counter()
    loss = evaluate_model(model, ds, cfg, device)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50)), "eval_seconds": time.perf_counter() - t0}


evaluate = task(evaluate_version, name="evaluate", **retrying(2))


def greedy_block(cfg: RunConfig, run_id: str, version: int, dataset_id: str, cycle: int,
                 candidates: list[int]) -> int:
    """The candidate block with the largest gradient norm on a probe batch (DESIGN §2, order greedy)."""
    store = cfg.open_store()
    ds = TokenDataset.open(store, dataset_id)
    mcfg, plan = plan_for(cfg, ds.vocab_size)
    device = resolve_device(cfg.train.device)
    manifest = checkpoints.read_manifest(store, run_id, version)
    model = load_part(store, run_id, manifest, mcfg, plan, (0, mcfg.n_layer), True, True, device)
    probe = sample_rows(ds.n_train, 1.0, cfg.seed, cycle, 10_000 + version)[: cfg.train.batch_size]
    t = torch.from_numpy(ds.train_rows(np.sort(probe))).long().to(device)
    model(t[:, :-1], t[:, 1:]).backward()
    grads = dict(model.named_parameters())
    norms = {b: float(torch.sqrt(sum((grads[n].grad.float() ** 2).sum() for n in plan[b].params)))
             for b in candidates}
    return max(candidates, key=lambda b: (norms[b], -b))


choose_greedy = task(greedy_block, name="choose-block", cache_policy=NO_CACHE)
