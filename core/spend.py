"""Spend: what a run's GPUs cost (docs/DESIGN.md §7; paper §4.4.2 economic cost analysis).

A price catalog gives USD per GPU-hour per device kind; each stage of a visit (pre-inference,
training, evaluation) runs on a configured kind and GPU count. The spend of a stage is

    wall seconds x GPUs x price / 3600

so a visit record carries, per stage, its GPU-hours and USD, and the run's cumulative spend. The
budget rule predicts the next visit's spend from the last visit of the same block (blocks differ in
size and in pre-inference depth), else from the last visit. Pure functions over visit records: no
Prefect, no MLflow; ``spend`` is anything with the ``spend`` config section's attributes.

A visit interrupted and resumed is billed for every attempt (:class:`Earlier`, :func:`earlier_attempts`): the
mid-visit checkpoint carries what the visit had spent when it was written (:func:`spent_at`), and what an attempt
did after its last checkpoint (work done again by the next attempt) is counted up to the last write of its visit
lease (a renewal, every third of ``fleet.lease_seconds``, or its release) and reported apart as ``lost_seconds``.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

from bcdflow.storage.runs import VisitRecord

# paper §4.4.2: rental prices per GPU-hour
DEFAULT_PRICES: dict[str, float] = {"rtx4090": 0.29, "a800": 0.69, "a100": 1.20}
"""USD per GPU-hour by device kind, the paper's. Each kind has the planner's time-model rates too
(models/specs.CARD_RATES, which knows more kinds: h100, h200, l40s, ...; those are priced by the run, ``spend.prices``,
since rental prices move and the paper gives none)."""
DEFAULT_KIND = "rtx4090"
"""The device kind every stage is priced as unless ``spend.*_device`` says otherwise (a CPU trial too)."""
STAGES = ("preinfer", "train", "eval")


def priced_as(cfg) -> tuple[int, str]:
    """(GPUs, device kind) a run's training is priced as (a ``RunConfig``, a stored run's as
    ``core/config.stored_config`` reads it back: ``spend.train_gpus`` or ``train.gpus``, ``spend.train_device``);
    ``bcdflow status`` and ``compare`` mark the kind when it is :data:`DEFAULT_KIND`."""
    return cfg.spend.train_gpus or cfg.train.gpus, cfg.spend.train_device
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_prices(entries: list[str]) -> dict[str, float]:
    """``["h100=2.49", "a100=1.1"]`` -> ``{"h100": 2.49, "a100": 1.1}``; ValueError names the bad entry."""
    out: dict[str, float] = {}
    for e in entries:
        kind, sep, usd = str(e).partition("=")
        kind = kind.strip()
        try:
            price = float(usd)
        except ValueError:
            price = -1.0
        if not sep or not _KIND.match(kind) or not price >= 0:
            raise ValueError(f"expected KIND=USD_PER_GPU_HOUR (e.g. h100=2.49), got {e!r}")
        out[kind] = price
    return out


def catalog(spend) -> dict[str, float]:
    """The paper's defaults with the run's additions and overrides."""
    return {**DEFAULT_PRICES, **parse_prices(spend.prices)}


def gpus_used(cfg) -> dict[str, int]:
    """The GPU count each stage of a run of ``cfg`` occupies: a visit's box has ``train.gpus`` GPUs (on each of
    ``train.nodes`` machines), billed for its pre-inference (unless that goes to a Dask cluster), training and
    validation alike."""
    box = cfg.train.world
    fl = cfg.fleet
    pre = (fl.dask_workers if not fl.dask_address else 1) if fl.preinfer == "dask" else box
    return {"preinfer": pre, "train": box, "eval": box}


def stage_plan(spend, used: dict[str, int] | None = None) -> dict[str, tuple[str, int]]:
    """stage -> (device kind, GPU count): ``spend.{stage}_gpus`` when set, else what the run uses (``used``,
    from :func:`gpus_used`), else 1."""
    return {s: (getattr(spend, f"{s}_device"), getattr(spend, f"{s}_gpus") or (used or {}).get(s, 1))
            for s in STAGES}


def stage_cost(seconds: float, gpus: int, usd_per_gpu_hour: float) -> float:
    return seconds * gpus * usd_per_gpu_hour / 3600.0


def visit_spend(spend, stage_seconds: dict[str, float], seconds: float,
                used: dict[str, int] | None = None) -> dict[str, float]:
    """Per-stage GPU-hours and USD of one visit from its stages' wall seconds (``stage_seconds[stage]``) and
    its whole wall time ``seconds``; the ``gpu_hours_*`` / ``spend_*`` fields of a :class:`VisitRecord`.
    ``used``: the GPU counts the run occupies (:func:`gpus_used`) where the config does not set them."""
    prices = catalog(spend)
    out: dict[str, float] = {}
    # the visit's wall time outside its stages (orchestration, commit, store I/O) still holds the
    # training machine: a rental bills wall clock, so it is charged to the train stage
    other = max(0.0, seconds - sum(stage_seconds.get(s, 0.0) for s in STAGES))
    for stage, (kind, gpus) in stage_plan(spend, used).items():
        secs = stage_seconds.get(stage, 0.0) + (other if stage == "train" else 0.0)
        out[f"gpu_hours_{stage}"] = secs * gpus / 3600.0
        out[f"spend_{stage}_usd"] = stage_cost(secs, gpus, prices[kind])
    out["gpu_hours"] = sum(out[f"gpu_hours_{s}"] for s in STAGES)
    out["spend_usd"] = sum(out[f"spend_{s}_usd"] for s in STAGES)
    return out


def earlier_usd(spend, earlier: "Earlier", used: dict[str, int] | None = None) -> float:
    """What a visit's earlier attempts cost (their pre-inference at its price, the rest at training's)."""
    return visit_spend(spend, {"preinfer": earlier.preinfer}, earlier.wall, used)["spend_usd"]


def total_spend(visits: list[VisitRecord]) -> float:
    return sum(v.spend_usd for v in visits)


def predicted_cost(visits: list[VisitRecord], block: int) -> float:
    """The next visit of ``block`` costs what its last visit did; a first visit, what the last visit did."""
    same = [v for v in visits if v.block == block]
    last = same[-1] if same else (visits[-1] if visits else None)
    return last.spend_usd if last is not None else 0.0


def over_budget(spend, visits: list[VisitRecord], block: int) -> str | None:
    """Why a visit of ``block`` must not start under ``spend.budget_usd``, or None when it may."""
    if spend.budget_usd is None:
        return None
    spent = total_spend(visits)
    left = spend.budget_usd - spent
    need = predicted_cost(visits, block)
    if left <= 0 or need > left:
        return (f"the next visit of block {block} is predicted at ${need:.4f} but only ${max(left, 0):.4f} "
                f"of the ${spend.budget_usd:g} budget is left (spent ${spent:.4f})")
    return None


def cost_on(gpu_hours: float, kind: str, prices: dict[str, float]) -> float:
    """What-if: the cost of ``gpu_hours`` had every stage run on device ``kind``."""
    return gpu_hours * prices[kind]


def curve(visits: list[VisitRecord]) -> list[dict]:
    """The run's validation curve with cumulative steps, tokens, wall seconds, GPU-hours and USD at each
    point: one point per visit (its ``val_loss`` at ``step_end``), plus a visit's intermediate
    ``val_points`` (the baseline validates every ``train.eval_every`` steps), costed pro rata by step."""
    out: list[dict] = []
    acc = {"step": 0, "tokens": 0.0, "seconds": 0.0, "gpu_hours": 0.0, "spend_usd": 0.0}
    for v in visits:
        start = v.step_end - v.steps
        cost = {"tokens": float(v.tokens), "seconds": v.seconds, "gpu_hours": v.gpu_hours, "spend_usd": v.spend_usd}
        pts = {s: val for s, val in v.val_points if start < s < v.step_end}
        pts[v.step_end] = v.val_loss
        for s in sorted(pts):
            f = (s - start) / v.steps if v.steps else 1.0
            out.append({"cycle": v.cycle, "block": v.block, "step": s, "val_loss": pts[s],
                        **{k: acc[k] + f * cost[k] for k in cost}})
        acc = {"step": v.step_end, **{k: acc[k] + cost[k] for k in cost}}
    return out


@dataclass(frozen=True)
class Earlier:
    """What the earlier attempts of a visit spent, in seconds (docs/DESIGN.md §7): ``wall`` (the lost ones
    included), ``preinfer`` of it, and ``lost``: seconds after an attempt's last checkpoint, done again since."""
    wall: float = 0.0
    preinfer: float = 0.0
    lost: float = 0.0

    def clock(self, preinfer: float, since: float | None = None) -> dict:
        """What this attempt's checkpoints carry (:func:`spent_at`): the earlier attempts' seconds, this attempt's
        pre-inference ``preinfer`` seconds, and its start ``since`` (epoch seconds)."""
        return {**asdict(self), "preinfer": self.preinfer + preinfer, "since": time.time() if since is None else since}


