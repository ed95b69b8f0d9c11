"""Compare runs by loss and by cost: ``bcdflow compare BASELINE RUN [...]`` (the flow is ``flows/compare_flow.py``).

Everything is read from the store's state.json and config.json (no MLflow, no Prefect, no torch: it answers at
once). The first run is the baseline, and the target L* is *its* quality: its best validation loss plus a stated
tolerance (``--tol``, 0.02), or ``--target`` (a loss, ``final`` for its last loss plus the tolerance, ``common``
for the worst of the runs' best losses). A run's curve (``core/spend.curve``: one point per BCD visit, the
baseline's ``val_points`` in between) crosses L* between two validation points, its *bracket*; the crossing is
interpolated linearly within it, and so are the tokens, seconds, GPU-hours and USD to L*. Steps to L* over the
baseline's is the paper's B-F multiplier (§4.2.3), given with the range the two brackets allow, and withheld
(naming the key to rerun with) when either bracket is wider than ``--bracket-tol`` (10%) of its crossing step: a
baseline validated once would otherwise make BCD look faster than it is. A run that never reaches L* gets "not
reached: ended at X after N steps", no multiplier. Beside every multiplier stands the loss gap at equal steps:
the run's validation loss minus the baseline's at the last step both reached. The what-if cost prices a run's
GPU-hours to L* on every device kind of the catalog, and the cost-reduction tables set each run as configured
against the baseline on each kind, like the paper's Tables 5-7.

    from bcdflow.flows.compare import compare
    result = compare(store, ["full-1", "bcd-1"])     # result["markdown"] is the table, result["runs"] the figures
"""
from __future__ import annotations

import math

from bcdflow.core import spend
from bcdflow.errors import BadInput
from bcdflow.storage import runs
from bcdflow.storage.store import Store, raise_naming
from bcdflow.tracking.tables import md_table

TOL, BRACKET_TOL = 0.02, 0.1
COSTS = ("step", "tokens", "seconds", "gpu_hours", "spend_usd")
RUN_COLUMNS = [
    ("run_id", "run", "s"), ("mode", "mode", "s"), ("method", "method", "s"), ("device", "priced as", "s"),
    ("final_val_loss", "final val", ".4f"), ("best_val_loss", "best val", ".4f"), ("steps", "steps", "d"),
    ("to_target", "steps to L* [bracket]", "s"), ("bf", "B-F ×", "s"), ("gap", "gap at equal steps", "s"),
    ("tokens_multiplier", "tokens ×", ".2f"), ("wall_seconds", "wall s", ".1f"), ("gpu_hours", "GPU-h", ".5f"),
    ("spend_usd", "spend $", ".5f"), ("spend_to_target_usd", "$ to L*", ".5f"),
]


class CompareError(BadInput):
    """Runs that cannot be compared (missing, without a committed visit, an unknown --target)."""


def _run_summary(store: Store, run_id: str) -> dict:
    from bcdflow.core.config import read_settings  # torch-free, like the registry below; not for `bcdflow --help`
    from bcdflow.models.optimizers import OPTIMIZERS

    state = runs.read_state(store, run_id)  # every record checked (storage/runs.py): damage names the file
    if state is None:
        raise CompareError(f"run {run_id!r} not found in store {store.url}")
    if not state.visits:
        raise CompareError(f"run {run_id!r} has no committed visit yet")
    cfg = read_settings(store, run_id)  # as the run trained (core/config.stored_config: RunConfig's defaults)
    gpus, kind = spend.priced_as(cfg)
    pts = spend.curve(state.visits)
    optim = cfg.optim.name
    method = optim + ("" if OPTIMIZERS[optim].full_parameter else " (not full-parameter)")
    return {"run_id": run_id, "mode": state.mode, "method": method, "prices": spend.parse_prices(cfg.spend.prices),
            "curve": pts, "window": cfg.bcd.window,
            "device": f"{gpus}×{kind}" + ("*" if kind == spend.DEFAULT_KIND else ""),
            "stop_reason": state.stop_reason, "final_val_loss": state.visits[-1].val_loss,
            "best_val_loss": min(p["val_loss"] for p in pts), "steps": pts[-1]["step"], "tokens": pts[-1]["tokens"],
            "wall_seconds": pts[-1]["seconds"], "gpu_hours": pts[-1]["gpu_hours"], "spend_usd": pts[-1]["spend_usd"]}


