"""Compare runs by loss and by cost: ``bcdflow compare RUN RUN [...]`` and the ``compare_runs`` flow.

Everything is read from the store's state.json and config.json (no MLflow needed). The first run is
the baseline. The *best common validation loss* L* is the worst of the runs' best validation losses:
the lowest loss every run reaches. For each run: the steps, tokens, wall seconds, GPU-hours and USD
it needed to first reach L* (curves: one point per BCD visit, the baseline's ``val_points`` in between,
costed pro rata by step); its steps over the baseline's is the paper's B-F multiplier (§4.2.3). The
what-if cost prices a run's GPU-hours to L* on every device kind of the catalog, and the cost-reduction
tables set each run as configured against the baseline on each kind, like the paper's Tables 5-7
(BCD on RTX 4090 against full-parameter training on 4090 / A100 / A800).

    from bcdflow.flows.compare import compare
    result = compare(store, ["bcd-1", "full-1"])     # plain function; result["markdown"] is the table
"""
from __future__ import annotations

from prefect import flow

from bcdflow.core import spend
from bcdflow.core.config import RunConfig, SpendSection
from bcdflow.core.context import open_store
from bcdflow.errors import BadInput
from bcdflow.flows import artifacts
from bcdflow.storage import runs
from bcdflow.storage.store import Store, raise_naming
from bcdflow.tracking.report import md_table

RUN_COLUMNS = [
    ("run_id", "run", "s"), ("mode", "mode", "s"), ("device", "device", "s"),
    ("final_val_loss", "final val", ".4f"), ("best_val_loss", "best val", ".4f"),
    ("steps_to_target", "steps to L*", "d"), ("tokens_to_target", "tokens to L*", ",.0f"),
    ("bf_multiplier", "B-F ×", ".2f"), ("tokens_multiplier", "tokens ×", ".2f"),
    ("wall_seconds", "wall s", ".1f"), ("gpu_hours", "GPU-h", ".5f"), ("spend_usd", "spend $", ".5f"),
    ("spend_to_target_usd", "$ to L*", ".5f"),
]


class CompareError(BadInput):
    """A run that cannot be compared (missing, or without a committed visit)."""


def _run_summary(store: Store, run_id: str) -> dict:
    state = runs.read_state(store, run_id)
    if state is None:
        raise CompareError(f"run {run_id!r} not found in store {store.url}")
    if not state.visits:
        raise CompareError(f"run {run_id!r} has no committed visit yet")
    cfg = runs.read_config(store, run_id)
    sp = SpendSection.model_validate(cfg.get("spend") or {})
    visits = state.visits
    pts = spend.curve(visits)
    kind, gpus = sp.train_device, sp.train_gpus or (cfg.get("train") or {}).get("gpus", 1)
    return {"run_id": run_id, "mode": state.mode, "spend_cfg": sp, "curve": pts,
            "device": f"{gpus}×{kind}", "stop_reason": state.stop_reason,
            "final_val_loss": visits[-1].val_loss, "best_val_loss": min(p["val_loss"] for p in pts),
            "steps": pts[-1]["step"], "tokens": pts[-1]["tokens"], "wall_seconds": pts[-1]["seconds"],
            "gpu_hours": pts[-1]["gpu_hours"], "spend_usd": pts[-1]["spend_usd"]}


def compare(store: Store, run_ids: list[str]) -> dict:
    """The comparison of ``run_ids`` (the first is the baseline) as a JSON-able dict with its markdown."""
    if len(run_ids) < 2:
        raise CompareError(f"compare needs at least two runs, got {len(run_ids)}")
    rows = [_run_summary(store, r) for r in run_ids]
    prices: dict[str, float] = dict(spend.DEFAULT_PRICES)
    for r in reversed(rows):  # every run's own catalog entries; the baseline's win a conflict
        prices.update(spend.parse_prices(r["spend_cfg"].prices))
    target = max(r["best_val_loss"] for r in rows)
    for r in rows:
        hit = next(p for p in r["curve"] if p["val_loss"] <= target)
        r.update(steps_to_target=hit["step"], tokens_to_target=hit["tokens"],
                 seconds_to_target=hit["seconds"], gpu_hours_to_target=hit["gpu_hours"],
                 spend_to_target_usd=hit["spend_usd"],
                 what_if_usd={k: spend.cost_on(hit["gpu_hours"], k, prices) for k in prices})
    base = rows[0]
    for r in rows:
        r["bf_multiplier"] = r["steps_to_target"] / base["steps_to_target"]
        r["tokens_multiplier"] = (r["tokens_to_target"] / base["tokens_to_target"]
                                  if base["tokens_to_target"] else None)
    # paper Tables 5-7: each run as it ran against the baseline priced on each kind
    reduction = {}
    for kind in prices:
        ref = base["what_if_usd"][kind]
        reduction[kind] = [{"run_id": base["run_id"], "device": f"{base['device'].split('×')[0]}×{kind}",
                            "cost_usd": ref, "reduction": 0.0}]
        reduction[kind] += [{"run_id": r["run_id"], "device": r["device"], "cost_usd": r["spend_to_target_usd"],
                             "reduction": 1 - r["spend_to_target_usd"] / ref if ref else None}
                            for r in rows[1:]]
    out = {"baseline": base["run_id"], "target_val_loss": target, "catalog": prices,
           "runs": [{k: v for k, v in r.items() if k not in ("spend_cfg", "curve")} for r in rows],
           "cost_reduction": reduction}
    out["markdown"] = markdown(out)
    return out


def plot(store: Store, result: dict, path: str) -> list[list[str]]:
    """Draw the compared runs' validation curves against steps and spend, L* marked, into ``path`` (a PNG);
    returns each panel's line labels."""
    from bcdflow.tracking.report import compare_figure

    ids = [r["run_id"] for r in result["runs"]]
    curves = {r: spend.curve(runs.read_state(store, r).visits) for r in ids}
    try:
        return compare_figure(curves, result["target_val_loss"], path)
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


def markdown(result: dict) -> str:
    kinds = list(result["catalog"])
    runs_ = result["runs"]
    parts = [f"### Runs against baseline `{result['baseline']}`\n\nBest common validation loss "
             f"L* = {result['target_val_loss']:.4f} (the lowest loss every run reaches); B-F × = steps to L* "
             "over the baseline's (paper §4.2.3).\n", md_table(runs_, RUN_COLUMNS)]
    what_if = [{"run_id": r["run_id"], "gpu_hours_to_target": r["gpu_hours_to_target"],
                **{k: r["what_if_usd"][k] for k in kinds}} for r in runs_]
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


@flow(name="compare_runs")
def compare_runs(run_ids: list[str], store: str = "./bcdflow-store", s3_endpoint_url: str | None = None) -> dict:
    """Compare runs of one store by loss and cost; the table is published as a markdown artifact."""
    st = open_store(RunConfig(store=store, s3={"endpoint_url": s3_endpoint_url}))
    result = compare(st, run_ids)
    artifacts.publish_markdown(artifacts.artifact_key("compare", "-".join(run_ids))[:200], result["markdown"],
                            description=f"bcdflow compare {' '.join(run_ids)}")
    return result
