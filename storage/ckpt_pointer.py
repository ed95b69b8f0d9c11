"""A mid-visit checkpoint's pointer (``{visit}/train-ckpt/ckpt.json``, written by storage/trainckpt.py), read and
checked without torch: the checkpoint loader and ``bcdflow status`` / the visit's spend (storage/overview.py) read
it through :func:`read_pointer`, so a damaged pointer is the same one-line damage for both.

    pointer = read_pointer(store, visit_key)   # None before the first checkpoint; TrainCheckpointError if damaged
"""
from __future__ import annotations

from bcdflow.errors import DamagedArtifact

from .layout import is_plain_name, train_ckpt_key
from .store import Store

POINTER = "ckpt.json"
_ENTRY = ("step", "params", "params_sha256", "optim", "optim_sha256", "meta")
_SHORTCUT = " (a checkpoint is a shortcut: the committed versions are intact)"


class TrainCheckpointError(DamagedArtifact):
    """A mid-visit checkpoint fails its checksum or does not load."""


def read_pointer(store: Store, visit_key: str) -> dict | None:
    """The visit's checkpoint pointer, None when there is none; TrainCheckpointError when it does not parse or names
    anything but plain file names of its folder (its ``previous`` likewise, else dropped as absent)."""
    d = train_ckpt_key(visit_key)
    if not store.exists(d, POINTER):
        return None
    try:
        pointer = store.read_json(d, POINTER)
        why = _malformed(pointer)
    except (ValueError, UnicodeDecodeError) as e:
        why = f"not valid JSON: {e}"
    if why is not None:
        raise TrainCheckpointError(f"mid-visit checkpoint pointer {store.url_of(d, POINTER)} is damaged ({why}): a "
                                   f"resume starts the visit over{_SHORTCUT}")
    if pointer.get("previous") is not None and _malformed(pointer["previous"]) is not None:
        pointer["previous"] = None
    return pointer


def _malformed(entry) -> str | None:
    """Why a pointer entry is unusable, or None: it must name its two files by plain names (never a path)."""
    if not isinstance(entry, dict) or not all(k in entry for k in _ENTRY):
        return f"it lacks {', '.join(k for k in _ENTRY if not isinstance(entry, dict) or k not in entry)}"
    if not isinstance(entry["step"], int) or isinstance(entry["step"], bool) or not isinstance(entry["meta"], dict):
        return "its step or meta has the wrong type"
    for k in ("params", "optim"):
        if not is_plain_name(entry[k]):
            return f"it names {entry[k]!r}, not a file of its folder"[:200]
    return None
