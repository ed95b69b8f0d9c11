"""Flow parameters as one flat pydantic model, so the Prefect UI renders an editable form (docs/CONVENTIONS.md 3).

``RunParams`` is generated from ``RunConfig``'s sections: ``bcd.blocks`` becomes the field
``bcd_blocks``, with the same type, default, constraints and docstring; top-level keys (``seed``,
``store``, ...) keep their names. Names with a fixed set of values become dropdowns. Values are checked
in full where they are turned back into a ``RunConfig`` (``to_config``), so a deployment run and a CLI
run reject the same input with the same message naming ``section.key``.

    RunParams.from_config(cfg).to_config() == cfg
"""
from __future__ import annotations

import copy
import uuid
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from bcdflow.core.config import RunConfig, parse_config

# flat name -> dotted config key, in RunConfig's order
KEYS: dict[str, str] = {}


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _fields() -> dict[str, tuple[Any, Any]]:
    out = {}
    for sec, sec_field in RunConfig.model_fields.items():
        items = (sec_field.annotation.model_fields.items() if _is_section(sec_field.annotation)
                 else [(None, sec_field)])
        for name, f in items:
            dotted = f"{sec}.{name}" if name else sec
            flat = dotted.replace(".", "_")
            info = copy.copy(f)
            info.description = f"`{dotted}`" + (f": {f.description}" if f.description else "")
            out[flat] = (f.annotation, info)  # a Literal field (core/config.py) is a dropdown in the form
            KEYS[flat] = dotted
    return out


class _Flat(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _accept_nested(cls, data):
        """Python callers may pass a RunConfig or its nested dict (``cfg.model_dump()``) as well."""
        if isinstance(data, RunConfig):
            data = data.model_dump()
        if isinstance(data, dict) and any(isinstance(v, dict) for v in data.values()):
            return _flatten(data)
        return data

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "RunParams":
        return cls.model_validate(_flatten(cfg.model_dump()))

    def nested(self) -> dict:
        tree: dict = {}
        for flat, dotted in KEYS.items():
            *secs, key = dotted.split(".")
            node = tree
            for s in secs:
                node = node.setdefault(s, {})
            node[key] = getattr(self, flat)
        return tree

    def to_config(self) -> RunConfig:
        """The validated run config; a ConfigError names the ``section.key`` at fault."""
        return parse_config(self.nested())


def _flatten(nested: dict) -> dict:
    """``{"bcd": {"blocks": 3}, "seed": 0}`` -> ``{"bcd_blocks": 3, "seed": 0}``."""
    sections = {k for k, f in RunConfig.model_fields.items() if _is_section(f.annotation)}
    out = {}
    for k, v in nested.items():
        if k in sections and isinstance(v, dict):
            out.update({f"{k}_{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


RunParams = create_model("RunParams", __base__=_Flat, __doc__="A bcdflow run configuration, one field per "
                         "config key (`section.key` -> `section_key`).", **_fields())


def new_run_id(mode: str, when: datetime | None = None, salt: str | None = None) -> str:
    """``bcd-20250101-120000-1a2b``: sortable by start time, unique across machines. Given a Prefect flow run's
    scheduled start and id (``when``, ``salt``) it is reproducible, so the flow run's name and its body agree."""
    stamp = (when or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{mode}-{stamp}-{(salt or uuid.uuid4().hex).replace('-', '')[:4]}"
