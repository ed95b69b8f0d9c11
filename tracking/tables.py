"""Markdown tables of a run's or a comparison's figures (``bcdflow compare``, the benchmarks' reports). Imports
nothing heavy, so a read-only command that prints one answers at once.

    md_table([{"run": "a", "loss": 4.2}], [("run", "run", "s"), ("loss", "val loss", ".4f")])
"""
from __future__ import annotations


def _fmt(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and v != v):  # None or NaN
        return "–"
    try:
        return format(v, fmt)
    except (TypeError, ValueError):
        return str(v)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A GitHub-markdown table of ``rows`` with ``columns`` = (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "| " + " | ".join("---" if f == "s" else "---:" for _, _, f in columns) + " |"]
    lines += ["| " + " | ".join(_fmt(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def strict_json(obj, indent: int | None = 2) -> str:
    """``obj`` as strict JSON (RFC 8259 has no NaN or Infinity, which ``json.dumps`` would write and other parsers
    refuse): a non-finite float is written as null, what it means where bcdflow prints one (no figure). Every
    ``--json`` output goes through this."""
    import json
    import math

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), indent=indent, allow_nan=False)
