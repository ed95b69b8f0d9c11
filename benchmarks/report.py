"""The report: every measured figure beside the paper's, with PASS/MISS against the issue's targets.

A benchmark returns a result dict with ``claims`` (rows of the summary table), ``markdown`` (its own
section) and ``plots`` (PNG file names in the output directory). This module renders the summary table for
the terminal and for report.md, writes results.json, and keeps the plotting boilerplate in one place.
A miss is reported, never raised (docs/CONVENTIONS.md 10).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from bcdflow.tracking.tables import _fmt, md_table  # noqa: E402,F401

CLAIM_COLUMNS = [("benchmark", "benchmark"), ("figure", "figure"), ("measured", "measured here"),
                 ("paper", "paper"), ("target", "target"), ("verdict", "verdict")]


def claim(benchmark: str, figure: str, value, fmt: str = ".2f", paper: str = "–", target: str = "–",
          passed: bool | None = None, note: str = "") -> dict:
    """One row of the summary: ``passed`` None = no target (reported only)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        shown = "n/a"
    elif isinstance(value, str):
        shown = value
    else:
        shown = format(value, fmt)
    verdict = "–" if passed is None else ("PASS" if passed else "MISS")
    return {"benchmark": benchmark, "figure": figure, "value": value, "measured": shown + (f" {note}" if note else ""),
            "paper": paper, "target": target, "passed": passed, "verdict": verdict}


# one markdown table writer for the product's Prefect artifacts and this report
fmt = _fmt


def text_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain fixed-width table for the terminal."""
    cells = [[h for _, h in columns]] + [[str(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def summary_table(claims: list[dict]) -> str:
    return text_table(claims, CLAIM_COLUMNS)


def markdown(meta: dict, results: dict[str, dict], claims: list[dict]) -> str:
    m = meta["machine"]
    dev = m["gpu"] or m["cpu"]
    head = [f"# bcdflow benchmarks ({meta['profile']})", "",
            f"`{meta['command']}` on {dev} ({m['device']}), torch {m['torch']}, {m['threads']} threads "
            f"(of {m['cpu_count']} CPUs; 1-minute load {fmt(m.get('load_avg_1m'), '.1f')} at the start), "
            f"{meta['started']}, {meta['seconds']:.0f} s.", "",
            "Every figure is a ratio measured side by side in this one run (configurations taking turns step "
            "by step), next to the paper's figure (T2 = the paper's Table 2, ...) and the issue's target. A MISS "
            "is reported, never an error.", "", "## Summary", "",
            md_table(claims, [(k, h, "s") for k, h in CLAIM_COLUMNS]), ""]
    body = []
    for name, res in results.items():
        if res.get("error"):
            body += [f"## {name}", "", f"**error**: `{res['error']}`", ""]
            continue
        body += [res.get("markdown", f"## {name}\n"), ""]
        body += [f"![{p}]({p})" for p in res.get("plots", [])] + [""]
    return "\n".join(head + body)


def write(out: Path, meta: dict, results: dict[str, dict], claims: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    clean = {k: {kk: vv for kk, vv in v.items() if kk != "markdown"} for k, v in results.items()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "claims": claims, "results": clean},
                                                 indent=2, default=_json_default))
    (out / "report.md").write_text(markdown(meta, results, claims))


def write_json(path: str | Path, result: dict) -> Path:
    """A standalone benchmark's result (``python benchmarks/<name>.py``) as JSON at ``path`` (folders made), and
    where it went on the terminal, with the benchmark's wall time (``wall_s``) when it has one."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=_json_default))
    print(f"wrote {out}" + (f" ({result['wall_s']:.0f} s)" if "wall_s" in result else ""))
    return out


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def save(fig, out: Path, name: str) -> str:
    """Write ``fig`` as ``out/name`` (PNG) and close it; returns the file name."""
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def figure(*args, **kwargs):
    return plt.subplots(*args, **kwargs)