def target_of(rows: list[dict], target: str | float | None, tol: float) -> tuple[float, str]:
    """L* and how it was chosen: the baseline's (``rows[0]``) best (default) or ``final`` loss plus ``tol``, the
    worst of the runs' best losses (``common``), or a loss."""
    base = rows[0]
    if target in (None, "best"):
        return base["best_val_loss"] + tol, f"the baseline's best validation loss {base['best_val_loss']:.4f} + {tol:g}"
    if target == "final":
        return base["final_val_loss"] + tol, f"the baseline's final validation loss {base['final_val_loss']:.4f} + {tol:g}"
    if target == "common":
        return max(r["best_val_loss"] for r in rows), "the worst of the runs' best losses (the lowest every run reaches)"
    try:
        value = float(target)
    except (TypeError, ValueError):
        raise CompareError(f"--target: expected best, final, common or a loss, got {target!r}") from None
    if not math.isfinite(value):
        raise CompareError(f"--target: expected a finite loss, got {target!r}")
    return value, "given (--target)"


def crossing(pts: list[dict], target: float) -> tuple[dict, tuple[int, int]] | None:
    """Where a curve first reaches ``target``: its step, tokens, seconds, GPU-hours and USD interpolated linearly
    between the last point above and the first at or below it, and that bracket of steps (from 0 when the first
    point is already below: the loss at step 0 is not measured). None when it never does."""
    for i, p in enumerate(pts):
        if p["val_loss"] <= target:
            if i == 0:
                return {k: p[k] for k in COSTS}, (0, p["step"])
            q = pts[i - 1]
            f = (q["val_loss"] - target) / (q["val_loss"] - p["val_loss"])
            return {k: q[k] + f * (p[k] - q[k]) for k in COSTS}, (q["step"], p["step"])
    return None


def loss_at(pts: list[dict], step: float) -> float | None:
    """The curve's validation loss at ``step``, linear between its points; None before its first point."""
    for q, p in zip([None, *pts], pts):
        if step <= p["step"]:
            if q is None:
                return p["val_loss"] if step == p["step"] else None
            return q["val_loss"] + (step - q["step"]) / (p["step"] - q["step"]) * (p["val_loss"] - q["val_loss"])
    return None


def rerun_hint(r: dict, tol: float) -> str:
    """The key that resolves a run's crossing within ``tol`` of its step when the run is trained again (validation
    happens at window ends, so a cadence finer than ``bcd.window`` needs a finer window too)."""
    every = max(1, int(tol * r["steps_to_target"]))
    key = "train.eval_every" if r["mode"] == "full" else "bcd.eval_every"
    window = f" --set bcd.window={every}" if every < r["window"] else ""
    return f"rerun {r['run_id']} with --set {key}={every}{window}"


def _multiplier(r: dict, base: dict, tol: float) -> None:
    """B-F, its range and the loss gap at equal steps of run ``r`` against ``base``; or why none is given."""
    n = min(r["steps"], base["steps"])
    mine, theirs = loss_at(r["curve"], n), loss_at(base["curve"], n)
    r["gap_at_equal_steps"] = None if mine is None or theirs is None or r is base else mine - theirs
    r["gap_step"] = None if r is base else n
    r["bf_multiplier"] = r["bf_range"] = r["bf_withheld"] = r["tokens_multiplier"] = None
    if not r["reached"] or not base["reached"]:
        r["bf_withheld"] = r["not_reached"] or f"the baseline {base['not_reached']}"
        return
    if r is base:  # the reference itself
        r["bf_multiplier"], r["bf_range"], r["tokens_multiplier"] = 1.0, [1.0, 1.0], 1.0
        return
    wide = [x for x in (base, r) if x["bracket_width"] > tol]
    if wide:
        r["bf_withheld"] = "; ".join(
            f"{x['run_id']} crosses L* between steps {x['bracket'][0]} and {x['bracket'][1]} (more than {tol:.0%} "
            f"of its {x['steps_to_target']:.0f} steps to L*): {rerun_hint(x, tol)}" for x in wide)
        return
    (lo, hi), (blo, bhi) = r["bracket"], base["bracket"]
    r["bf_multiplier"] = r["steps_to_target"] / base["steps_to_target"]
    r["bf_range"] = [lo / bhi, hi / blo if blo else math.inf]
    r["tokens_multiplier"] = r["tokens_to_target"] / base["tokens_to_target"] if base["tokens_to_target"] else None


