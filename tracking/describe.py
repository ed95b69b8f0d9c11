"""What a run tells MLflow about itself, as resolved (docs/DESIGN.md §2.7): its parameters, its training data as a
dataset, each committed version as a model. Pure functions of the run's config and what its context resolved (no
MLflow here: ``tracking/tracker.py`` logs them).

    params = run_params(cfg, "bcd", ctx.model_cfg, ctx.plan)      # flat str -> str, no "None", the real sizes
    ds = training_dataset(cfg.data, ctx.dataset)                  # name, digest, source, profile of the corpus
"""
from __future__ import annotations

from typing import Any

from bcdflow.core.config import RunConfig
from bcdflow.models.build import param_count
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import Plan



def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def block_params(mcfg: ModelConfig, plan: Plan) -> list[int]:
    """Each block's parameter count (a tied embedding/head counted once, in block 0), from a one-layer
    meta-device model: every layer has the same tensors, so a layer's names map onto layer 0's."""
    return [param_count(mcfg, b.params) for b in plan.blocks]


def run_params(cfg: RunConfig, mode: str, mcfg: ModelConfig, plan: Plan) -> dict[str, str]:
    """The run's MLflow parameters: every config key that has a value (an unset key, ``None``, is left out: what it
    resolved to is logged instead), the model as built (``model.*``: family, layers, width, heads, MLP width, context,
    vocabulary, tying, and ``model.params``, its parameter count), the optimizer's rate as used (``optim.lr``: the
    paper's default where unset), and each block's layers and parameters (``block.N.layers`` as ``lo-hi`` inclusive,
    ``block.N.params``). The store URL and the tracking URI are not parameters (they may name a bucket or a host)."""
    values = {k: v for k, v in _flat(cfg.model_dump(exclude={"store", "tracking_uri"})).items() if v is not None}
    per_block = block_params(mcfg, plan)
    resolved = {"model.family": mcfg.family, "model.n_layer": mcfg.n_layer, "model.d_model": mcfg.d_model,
                "model.n_head": mcfg.n_head, "model.n_kv_head": mcfg.kv_heads, "model.d_ff": mcfg.ffn_dim,
                "model.n_ctx": mcfg.n_ctx, "model.vocab_size": mcfg.vocab_size, "model.tied": mcfg.tied,
                "model.params": sum(per_block), "optim.lr": cfg.optim_spec().base_lr, "bcd.blocks": len(plan.blocks),
                "mode": mode}
    for b, n in zip(plan.blocks, per_block):
        lo, hi = b.layers
        resolved[f"block.{b.index}.layers"] = f"{lo}-{hi - 1}" if hi > lo else "none"
        resolved[f"block.{b.index}.params"] = n
    return {k: str(v)[:6000] for k, v in {**values, **resolved}.items()}


def corpus_name(data) -> tuple[str, str, str]:
    """(name, source type, source) of a run's text: its files, a Hugging Face dataset, or the built-in corpus."""
    if data.files:
        files = data.files if isinstance(data.files, str) else ", ".join(data.files)
        return f"files {files}", "local", files
    if data.path:
        name = data.path + (f"/{data.name}" if data.name else "")
        return f"{name} [{data.split}]", "hugging_face", name
    return "built-in corpus (Python standard library sources)", "code", "python-stdlib"


def training_dataset(data, dataset) -> dict[str, Any]:
    """A run's training data as MLflow logs a dataset input: the corpus's name, the token dataset's id as digest
    (content-addressed: the same files, tokenizer and split give the same id), where it came from, and its figures
    (rows, tokens, sequence length, vocabulary, format)."""
    name, source_type, source = corpus_name(data)
    meta = dataset.meta
    profile = {"train_rows": dataset.n_train, "val_rows": dataset.n_val, "seq_len": dataset.seq_len,
               "vocab_size": dataset.vocab_size, "format": dataset.data_format,
               **{k: meta[k] for k in ("n_tokens", "n_docs") if k in meta}}
    return {"name": name, "digest": dataset.id, "source_type": source_type, "source": source, "profile": profile}
