"""What a run reports besides its metrics: markdown tables and the figures logged to MLflow.

Figures (matplotlib, Agg): training loss over steps with each visit's span coloured by block, validation
loss against cumulative spend, spend by stage per visit; and ``compare_figure``, the validation curves of
compared runs against steps and spend (``bcdflow compare --plot``), drawn by the same ``val_loss_axes``.
``log_run_outputs`` logs them and (``log_model``) the exported final model to the run's MLflow run. Prefect's artifacts are ``flows/artifacts.py``.
"""
from __future__ import annotations

import os
import tempfile

import matplotlib

matplotlib.use("Agg")  # headless workers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from bcdflow.core import spend as spend_mod  # noqa: E402
from bcdflow.core.context import open_store  # noqa: E402
from bcdflow.core.export import export_hf, export_version  # noqa: E402
from bcdflow.storage import runs  # noqa: E402
from bcdflow.storage.runs import VisitRecord  # noqa: E402
from bcdflow.tracking.tracker import Tracker  # noqa: E402


# -- figures ------------------------------------------------------------------------------------

def _block_colors(visits: list[VisitRecord]) -> dict[int, tuple]:
    cmap = plt.get_cmap("tab10")
    return {b: cmap(i % 10) for i, b in enumerate(sorted({v.block for v in visits}))}


def figures(visits: list[VisitRecord], train_loss: list[tuple[int, float]], out_dir: str) -> list[str]:
    """Write the run's three figures as PNGs into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    colors = _block_colors(visits)
    pts = spend_mod.curve(visits)
    paths = []

    # 1. training loss over global steps; each visit's span shaded in its block's colour
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen: set[int] = set()
    for v in visits:
        end, b = v.step_end, v.block
        ax.axvspan(end - v.steps, end, color=colors[b], alpha=0.15, lw=0,
                   label=None if b in seen else f"block {b}")
        ax.axvline(end, color=colors[b], lw=0.6, alpha=0.6)
        seen.add(b)
    if train_loss:
        ax.plot(*zip(*train_loss), color="black", lw=0.8, label="train loss")
    if pts:
        ax.plot([p["step"] for p in pts], [p["val_loss"] for p in pts], "o-", color="tab:red", ms=3,
                lw=1, label="val loss")
    ax.set(xlabel="step", ylabel="loss", title="Loss over steps (visits shaded by block)")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir, "loss_over_steps.png"))

    # 2. validation loss against cumulative spend
    fig, ax = plt.subplots(figsize=(6, 4.5))
    val_loss_axes(ax, {"": pts}, "spend_usd", block_colors=colors)
    paths.append(_save(fig, out_dir, "val_loss_vs_spend.png"))

    # 3. spend by stage, one stacked bar per visit
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(visits) + 2), 4.5))
    labels = [f"c{v.cycle}-b{v.block}" for v in visits]
    bottom = [0.0] * len(visits)
    for stage, color in zip(spend_mod.STAGES, ("tab:blue", "tab:orange", "tab:green")):
        vals = [getattr(v, f"spend_{stage}_usd") for v in visits]
        ax.bar(labels, vals, bottom=bottom, color=color, label=stage)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set(xlabel="visit", ylabel="USD", title="Spend by stage")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir, "spend_by_stage.png"))
    return paths


X_LABELS = {"step": "step", "spend_usd": "cumulative spend (USD)", "tokens": "tokens", "seconds": "wall seconds"}


def val_loss_axes(ax, curves: dict[str, list[dict]], x: str, target: float | None = None,
                  block_colors: dict[int, tuple] | None = None) -> None:
    """Validation loss against ``x`` (a key of ``core.spend.curve``'s points: step, spend_usd, ...) on ``ax``, one
    line per run of ``curves`` (run -> points); one run with ``block_colors``: a grey line, each point in its
    block's colour (the run's own figure). ``target``: L* as a dashed line. The one drawing of validation curves,
    for a run's MLflow figures and for ``bcdflow compare --plot``."""
    for name, pts in curves.items():
        if not pts:
            continue
        xs, ys = [p[x] for p in pts], [p["val_loss"] for p in pts]
        if block_colors is not None:
            ax.plot(xs, ys, "-", color="gray", lw=0.8)
            for p in pts:
                ax.plot(p[x], p["val_loss"], "o", color=block_colors[p["block"]], ms=4)
        else:
            ax.plot(xs, ys, "o-", ms=3, lw=1, label=name)
    if target is not None:
        ax.axhline(target, color="black", ls="--", lw=0.8, label=f"L* = {target:.4f}")
    ax.set(xlabel=X_LABELS.get(x, x), ylabel="validation loss", title=f"Validation loss vs {X_LABELS.get(x, x)}")
    if block_colors is None:
        ax.legend(fontsize="small")
    else:  # each point is the version a visit committed: its colour says which block that visit trained
        from matplotlib.lines import Line2D

        ax.legend(handles=[Line2D([], [], ls="", marker="o", ms=5, color=c, label=f"after a visit of block {b}")
                           for b, c in sorted(block_colors.items())], fontsize="small")


def compare_figure(curves: dict[str, list[dict]], target: float, path: str,
                   crossings: dict[str, dict] | None = None) -> list[list[str]]:
    """``bcdflow compare --plot``: validation loss of each run against steps and against spend, side by side, L*
    marked, and where each run crosses it (``crossings``: run -> its interpolated ``step`` and ``spend_usd``, a
    cross in the run's colour); written to ``path`` (the format from its suffix). Returns each panel's line
    labels."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, x in zip(axes, ("step", "spend_usd")):
        val_loss_axes(ax, curves, x, target)
        colors = {ln.get_label(): ln.get_color() for ln in ax.get_lines()}
        for name, at in (crossings or {}).items():
            if at.get(x) is None:  # withheld (a crossing too imprecise to price): no mark on that axis
                continue
            ax.plot(at[x], target, "X", ms=10, color=colors.get(name, "black"), label=f"{name} reaches L*")
        ax.legend(fontsize="small")
    labels = [[ln.get_label() for ln in ax.get_lines()] for ax in axes]
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the run's MLflow outputs -------------------------------------------------------------------

def log_run_outputs(cfg, run_id: str, mlflow_run: str, version: int) -> None:
    """Log the figures and (``log_model``) the exported final model to the run's MLflow run: a run that started
    from a Hugging Face checkpoint logs the Hugging Face directory (``bcdflow export --format hf``), others
    the bcdflow format."""
    tracker = Tracker(cfg.resolved_tracking_uri(), cfg.experiment)
    store = open_store(cfg)
    visits = runs.read_state(store, run_id).visits
    with tempfile.TemporaryDirectory(prefix="bcdflow-report-") as tmp:
        figures(visits, tracker.history(mlflow_run, "train_loss"), os.path.join(tmp, "figures"))
        tracker.artifact(mlflow_run, os.path.join(tmp, "figures"), "figures")
        if cfg.log_model:
            export = export_hf if cfg.model.from_hf else export_version
            export(store, run_id, version, os.path.join(tmp, "model"))
            tracker.artifact(mlflow_run, os.path.join(tmp, "model"), "model")