def check_tolerances(tol: float, bracket_tol: float) -> None:
    """``--tol`` a finite loss >= 0, ``--bracket-tol`` a finite fraction > 0 (bad input, before anything is read)."""
    if not (math.isfinite(tol) and tol >= 0):
        raise CompareError(f"--tol: a finite loss >= 0, got {tol}")
    if not (math.isfinite(bracket_tol) and bracket_tol > 0):
        raise CompareError(f"--bracket-tol: a finite fraction > 0 of a crossing's step, got {bracket_tol}")


def compare(store: Store, run_ids: list[str], target: str | float | None = None, tol: float = TOL,
            bracket_tol: float = BRACKET_TOL) -> dict:
    """The comparison of ``run_ids`` (the first is the baseline) as a JSON-able dict with its markdown. A crossing
    whose bracket is wider than ``bracket_tol`` gives no multiplier, and no cost or saving either: its tokens,
    seconds, GPU-hours and USD to L* (and a baseline's, every run's saving against it) are withheld with it."""
    check_tolerances(tol, bracket_tol)
    if len(run_ids) < 2:
        raise CompareError(f"compare needs at least two runs, got {len(run_ids)}")
    rows = [_run_summary(store, r) for r in run_ids]
    prices: dict[str, float] = dict(spend.DEFAULT_PRICES)
    for r in reversed(rows):  # every run's own catalog entries; the baseline's win a conflict
        prices.update(r["prices"])
    value, rule = target_of(rows, target, tol)
    for r in rows:
        hit = crossing(r["curve"], value)
        r["reached"] = hit is not None
        r["not_reached"] = None if hit else f"not reached: ended at {r['final_val_loss']:.4f} after {r['steps']} steps"
        at, (lo, hi) = hit if hit else ({k: None for k in COSTS}, (None, None))
        width = None if hit is None else (hi - lo) / max(at["step"], 1e-9)
        priced = hit is not None and width <= bracket_tol  # a crossing too imprecise for a multiplier: no cost either
        cost = at if priced else {k: None for k in COSTS}
        r.update(steps_to_target=at["step"], tokens_to_target=cost["tokens"], seconds_to_target=cost["seconds"],
                 gpu_hours_to_target=cost["gpu_hours"], spend_to_target_usd=cost["spend_usd"],
                 bracket=None if hit is None else [lo, hi], bracket_width=width,
                 cost_withheld=None if priced or hit is None else
                 f"its crossing of L* lies between steps {lo} and {hi}, wider than {bracket_tol:.0%} of the step",
                 crossing={"step": at["step"], "spend_usd": at["spend_usd"] if priced else None} if hit else None,
                 what_if_usd={k: spend.cost_on(at["gpu_hours"], k, prices) for k in prices} if priced else None)
    base = rows[0]
    for r in rows:
        _multiplier(r, base, bracket_tol)
    # paper Tables 5-7: each run as it ran against the baseline priced on each kind
    reduction = {}
    for kind in prices:
        ref = base["what_if_usd"][kind] if base["what_if_usd"] else None
        reduction[kind] = [{"run_id": base["run_id"], "device": f"{base['device'].split('×')[0]}×{kind}",
                            "cost_usd": ref, "reduction": 0.0 if ref is not None else None}]
        reduction[kind] += [{"run_id": r["run_id"], "device": r["device"], "cost_usd": r["spend_to_target_usd"],
                             "reduction": 1 - r["spend_to_target_usd"] / ref
                             if ref and r["spend_to_target_usd"] is not None else None}
                            for r in rows[1:]]
    out = {"baseline": base["run_id"], "target_val_loss": value, "target_rule": rule, "bracket_tol": bracket_tol,
           "catalog": prices, "runs": [{k: v for k, v in r.items() if k not in ("prices", "curve", "window")}
                                       for r in rows],
           "cost_reduction": reduction}
    out["markdown"] = markdown(out)
    return out


