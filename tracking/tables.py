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
