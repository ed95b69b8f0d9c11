"""Mid-visit checkpoints (docs/DESIGN.md §2.3, issue: nothing lost when a spot rental vanishes).

``{visit}/train-ckpt/`` holds, per checkpoint, a safetensors file of the active block's parameters and
the RNG state, a ``torch.save`` file of the optimizer state, and last a small ``ckpt.json`` pointer with
the step, the data cursor, the loop state and the sha256 of both files. Loading verifies both
checksums and reads the optimizer state with ``torch.load(weights_only=True)``: never arbitrary pickle.
Older files are removed only after the new pointer is written.
"""
from __future__ import annotations

import io
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from bcdflow.errors import DamagedArtifact

from .layout import train_ckpt_key
from .store import Store, sha256_bytes


class TrainCheckpointError(DamagedArtifact):
    """A mid-visit checkpoint fails its checksum or does not load."""


def save(store: Store, visit_key: str, step: int, params: dict[str, torch.Tensor], optim_state: dict,
         meta: dict[str, Any]) -> dict:
    """Write one checkpoint; returns the pointer written. ``meta`` must be JSON (loop state, cursor...)."""
    tensors = {f"param/{k}": v.detach().to("cpu").contiguous() for k, v in params.items()}
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    pbytes = st_save(tensors)
    buf = io.BytesIO()
    torch.save(_to_cpu(optim_state), buf)
    obytes = buf.getvalue()
    d = train_ckpt_key(visit_key)
    old = read_pointer(store, visit_key)
    pfile, ofile = f"params-{step}.safetensors", f"optim-{step}.pt"
    store.write_bytes(pbytes, d, pfile)
    store.write_bytes(obytes, d, ofile)
    pointer = {"step": step, "params": pfile, "params_sha256": sha256_bytes(pbytes),
               "optim": ofile, "optim_sha256": sha256_bytes(obytes), "meta": meta}
    store.write_json(pointer, d, "ckpt.json")  # the commit point of a checkpoint
    if old and old["step"] != step:
        for f in (old["params"], old["optim"]):
            store.rm(d, f)
    return pointer


def read_pointer(store: Store, visit_key: str) -> dict | None:
    d = train_ckpt_key(visit_key)
    return store.read_json(d, "ckpt.json") if store.exists(d, "ckpt.json") else None


def load(store: Store, visit_key: str, device: str | torch.device = "cpu"):
    """(pointer, params, optimizer state) of the latest checkpoint, or None if there is none."""
    pointer = read_pointer(store, visit_key)
    if pointer is None:
        return None
    d = train_ckpt_key(visit_key)
    pbytes = store.read_bytes(d, pointer["params"])
    obytes = store.read_bytes(d, pointer["optim"])
    for name, data, sha in ((pointer["params"], pbytes, pointer["params_sha256"]),
                            (pointer["optim"], obytes, pointer["optim_sha256"])):
        if sha256_bytes(data) != sha:
            raise TrainCheckpointError(f"checkpoint file {store.url_of(d, name)} is corrupt (sha256 mismatch)")
    tensors = st_load(pbytes)
    torch.set_rng_state(tensors.pop("rng/torch"))
    cuda_rng = tensors.pop("rng/cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    params = {k.removeprefix("param/"): v.to(device) for k, v in tensors.items()}
    optim_state = torch.load(io.BytesIO(obytes), map_location=device, weights_only=True)
    return pointer, params, optim_state


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
