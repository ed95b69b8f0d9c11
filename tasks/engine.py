"""The visit engine: what training a visit shares between this process (``tasks/train.py``) and each process of a
visit on several GPUs (``tasks/train_dist.py``): the result record, the data prefetch, the validation batches of a
visit and their loss, the per-window callback, the recompute choice and the divergence message.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch
from pydantic import BaseModel

from bcdflow.constants import IGNORE_INDEX
from bcdflow.core.config import RunConfig
from bcdflow.core.context import RunContext, memory_budget
from bcdflow.models.errors import Diverged
from bcdflow.models.memory import needs_recompute
from bcdflow.models.visit import autocast, prefix_hidden
from bcdflow.storage.tokens import TokenDataset
from bcdflow.tracking.tracker import TrackTarget


class TrainResult(BaseModel):
    """What training a block returns to its visit (steps are local to the visit)."""
    steps: int
    first_loss: float
    train_loss: float
    stopped_by: str
    seconds: float
    resumed_at: int
    tokens: int
    rows: int
    val_points: list[tuple[int, float]]
    peak_mem_bytes: int | None
    block_file: dict
    recompute: bool = False
    """Whether the frozen suffix was recomputed in backward (bcd.recompute, or auto and the planner said so)."""
    gpus: int = 1
    streamed: int = 0
    """Frozen layers the visit streamed from host memory (``train.offload``); 0 = all resident."""
    val_loss: float | None = None
    """The new version's validation loss, computed by the visit's own model (the frozen prefix does not change in
    a visit); None where that would not be the whole model's (bf16/fp16 stored activations, several processes)."""
    eval_seconds: float = 0.0
    rate: float | None = None
    """Training loss lowered per step on average over the visit (models/trainer.visit_rate; None: too short)."""
    moments_file: dict | None = None
    """``bcd.moments=keep``: the optimizer state the visit ended with (a content-addressed file's entry)."""


class EvalResult(BaseModel):
    val_loss: float
    val_ppl: float
    seconds: float


def window_logger(track: TrackTarget | None, eval_every: int, model: torch.nn.Module,
                  evaluate: Callable[[], float], val_points: list[tuple[int, float]]) -> Callable:
    """The trainer's per-window callback: each step's loss to MLflow and, when the window crossed a multiple of
    ``eval_every``, the validation loss (``model`` in eval mode meanwhile), appended to ``val_points`` too."""
    def on_window(step: int, losses: list[float]) -> None:
        if track:
            track.series("train_loss", [(step - len(losses) + i + 1, v) for i, v in enumerate(losses)])
        if eval_every and step // eval_every > (step - len(losses)) // eval_every:
            model.eval()
            val = evaluate()
            model.train()
            val_points.append((step, val))
            if track:
                track.series("val_loss", [(step, val)])
                track.series("val_ppl", [(step, math.exp(min(val, 50)))])
    return on_window


def counted(fetch: Callable) -> Callable:
    """``fetch(a, b)`` -> (inputs, targets) made (inputs, targets, trained tokens): the count of targets that are
    not ``IGNORE_INDEX``, taken on the host in the prefetch thread, so the step loop's ``tokens`` and
    ``tokens_per_s`` count trained positions only without syncing a GPU (``models/trainer._tokens``)."""
    def fetch_counted(a: int, b: int):
        x, y = fetch(a, b)
        return x, y, int((y != IGNORE_INDEX).sum())
    return fetch_counted