def plot(store: Store, result: dict, path: str) -> list[list[str]]:
    """Draw the compared runs' validation curves against steps and spend, L* and each run's crossing of it marked,
    into ``path`` (a PNG); returns each panel's line labels."""
    from bcdflow.tracking.figures import compare_figure  # matplotlib: only when a plot is asked for

    curves = {r["run_id"]: spend.curve(runs.read_state(store, r["run_id"]).visits) for r in result["runs"]}
    crossings = {r["run_id"]: r["crossing"] for r in result["runs"] if r["crossing"]}
    try:
        return compare_figure(curves, result["target_val_loss"], path, crossings)
    except Exception as e:  # a full disk: matplotlib's error names no file
        raise_naming(e, path)


def check_plot_path(path: str) -> None:
    """``--plot``: a .png whose directory exists (checked before anything is read)."""
    import os

    if not path.lower().endswith(".png"):
        raise BadInput(f"--plot: {path!r} is not a .png file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadInput(f"--plot: directory {folder} does not exist (create it first)")
    if os.path.isdir(path):
        raise BadInput(f"--plot: {path} is a directory")


def _cells(r: dict) -> dict:
    """A run's row as the table prints it: the crossing with its bracket, B-F with its range, the gap."""
    cells = dict(r)
    if r["reached"]:
        cells["to_target"] = f"{r['steps_to_target']:.0f} [{r['bracket'][0]}–{r['bracket'][1]}]"
    else:
        cells["to_target"] = r["not_reached"]
    if r["bf_multiplier"] is not None:
        lo, hi = r["bf_range"]
        cells["bf"] = f"{r['bf_multiplier']:.2f} [{lo:.2f}–{hi:.2f}]" if hi > lo else f"{r['bf_multiplier']:.2f}"
    else:
        cells["bf"] = "–"
    if r["gap_at_equal_steps"] is not None:
        cells["gap"] = f"{r['gap_at_equal_steps']:+.4f} at step {r['gap_step']}"
    return cells


def markdown(result: dict) -> str:
    kinds = list(result["catalog"])
    runs_ = result["runs"]
    parts = [f"### Runs against baseline `{result['baseline']}`\n\nL* = {result['target_val_loss']:.4f}: "
             f"{result['target_rule']}. Steps to L* are interpolated between the validation points that bracket "
             f"the crossing; B-F × = steps to L* over the baseline's (paper §4.2.3), with the range the brackets "
             f"allow, given when both brackets are within {result['bracket_tol']:.0%} of their step; the gap is the "
             "run's validation loss minus the baseline's at the same step.\n",
             md_table([_cells(r) for r in runs_], RUN_COLUMNS)]
    notes = [f"- **{r['run_id']}**: B-F not given: {r['bf_withheld']}" for r in runs_[1:] if r["bf_withheld"]]
    if any(r["device"].endswith("*") for r in runs_):
        notes.append(f"- \\* {spend.DEFAULT_KIND} is the default price kind (`spend.train_device`, "
                     "`spend.preinfer_device`, `spend.eval_device`): set the device you rent, whatever trained")
    if notes:
        parts += ["", *notes]
    what_if = [{"run_id": r["run_id"], "gpu_hours_to_target": r["gpu_hours_to_target"],
                **{k: (r["what_if_usd"] or {}).get(k) for k in kinds}} for r in runs_]
    parts += ["\n### What-if cost to reach L* on each device kind (USD)\n",
              md_table(what_if, [("run_id", "run", "s"), ("gpu_hours_to_target", "GPU-h to L*", ".5f")]
                       + [(k, f"{k} (${result['catalog'][k]:g}/h)", ".5f") for k in kinds])]
    parts.append("\n### Cost reduction against the baseline (like paper Tables 5-7)")
    for k in kinds:
        rows = [{**r, "reduction": None if r["reduction"] is None else 100 * r["reduction"]}
                for r in result["cost_reduction"][k]]
        parts += [f"\nBaseline on **{k}**, every other run as it ran:\n",
                  md_table(rows, [("run_id", "run", "s"), ("device", "N×GPU", "s"),
                                  ("cost_usd", "cost $ to L*", ".5f"), ("reduction", "cost ↓ %", ".1f")])]
    return "\n".join(parts) + "\n"
