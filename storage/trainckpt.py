"""Mid-visit checkpoints (docs/DESIGN.md §2.3, issue: nothing lost when a spot rental vanishes).

``{visit}/train-ckpt/`` holds, per checkpoint, a safetensors file of the active block's parameters and
the RNG state, a ``torch.save`` file of the optimizer state, and last a small ``ckpt.json`` pointer with
the step, the data cursor, the loop state and the sha256 of both files. Loading verifies both
checksums and reads the optimizer state with ``torch.load(weights_only=True)``: never arbitrary pickle.

The pointer also names the checkpoint before it (``previous``), whose files are kept: a checkpoint is only a
shortcut (the committed versions are intact), so one that fails its checks is skipped, with one logged line, for
the one before it, else the visit starts over; either way the visit ends bitwise where an uninterrupted one does
(docs/DESIGN.md I4). File names read from a pointer are used only when they are plain names in the checkpoint's
folder (storage/layout.is_plain_name), and old files are removed by listing that folder, never by a name the
pointer holds, so no pointer can make bcdflow read or delete anything outside it.

    save(store, visit_key, step, params, optim_state, meta)        # files first, the pointer last
    load(store, visit_key, device, base_version=v)                 # newest intact checkpoint of base version v
"""
from __future__ import annotations

import io
import logging
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .ckpt_pointer import _ENTRY, _SHORTCUT, POINTER, TrainCheckpointError, read_pointer  # noqa: F401
from .layout import train_ckpt_key
from .store import Store, sha256_bytes

log = logging.getLogger(__name__)


def _cuda(device) -> torch.device | None:
    """The CUDA device whose RNG a checkpoint carries: the run's (``cuda:N``, ``cuda`` as its current index), never
    whichever device happens to be current in this thread; None when the run is not on CUDA."""
    d = torch.device(device) if device is not None else None
    if d is None or d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def save(store: Store, visit_key: str, step: int, params: dict[str, torch.Tensor], optim_state: dict,
         meta: dict[str, Any], rng_device: str | torch.device | None = None) -> dict:
    """Write one checkpoint; returns the pointer written. ``meta`` must be JSON (loop state, cursor...);
    ``rng_device``: the run's device, whose CUDA RNG state the checkpoint carries beside the CPU's."""
    tensors = {f"param/{k}": v.detach().to("cpu").contiguous() for k, v in params.items()}
    tensors["rng/torch"] = torch.get_rng_state()
    cuda = _cuda(rng_device)
    if cuda is not None:
        tensors["rng/cuda"] = torch.cuda.get_rng_state(cuda)
    pbytes = st_save(tensors)
    buf = io.BytesIO()
    torch.save(_to_cpu(optim_state), buf)
    obytes = buf.getvalue()
    d = train_ckpt_key(visit_key)
    try:
        old = read_pointer(store, visit_key)
    except TrainCheckpointError:  # replaced below; its files go with the listing, whatever it named
        old = None
    pfile, ofile = f"params-{step}.safetensors", f"optim-{step}.pt"
    store.write_bytes(pbytes, d, pfile)
    store.write_bytes(obytes, d, ofile)
    previous = old if old and old["step"] != step else (old or {}).get("previous")
    pointer = {"step": step, "params": pfile, "params_sha256": sha256_bytes(pbytes),
               "optim": ofile, "optim_sha256": sha256_bytes(obytes), "meta": meta,
               "previous": {k: previous[k] for k in _ENTRY} if previous else None}
    store.write_json(pointer, d, POINTER)  # the commit point of a checkpoint
    keep = {POINTER, pfile, ofile, *((previous["params"], previous["optim"]) if previous else ())}
    for name in store.listdir(d):  # older checkpoints, and what a writer that died left half-written
        if name not in keep:
            store.rm(d, name)
    return pointer


def load(store: Store, visit_key: str, device: str | torch.device = "cpu", base_version: int | None = None,
         rng_device: str | torch.device | None = None):
    """(pointer entry, params, optimizer state) of the newest intact checkpoint of the visit (made on
    ``base_version`` when given), or None: none, or none intact. A damaged one is skipped for the one before it (or
    the visit's start), said in one warning line; the torch RNG state is the chosen checkpoint's (the CUDA one on
    ``rng_device``, the run's device)."""
    d = train_ckpt_key(visit_key)
    try:
        pointer = read_pointer(store, visit_key)
    except TrainCheckpointError as e:
        log.warning("%s", e)
        return None
    entries = [e for e in (pointer, (pointer or {}).get("previous")) if e is not None
               and (base_version is None or e["meta"].get("base_version") == base_version)]
    damaged = []
    for entry in entries:
        try:
            params, optim_state = _read(store, d, entry, device, rng_device)
        except TrainCheckpointError as e:
            damaged.append(str(e))
            continue
        if damaged:
            log.warning("%s: the visit goes on from its checkpoint of step %d", "; ".join(damaged), entry["step"])
        return entry, params, optim_state
    if damaged:
        log.warning("%s: the visit starts over%s", "; ".join(damaged), _SHORTCUT)
    return None


def _read(store: Store, d: str, entry: dict, device, rng_device=None) -> tuple[dict[str, torch.Tensor], dict]:
    """One checkpoint's parameters and optimizer state, both files checked against the pointer's sha256 and
    loaded; the torch RNG state set from it. TrainCheckpointError naming the file otherwise."""
    data = {}
    for k in ("params", "optim"):
        try:
            data[k] = store.read_bytes(d, entry[k])
        except FileNotFoundError:
            raise TrainCheckpointError(f"checkpoint file {store.url_of(d, entry[k])} is missing") from None
        if sha256_bytes(data[k]) != entry[f"{k}_sha256"]:
            raise TrainCheckpointError(f"checkpoint file {store.url_of(d, entry[k])} is corrupt (sha256 mismatch)")
    try:
        tensors = st_load(data["params"])
        optim_state = torch.load(io.BytesIO(data["optim"]), map_location=device, weights_only=True)
        rng = tensors.pop("rng/torch")
    except Exception as e:  # noqa: BLE001 - bytes that match their sha256 yet do not load: a broken writer's
        raise TrainCheckpointError(f"checkpoint of step {entry['step']} in {store.url_of(d)} does not load "
                                   f"({type(e).__name__})") from None
    torch.set_rng_state(rng)
    cuda_rng, cuda = tensors.pop("rng/cuda", None), _cuda(rng_device)
    if cuda_rng is not None and cuda is not None:
        torch.cuda.set_rng_state(cuda_rng, cuda)
    return {k.removeprefix("param/"): v.to(device) for k, v in tensors.items()}, optim_state


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