def prefetched(ranges: Iterator[tuple[int, int]], fetch: Callable, device) -> Iterator:
    """Read batch k+1 from the store while batch k trains (tensors of a batch go to the device, other items as
    they are)."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fetch, *next(ranges))
        while True:
            batch = fut.result()
            fut = pool.submit(fetch, *next(ranges))
            yield tuple(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch)


def use_recompute(cfg: RunConfig, ctx: RunContext, block: int, gpus: int = 1, parallel: str = "single") -> bool:
    """``bcd.recompute``: on, off, or (auto) on when the planner says the visit would not fit ``train.memory_gb``
    (default: the CUDA device's memory; unlimited on the CPU)."""
    if cfg.bcd.recompute != "auto":
        return cfg.bcd.recompute in ("on", "all")
    budget = memory_budget(cfg, ctx.device)
    return needs_recompute(ctx.model_cfg, ctx.plan, block, cfg.train.batch_size, ctx.dataset.seq_len,
                           cfg.train.precision, budget, optim=cfg.optim.name, preinfer=cfg.bcd.preinfer,
                           chunk_rows=cfg.train.loss_chunk_rows, weight_decay=cfg.optim.weight_decay, gpus=gpus,
                           parallel=parallel)


def compile_layers(model) -> None:
    """torch.compile each layer in place (identical layers share one compiled graph)."""
    for layer in model.h.values():
        layer.compile()


def diverged_message(cfg: RunConfig, run_id: str, cycle: int, block: int, e: Diverged) -> str:
    hint = " (or bf16 overflowed: try train.precision=fp32)" if cfg.train.precision == "bf16" else ""
    return (f"visit c{cycle}-b{block} of run {run_id!r}: {e}; the learning rate optim.lr={cfg.optim_spec().base_lr:g} "
            f"is likely too high{hint}. Nothing was committed; continue the run with a lower one: "
            f"bcdflow train --run-id {run_id} --set optim.lr=... (and the run's other settings)")


def val_batches(ds: TokenDataset, cfg: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``train.eval_rows`` validation rows as (B, T) inputs and targets, in evaluation batches."""
    inputs, targets = ds.val_pairs(cfg.train.eval_rows)
    rows = cfg.train.eval_batch_size or cfg.train.batch_size
    return list(zip(inputs.split(rows), targets.split(rows)))


def visit_val_batches(cfg: RunConfig, ctx: RunContext, version: int, block: int) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """What a visit validates on within itself (``bcd.eval_every``): the validation batches or, for a visit
    trained from stored activations (whose model starts at its block), the frozen prefix's hidden states of them,
    computed once (the prefix is frozen for the whole visit) and rounded as the stored activations are; kept in
    CPU memory (eval_rows × T × d_model × the activation dtype's bytes)."""
    batches = val_batches(ctx.dataset, cfg)
    if not ctx.from_acts(block):
        return batches
    lo = ctx.plan[block].layers[0]
    prefix = ctx.frozen_prefix(version, block)  # pre-inference's, where this process ran it
    dtype = getattr(torch, cfg.bcd.act_dtype)
    with torch.inference_mode(), autocast(ctx.device, cfg.train.precision):
        return [(prefix_hidden(prefix, x.to(ctx.device), lo).to("cpu", dtype), y) for x, y in batches]


@torch.no_grad()
def evaluate_model(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: RunConfig, device) -> float:
    """Token-weighted mean validation loss over ``batches`` (``loss_of(x, y)``: a batch's mean loss); with a loss
    mask (supervised formats) over the trained (completion) tokens only."""
    total, count = 0.0, 0
    for x, y in batches:
        n = int((y != IGNORE_INDEX).sum())
        if n == 0:  # a batch without a trained token has no loss (cross-entropy of nothing is NaN)
            continue
        with autocast(device, cfg.train.precision):
            loss = loss_of(x.to(device).float() if x.is_floating_point() else x.to(device), y.to(device))
        total += float(loss) * n
        count += n
    return total / count if count else float("nan")


def optimizer_tensors(state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The per-parameter entries of an optimizer ``state_dict()`` (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``;
    a distributed visit's gathered whole) as named tensors ``{entry}/{parameter name}``; ``names``: the names of
    the optimizer's parameters, in its order."""
    return {f"{k}/{n}": torch.as_tensor(v) for i, n in enumerate(names) for k, v in state["state"].get(i, {}).items()}


def optimizer_state(tensors: dict[str, torch.Tensor], names: list[str], param_groups: list[dict]) -> dict:
    """What ``optimizer_tensors`` saved as a ``state_dict()`` for an optimizer over ``names`` whose parameter
    groups (learning rate included) are ``param_groups``; a parameter without saved entries starts fresh."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        k, n = key.split("/", 1)
        by_name.setdefault(n, {})[k] = t
    return {"state": {i: by_name[n] for i, n in enumerate(names) if n in by_name}, "param_groups": param_groups}