def spent_at(clock: dict, now: float | None = None) -> dict:
    """The visit's spend so far as a mid-visit checkpoint records it: wall seconds of every attempt up to ``now``
    (epoch seconds), pre-inference and lost seconds among them, and ``at`` = ``now``."""
    now = time.time() if now is None else now
    return {"wall": clock["wall"] + max(0.0, now - clock["since"]), "preinfer": clock["preinfer"],
            "lost": clock["lost"], "at": now}


def earlier_attempts(checkpoint: dict | None, started: dict | None, previous_end: float | None) -> Earlier:
    """What a visit spent before this attempt. ``checkpoint``: the ``spent`` of its mid-visit checkpoint
    (:func:`spent_at`), ``started``: what the previous attempt knew when it started (the same fields, ``at`` = its
    start), the later of the two being the last known; ``previous_end``: the last write of the previous attempt's
    visit lease (epoch seconds; a kill -9 stops its renewals, a clean stop releases it), so the previous attempt's
    seconds after the last known point are counted, as lost."""
    known = max((d for d in (checkpoint, started) if d), key=lambda d: d.get("at", 0.0), default=None)
    wall, pre, lost = ((known.get("wall", 0.0), known.get("preinfer", 0.0), known.get("lost", 0.0)) if known
                       else (0.0, 0.0, 0.0))
    if known and previous_end is not None and previous_end > known.get("at", previous_end):
        gone = previous_end - known["at"]
        wall, lost = wall + gone, lost + gone
    return Earlier(wall=wall, preinfer=pre, lost=lost)
