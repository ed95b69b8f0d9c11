"""Landscape expansion in a visit (``bcd.expand``; the adapters themselves are models/expand.py): which layers a visit
adapts, the adapters' optimizer group, and the merge into the suffix blocks' files when the visit ends
(docs/DESIGN.md §2.3, I1).

    adapters = suffix_adapters(ctx, vs, model)           # None: expansion off, or no layer after the block
    opt.add_param_group(adapter_group(ctx.cfg, spec, adapters))
    files, norms = merge(ctx, vs, adapters)              # {block: manifest entry}, {block: norm of its update}

    rule = suffix_rule(ctx, vs, model, opt, spec)        # bcd.expand=sign: the suffix's own weights, state-free
    files, norms = merge_suffix(ctx, vs, rule)

The merge reads each suffix block's tensors as stored in the visit's base version (not the device copies: under
``train.precision=bf16`` those are bf16 while the file may hold fp32), adds the adapters' updates in fp32, casts each
back to its stored dtype and writes a new content-addressed file: copy-on-write, as the active block's.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from bcdflow.core.config import SUFFIX_RULES, RunConfig
from bcdflow.core.context import RunContext
from bcdflow.models.errors import ConfigError
from bcdflow.models.expand import SuffixAdapters, merged
from bcdflow.models.suffix import SignSuffix
from bcdflow.models.trainer import OptimSpec
from bcdflow.storage import checkpoints


def suffix_layers(vs) -> range:
    """The layers a visit's expansion adapts: those after its active block (``VisitLayout.expand`` > 0)."""
    return range(vs.hi, vs.n_layer) if vs.expand and vs.hi is not None else range(0)


def suffix_adapters(ctx: RunContext, vs, model: torch.nn.Module) -> SuffixAdapters | None:
    """The visit's adapters, attached to ``model``, on the visit's device, drawn from a generator seeded by (run
    seed, cycle, block); None without expansion."""
    layers = suffix_layers(vs)
    if not layers:
        return None
    seed = int(np.random.SeedSequence([ctx.cfg.seed, vs.cycle, vs.block, 0xE4]).generate_state(1)[0])
    return SuffixAdapters(model, layers, vs.expand, seed, ctx.device).attach(model)


def suffix_rule(ctx: RunContext, vs, model: torch.nn.Module, opt: torch.optim.Optimizer,
                spec: OptimSpec) -> SignSuffix | None:
    """``bcd.expand=sign`` (or ``normalized``): sign descent (normalized SGD) on every parameter the stored blocks
    after the visit's block train (their ``bcd.freeze`` kept; a tied head is block 0's embedding, never a suffix's), attached to ``model``, at
    ``bcd.expand_lr`` scheduled as the block's (its ratio to the block's rate applied to the group ``opt`` steps the
    block with), the stochastic rounding seeded by (run seed, cycle, block); None without it, for the last block, a
    row block, or a model without the suffix (a benchmark's whole-model step)."""
    cfg = ctx.cfg
    if cfg.bcd.expand not in SUFFIX_RULES or vs.hi is None:
        return None
    names = sorted(ctx.plan.suffix(vs.block, cfg.bcd.freeze, ctx.model_cfg.tied))
    if not names:
        return None
    streamed = {f"h.{i}." for i in vs.streamed}
    if any(n.startswith(tuple(streamed)) for n in names):  # the plan holds a sign visit's suffix (RunConfig.step_shape)
        raise ConfigError(f"bcd.expand: {cfg.bcd.expand} needs block {vs.block}'s suffix on the device, and its "
                          f"visit streams layers {list(vs.streamed)}; set train.offload=off or bcd.expand=lora")
    ratio = (cfg.bcd.expand_lr or spec.base_lr) / spec.base_lr
    group = opt.param_groups[0]  # the block's: run_steps sets its scheduled rate before each step
    seed = int(np.random.SeedSequence([cfg.seed, vs.cycle, vs.block, 0x51]).generate_state(1)[0])
    return SignSuffix(model, names, lambda: group["lr"] * ratio / group.get("lr_ratio", 1.0), seed,
                      cfg.bcd.expand).attach()


def merge_suffix(ctx: RunContext, vs, rule: SignSuffix) -> tuple[dict[int, dict], dict[int, float]]:
    """Write each suffix block of the base version with the sign rule's weights in it (cast to each tensor's stored
    dtype; the block's other tensors as stored, one block on the host at a time); returns the new files' manifest
    entries and the norm of each block's update, by block."""
    by_block: dict[int, dict[str, torch.Tensor]] = {}
    for name, w in rule.weights().items():
        by_block.setdefault(ctx.plan.owner(name), {})[name] = w
    manifest = ctx.manifest(vs.version)
    files, norms = {}, {}
    for b in sorted(by_block):
        tensors = checkpoints.load_from_manifest(ctx.store, ctx.run_id, manifest, [b])
        new = {**tensors, **{n: w.to(tensors[n].dtype) for n, w in by_block[b].items()}}
        norms[b] = math.sqrt(sum(float(((new[n].double() - tensors[n].double()) ** 2).sum()) for n in by_block[b]))
        files[b] = checkpoints.save_block(ctx.store, ctx.run_id, new)
    return files, norms


def adapter_group(cfg: RunConfig, spec: OptimSpec, adapters: SuffixAdapters) -> dict:
    """The adapters' optimizer parameter group: ``bcd.expand_lr`` (else the block's rate), scheduled as the block's
    (``lr_ratio``: models/trainer.run_steps), no weight decay (an update that starts at zero, merged after one
    visit)."""
    lr = cfg.bcd.expand_lr or spec.base_lr
    return {"params": [p for _, p in adapters.named()], "lr": lr, "weight_decay": 0.0,
            "lr_ratio": lr / spec.base_lr}


def merge(ctx: RunContext, vs, adapters: SuffixAdapters) -> tuple[dict[int, dict], dict[int, float]]:
    """Write each suffix block of the base version with the adapters merged in (one block on the host at a time);
    returns the new files' manifest entries and the norm of each block's update, by block."""
    deltas = adapters.deltas()
    by_block: dict[int, dict[str, torch.Tensor]] = {}
    for name, d in deltas.items():
        by_block.setdefault(ctx.plan.owner(name), {})[name] = d
    manifest = ctx.manifest(vs.version)
    files, norms = {}, {}
    for b in sorted(by_block):
        tensors = checkpoints.load_from_manifest(ctx.store, ctx.run_id, manifest, [b])
        new, norm = merged(tensors, by_block[b])
        files[b] = checkpoints.save_block(ctx.store, ctx.run_id, new)
        norms[b] = norm
    return files, norms
