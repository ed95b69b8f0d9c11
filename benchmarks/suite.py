"""``python -m benchmarks suite``: does BCD reach full-parameter training's validation loss in few more
steps, on real text that is not the built-in corpus (benchmarks/corpora.py) and is not overfit in the steps
used?

For each corpus × model × seed of the profile's ``suite`` section (benchmarks/profiles.py), one
full-parameter baseline (``full_train`` to its step cap) and one BCD run (``bcd_train``) per named setting,
all through the real flows (``benchmarks.runs.RunBook``: a run is keyed by its config, so the baseline runs
once per corpus × model × seed whatever the settings). Per seed, against that seed's baseline:

- L* = the baseline's final validation loss + ``tol`` (``--regime paper``: its best, the early-stopping point of a
  baseline trained for many epochs on a small corpus: the paper's protocol, §4.2.3);
- B-F × = BCD's optimizer steps to first reach L* / the baseline's (``runs.first_reach``). BCD validates
  once per visit, so its count is rounded up to a visit. Not reached: ``> x``, x = BCD's total steps /
  the baseline's (a lower bound);
- tokens × = the same with trained tokens (= epochs: both read the same corpus); epochs to L*, full and BCD;
- end gap = BCD's final validation loss − the baseline's at the same step (linear interpolation on its
  validation curve; past the baseline's last point, its last value, marked †);
- gap at equal steps = BCD's validation loss after as many steps as the baseline trained (interpolated between
  its visits) − the baseline's final;
- GPU-time ratio = the seconds of training, pre-inference and evaluation (the visits' measured stages on this
  run's device: no orchestration, commits or store I/O) to reach L*, BCD / baseline; lower bounds as for B-F.

Then mean and [min–max] over seeds. Writes ``suite.md``, ``suite.json`` and ``suite-<corpus>.png`` (validation
loss against steps) to ``--out`` after every corpus × model × seed, so a long suite keeps what it finished.

    python -m benchmarks suite --quick --out /tmp/suite
    python -m benchmarks suite --quick --regime paper --out /tmp/paper   # epochs to the baseline's best
    python -m benchmarks suite --quick --corpora docs --models tiny --seeds 0 --settings default \\
        --set optim.warmup_steps=50
"""
from __future__ import annotations

import json
import os
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from benchmarks import corpora, report
from benchmarks.common import machine
from benchmarks.profiles import profile
from benchmarks.runs import RunBook, book, first_reach, flow_server
from benchmarks.training import run_row
from bcdflow.core.config import load_config
from bcdflow.core.context import resolve_device
from bcdflow.errors import BadInput

KEYS = {"steps": "step", "tokens": "tokens", "time": "stage_seconds"}


def add_parser(sub) -> None:
    ap = sub.add_parser("suite", help="BCD vs full training on local corpora: suite.md, suite.json, plots",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized (the full size reuses it)")
    ap.add_argument("--regime", default="ours", choices=("ours", "paper"),
                    help="ours: corpora not overfit, L* from the baseline's final loss; paper: a small corpus for many "
                         "epochs, L* from the baseline's best (the paper's protocol)")
    ap.add_argument("--tiny", action="store_true", help="smoke size: one corpus, seed and model, ~10 steps")
    ap.add_argument("--out", default="benchmarks/out", help="output directory (default benchmarks/out)")
    ap.add_argument("--corpus-dir", help="where corpora are built and reused (default OUT/corpora)")
    ap.add_argument("--corpora", nargs="+", metavar="NAME", help="a subset of the profile's corpora")
    ap.add_argument("--models", nargs="+", metavar="NAME", help="a subset of the profile's models")
    ap.add_argument("--seeds", nargs="+", type=int, metavar="N", help="seeds (default: the profile's)")
    ap.add_argument("--settings", nargs="+", metavar="NAME", help="a subset of the profile's BCD settings")
    ap.add_argument("--set", dest="sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                    help="a config key for every run, baseline and BCD, after the profile's (repeatable)")
    ap.add_argument("--bcd-set", dest="bcd_sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                    help="a config key for the BCD runs alone, after --set: BCD at its own rate against the "
                         "baseline's L* (e.g. --set optim.lr=1e-3 --bcd-set optim.lr=2e-3; repeatable)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="train.device of every run (auto: CUDA when present)")
    ap.add_argument("--flow-threads", type=int, help="torch threads for the runs (CPU default 1)")


def select(suite: dict, args) -> dict:
    """The profile's suite cut to the command line's corpora, models, seeds and settings (in the profile's
    order), with its ``--set`` list; a name the profile lacks is a BadInput naming the choices."""
    s = dict(suite)
    for key in ("corpora", "models", "settings"):
        want = getattr(args, key)
        if want:
            unknown = [w for w in want if w not in suite[key]]
            if unknown:
                raise BadInput(f"--{key}: unknown {', '.join(unknown)} (choose from {', '.join(suite[key])})")
            s[key] = {k: v for k, v in suite[key].items() if k in want}
    s["seeds"] = list(dict.fromkeys(args.seeds)) if args.seeds else list(suite["seeds"])
    s["extra"] = list(args.sets) + ([f"train.device={args.device}"] if args.device != "auto" else [])
    s["bcd_extra"] = list(getattr(args, "bcd_sets", None) or [])
    return s


def run_sets(s: dict, model: str, files: list[str], seed: int, mode: str, setting: str | None = None,
             target: float | None = None) -> list[str]:
    """A run's ``--set`` list after the book's: model, corpus, seed, the mode's, the setting's, the command
    line's (later keys win). ``target``: a BCD run stops at the first visit that reaches it (the profile's
    ``stop_at_target``: its cycle cap is then only a cap, and the run costs what reaching L* costs)."""
    own = s["full"] if mode == "full" else [*s["bcd"], *s["settings"][setting]]
    stop = [f"stop.target_val_loss={target:.6f}"] if target is not None and s.get("stop_at_target") else []
    bcd_only = s.get("bcd_extra", []) if mode != "full" else []
    return [*s["models"][model], f"data.files={json.dumps(files)}", f"seed={seed}", *own, *stop, *s["extra"],
            *bcd_only]


def prepare(bk: RunBook, s: dict, corpus_dir: Path) -> dict[str, list[str]]:
    """The corpora's files (built or reused), and every run's config checked: a bad ``--set`` or setting fails
    in a second, not hours in."""
    files = {}
    for name, size in s["corpora"].items():
        t = time.perf_counter()
        files[name] = corpora.build(name, corpus_dir / f"{name}-{size}", size)
        print(f"corpus {name}: {sum(os.path.getsize(f) for f in files[name]) / 1e6:.1f} MB in {len(files[name])} "
              f"file(s) under {corpus_dir / f'{name}-{size}'} ({time.perf_counter() - t:.0f} s)", flush=True)
    for c in files:
        for m in s["models"]:
            for seed in s["seeds"]:
                for mode, setting in [("full", None), *(("bcd", k) for k in s["settings"])]:
                    load_config(sets=bk.sets(s["optim"], run_sets(s, m, files[c], seed, mode, setting)))
    return files


def suite(bk: RunBook, s: dict, files: dict[str, list[str]], out: Path, meta: dict, t0: float) -> dict:
    """Every run of the selection, the metrics per seed and over seeds; writes the outputs as it goes."""
    res = {"meta": meta, "suite": dict(s),
           "corpora": {c: corpora.info(Path(files[c][0]).parent) for c in files}, "groups": [], "errors": []}
    for c in files:
        for m in s["models"]:
            group = {"corpus": c, "model": m, "seeds": {}, "rows": {}}
            res["groups"].append(group)
            for seed in s["seeds"]:
                print(f"\n== {c} / {m} / seed {seed}", flush=True)
                try:
                    group["seeds"][seed] = seed_runs(bk, s, c, m, files[c], seed)
                except Exception as e:  # a failed run: reported with what finished, the rest still runs
                    traceback.print_exc()
                    res["errors"].append({"corpus": c, "model": m, "seed": seed, "error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()})
                group["baseline"] = baseline_row(c, m, group["seeds"])
                group["rows"] = {k: summarize(c, m, k, [r["settings"][k] for r in group["seeds"].values()])
                                 for k in s["settings"]}
                res["meta"]["seconds"] = time.perf_counter() - t0
                write(out, res)
    return res


def seed_runs(bk: RunBook, s: dict, corpus: str, model: str, files: list[str], seed: int) -> dict:
    tag = f"{corpus}/{model}/s{seed}"
    full = bk.get(f"{tag}/full", "full", s["optim"], run_sets(s, model, files, seed, "full"))
    out = {"full": run_row(full) | {"dataset": full["dataset"]}, "settings": {}}
    for k in s["settings"]:
        target_from = s.get("target", "final")
        bcd = bk.get(f"{tag}/{k}", "bcd", s["optim"],
                     run_sets(s, model, files, seed, "bcd", k, target=full[f"{target_from}_val"] + s["tol"]))
        b = load_config(sets=bcd["sets"]).bcd
        cap = b.cycles * bcd["n_blocks"] * b.max_steps  # what the run may train at most
        out["settings"][k] = {**compare(full, bcd, s["tol"], target_from), "cap_steps": cap, "run": run_row(bcd)}
    return out


# -- the metrics ------------------------------------------------------------------------------------------------

def interp(curve: list[dict], step: float, key: str = "val_loss") -> tuple[float | None, str | None]:
    """``key`` of a curve (points sorted by ``step``) at ``step``, linearly interpolated; outside the curve,
    its nearest end and which (``"after"`` its last point, ``"before"`` its first)."""
    if not curve:
        return None, None
    if step >= curve[-1]["step"]:
        return curve[-1][key], ("after" if step > curve[-1]["step"] else None)
    if step <= curve[0]["step"]:
        return curve[0][key], ("before" if step < curve[0]["step"] else None)
    for a, b in zip(curve, curve[1:]):
        if a["step"] <= step <= b["step"]:
            f = (step - a["step"]) / (b["step"] - a["step"])
            return a[key] + f * (b[key] - a[key]), None
    raise AssertionError("unsorted curve")


def multiplier(full_curve: list[dict], bcd_curve: list[dict], target: float, key: str) -> dict:
    """BCD's ``key`` (step, tokens, stage_seconds) to first reach ``target`` over the baseline's. Not reached by
    BCD: its total over the baseline's, ``reached`` False (a lower bound). ``value`` None when the baseline
    never reached it or reached it at 0."""
    f, b = first_reach(full_curve, target, key), first_reach(bcd_curve, target, key)
    reached = b is not None
    if not reached and bcd_curve:
        b = bcd_curve[-1][key]
    return {"value": b / f if f and b is not None else None, "reached": reached, "full": f, "bcd": b}


def compare(full: dict, bcd: dict, tol: float, target_from: str = "final") -> dict:
    """One seed's figures for one BCD run against its baseline (run dicts of ``RunBook.get``). L* = the
    baseline's ``target_from`` validation loss + ``tol``: ``final`` (a baseline still falling: where it got) or
    ``best`` (a baseline trained past its minimum, as fine-tuning with early stopping is)."""
    target = full[f"{target_from}_val"] + tol
    at = bcd["steps"]
    ref, where = interp(full["curve"], at)
    ds = full.get("dataset") or {}
    train_tokens = (ds.get("n_train") or 0) * (ds.get("seq_len") or 0)
    figures = {k: multiplier(full["curve"], bcd["curve"], target, key) for k, key in KEYS.items()}
    epochs = {who: figures["tokens"][who] / train_tokens if train_tokens and figures["tokens"][who] is not None
              else None for who in ("full", "bcd")}  # trained tokens to L* over the corpus's training tokens
    at_full, past = interp(bcd["curve"], full["steps"])
    return {"target": target, **figures, "epochs": epochs,
            "gap_equal": at_full - full["final_val"] if at_full is not None and past is None else None,
            "gap": bcd["final_val"] - ref if ref is not None else None, "gap_at": at, "gap_where": where,
            "final_bcd": bcd["final_val"], "final_full": full["final_val"], "best_full": full.get("best_val"),
            "steps_bcd": bcd["steps"],
            "steps_full": full["steps"], "stopped_by": dict(Counter(bcd["stopped_by"])),
            "stop_reason": bcd["stop_reason"]}


def spread(vals: list[float], bounds: list[bool] | None = None) -> dict | None:
    """Mean, min and max of per-seed values; with ``bounds`` (True = the value is a lower bound), whether the
    mean and each end are lower bounds."""
    pairs = [(v, b) for v, b in zip(vals, bounds or [False] * len(vals)) if v is not None]
    if not pairs:
        return None
    lo, hi = min(pairs, key=lambda p: p[0]), max(pairs, key=lambda p: p[0])
    return {"mean": sum(v for v, _ in pairs) / len(pairs), "min": lo[0], "max": hi[0], "n": len(pairs),
            "n_bound": sum(b for _, b in pairs), "mean_bound": any(b for _, b in pairs), "min_bound": lo[1],
            "max_bound": hi[1]}


def summarize(corpus: str, model: str, setting: str, cells: list[dict]) -> dict:
    """A setting's row: its per-seed figures over seeds."""
    row = {"corpus": corpus, "model": model, "setting": setting, "seeds": len(cells)}
    for k in KEYS:
        row[k] = spread([c[k]["value"] for c in cells], [not c[k]["reached"] for c in cells])
    row["gap"] = spread([c["gap"] for c in cells])
    row["gap_equal"] = spread([c.get("gap_equal") for c in cells])
    row["epochs_full"] = spread([(c.get("epochs") or {}).get("full") for c in cells])
    row["epochs_bcd"] = spread([(c.get("epochs") or {}).get("bcd") for c in cells],
                               [not c["tokens"]["reached"] for c in cells])
    row["gap_after"] = sum(c["gap_where"] == "after" for c in cells)
    for k in ("final_bcd", "final_full", "steps_bcd", "steps_full", "cap_steps"):
        row[k] = spread([c[k] for c in cells])
    row["stopped_by"] = dict(sum((Counter(c["stopped_by"]) for c in cells), Counter()))
    row["stop_reason"] = dict(Counter(c["stop_reason"] for c in cells))
    return row


def baseline_row(corpus: str, model: str, seeds: dict) -> dict:
    """The baselines of a corpus × model: their final and best validation loss and how many times they read the
    training rows (epochs); ``rise`` = final − best > 0 says validation loss went back up (overfitting)."""
    fulls = [r["full"] for r in seeds.values()]
    epochs = []
    for f in fulls:
        ds = f["dataset"]
        n = (ds.get("n_train") or 0) * (ds.get("seq_len") or 0)
        epochs.append(f["curve"][-1]["tokens"] / n if n and f["curve"] else None)
    ds = fulls[0]["dataset"] if fulls else {}
    return {"corpus": corpus, "model": model, "seeds": len(fulls), "final": spread([f["final_val"] for f in fulls]),
            "best": spread([f["best_val"] for f in fulls]),
            "rise": spread([f["final_val"] - f["best_val"] for f in fulls]),
            "late": spread([interp(f["curve"], 2 * f["steps"] / 3)[0] - f["final_val"] if f["curve"] else None
                            for f in fulls]),
            "steps": spread([f["steps"] for f in fulls]), "epochs": spread(epochs),
            "train_tokens": (ds.get("n_train") or 0) * (ds.get("seq_len") or 0) or None,
            "val_tokens": (ds.get("n_val") or 0) * (ds.get("seq_len") or 0) or None}


# -- the outputs ------------------------------------------------------------------------------------------------

def shown(sp: dict | None, fmt: str = ".2f", brackets: bool = True) -> str:
    """``1.23 [1.10–1.40]``; ``> x`` where a figure is a lower bound; ``(k/n reached)`` when some seed missed."""
    if sp is None:
        return "–"
    f = lambda v, b: ("> " if b else "") + format(v, fmt)  # noqa: E731
    text = f(sp["mean"], sp.get("mean_bound"))
    if brackets and sp["n"] > 1:
        text += f" [{f(sp['min'], sp.get('min_bound'))}–{f(sp['max'], sp.get('max_bound'))}]"
    if sp.get("n_bound"):
        text += f" ({sp['n'] - sp['n_bound']}/{sp['n']} reached)"
    return text


COLUMNS = [("corpus", "corpus"), ("model", "model"), ("setting", "setting"), ("seeds", "seeds"),
           ("bf", "B-F × mean [min–max]"), ("tok", "tokens ×"), ("epochs", "epochs to L* full → BCD"),
           ("gap_equal", "gap at the baseline's steps"), ("gap", "end gap (BCD − full, same step)"),
           ("time", "GPU-time ratio"), ("final", "final val BCD vs full"), ("steps", "steps BCD / full (BCD cap)"),
           ("ended", "visits ended by")]
BASE_COLUMNS = [("corpus", "corpus"), ("model", "model"), ("seeds", "seeds"), ("final", "final val"),
                ("best", "best val"), ("rise", "final − best"), ("late", "drop in the last third"), ("steps", "steps"),
                ("epochs", "epochs read"),
                ("tokens", "train / val tokens")]


def table_rows(res: dict) -> list[dict]:
    rows = []
    for g in res["groups"]:
        for r in g["rows"].values():
            if not r["seeds"]:
                continue
            rows.append({"corpus": r["corpus"], "model": r["model"], "setting": r["setting"], "seeds": r["seeds"],
                         "bf": shown(r["steps"]), "tok": shown(r["tokens"]), "time": shown(r["time"]),
                         "epochs": f"{shown(r.get('epochs_full'), '.1f', False)} → "
                                   f"{shown(r.get('epochs_bcd'), '.1f', False)}",
                         "gap": shown(r["gap"], "+.3f") + (f" †{r['gap_after']}" if r["gap_after"] else ""),
                         "gap_equal": shown(r.get("gap_equal"), "+.3f"),
                         "final": f"{shown(r['final_bcd'], '.3f', False)} vs {shown(r['final_full'], '.3f', False)}",
                         "steps": f"{shown(r['steps_bcd'], '.0f', False)} / {shown(r['steps_full'], '.0f', False)}"
                                  f" (cap {shown(r['cap_steps'], '.0f', False)})",
                         "ended": ", ".join(f"{k} {n}" for k, n in sorted(r["stopped_by"].items()))
                         + "; run: " + ", ".join(f"{k} {n}" for k, n in sorted(r["stop_reason"].items()))})
    return rows


def base_rows(res: dict) -> list[dict]:
    rows = []
    for g in res["groups"]:
        b = g.get("baseline")
        if not b or not b["seeds"]:
            continue
        tok = f"{b['train_tokens'] / 1e6:.2f}M / {b['val_tokens'] / 1e6:.3f}M" if b["train_tokens"] else "–"
        rows.append({"corpus": b["corpus"], "model": b["model"], "seeds": b["seeds"], "final": shown(b["final"], ".3f"),
                     "best": shown(b["best"], ".3f"), "rise": shown(b["rise"], "+.3f"), "late": shown(b["late"], ".3f"),
                     "steps": shown(b["steps"], ".0f", False), "epochs": shown(b["epochs"], ".2f"), "tokens": tok})
    return rows


def markdown(res: dict) -> str:
    m, s = res["meta"], res["suite"]
    dev = m["machine"]["gpu"] or m["machine"]["cpu"]
    settings = "; ".join(f"`{k}`: `{' '.join(v) or '(profile defaults)'}`" for k, v in s["settings"].items())
    corp = "; ".join(f"{c}: {i['bytes'] / 1e6:.1f} MB from {', '.join(i['packages'])}"
                     + (f" ({', '.join(i['missing'])} not installed)" if i["missing"] else "")
                     for c, i in res["corpora"].items())
    lines = [
        f"# BCD vs full-parameter training on local corpora ({m['profile']}"
        + (", the paper's protocol: L* from the baseline's best, many epochs" if s.get("target") == "best" else "")
        + ")", "",
        f"`{m['command']}` on {dev} ({m['machine']['device']}), torch {m['machine']['torch']}, flows at "
        f"{m['flow_threads']} thread(s), {m['started']}, {m['seconds']:.0f} s.", "",
        f"Corpora (benchmarks/corpora.py): {corp}. Every run: `{' '.join(s['sets'])}` (optimizer {s['optim']}); "
        f"baseline `{' '.join(s['full'])}`; BCD `{' '.join(s['bcd'])}`; settings {settings}"
        + (f"; command line `{' '.join(s['extra'])}`" if s["extra"] else "")
        + (f"; BCD runs only `{' '.join(s['bcd_extra'])}`" if s.get("bcd_extra") else "") + ". Models: "
        + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in s["models"].items()) + ".", "",
        f"Per seed: L* = the baseline's {s.get('target', 'final')} val loss + {s['tol']}. B-F × = BCD's optimizer "
        "steps to first reach L* "
        "/ the baseline's (BCD validates once per visit: rounded up to a visit); `> x` = BCD never reached L*, x = "
        "its total steps / the baseline's (a lower bound). tokens × = the same in trained tokens; epochs to L* = "
        "trained tokens to L* / the corpus's training tokens, baseline → BCD. Gap at the baseline's steps = BCD's val "
        "loss after as many steps as the baseline trained (interpolated between visits) − the baseline's final. "
        "End gap = BCD's "
        "final val loss − the baseline's at the same step (interpolated; † = BCD ran past the baseline's last "
        "point, compared there, for that many seeds). GPU-time ratio = seconds of training, pre-inference and "
        f"evaluation to L*, BCD / baseline, measured on this device ({m['machine']['device']}; orchestration, "
        "commits and store I/O excluded). Mean [min–max] over seeds. BCD cap = cycles × blocks × bcd.max_steps: "
        "a B-F above cap / the baseline's steps to L* cannot show here (it reads as `> x`).", "",
        report.md_table(table_rows(res), [(k, h, "s") for k, h in COLUMNS]), "",
        "Baselines: 'final − best' > 0 = validation loss went back up (overfitting); 'drop in the last third' = "
        f"how much it still fell over the last third of the steps (well above {s['tol']}: not flat, L* is a moving "
        "target); 'epochs read' = trained tokens / training tokens of the corpus.", "",
        report.md_table(base_rows(res), [(k, h, "s") for k, h in BASE_COLUMNS]), ""]
    lines += [f"![{p}]({p})" for p in res.get("plots", [])]
    for e in res["errors"]:
        lines += ["", f"**error** in {e['corpus']} / {e['model']} / seed {e['seed']}: `{e['error']}`"]
    return "\n".join(lines) + "\n"


def plot(out: Path, res: dict) -> list[str]:
    """Validation loss against steps, one PNG per corpus, one panel per model: baselines black, each setting
    in its colour, every seed (L* of the first seed dashed)."""
    names = []
    for corpus in dict.fromkeys(g["corpus"] for g in res["groups"]):
        groups = [g for g in res["groups"] if g["corpus"] == corpus and g["seeds"]]
        if not groups:
            continue
        fig, axes = report.figure(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False)
        for ax, g in zip(axes[0], groups):
            curves = []
            for i, (seed, r) in enumerate(g["seeds"].items()):
                runs = [("full", r["full"], "k", "-")]
                runs += [(k, c["run"], f"C{j}", "o-") for j, (k, c) in enumerate(r["settings"].items())]
                for name, run, color, style in runs:
                    pts = run["curve"]
                    curves.append(pts)
                    ax.plot([p["step"] for p in pts], [p["val_loss"] for p in pts], style, color=color, ms=3,
                            lw=1, alpha=0.8 if i == 0 else 0.35, label=name if i == 0 else None)
                if i == 0 and r["settings"]:
                    ax.axhline(next(iter(r["settings"].values()))["target"], ls="--", lw=0.8, color="gray")
            top_step = max(p["step"] for c in curves for p in c)
            late = [p["val_loss"] for c in curves for p in c if p["step"] >= 0.2 * top_step]
            if late:  # the first points (near log V) would flatten the part that matters
                ax.set_ylim(min(late) - 0.05, max(late) + 0.05)
            ax.set_title(f"{corpus} / {g['model']} ({len(g['seeds'])} seed(s))", fontsize=9)
            ax.set_xlabel("optimizer steps")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        names.append(report.save(fig, out, f"suite-{corpus}.png"))
    return names


def write(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = plot(out, res)
    (out / "suite.json").write_text(json.dumps(res, indent=2, default=report._json_default))
    (out / "suite.md").write_text(markdown(res))


def begin(args, argv: list[str], section: str, pick=None):
    """What the ``suite`` and ``peers`` commands start from: (size, profile, what ``pick`` (default: this module's
    ``select``) takes of the profile's ``section``, start time, device, flow threads, out dir, corpus dir, machine,
    report meta); None after printing bad input."""
    size = "tiny" if args.tiny or os.environ.get("BCDFLOW_BENCH_SIZE") == "tiny" else (
        "quick" if args.quick else "full")
    prof = profile(size)
    t0 = time.perf_counter()
    try:
        s = (pick or select)(prof[section], args)
        device = resolve_device(args.device)
    except BadInput as e:
        print(f"error: {e}")
        return None
    flow_threads = args.flow_threads or (1 if device.type == "cpu" else torch.get_num_threads())
    out = Path(args.out)
    corpus_dir = Path(args.corpus_dir) if args.corpus_dir else out / "corpora"
    info = machine(device)
    meta = {"profile": size, "command": "python -m benchmarks " + " ".join(argv), "machine": info,
            "flow_threads": flow_threads, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": 0.0}
    return size, prof, s, t0, device, flow_threads, out, corpus_dir, info, meta


def main(args, argv: list[str]) -> int:
    """The ``suite`` command (``benchmarks.cli.main`` parsed ``argv`` into ``args``); exit status 0, 1 when a run
    failed (the others still ran), 2 for bad input (a name the profile lacks, a bad ``--set``)."""
    start = begin(args, argv, "suite" if args.regime == "ours" else "paper")
    if start is None:
        return 2
    size, prof, s, t0, device, flow_threads, out, corpus_dir, info, meta = start
    n_runs = len(s["corpora"]) * len(s["models"]) * len(s["seeds"]) * (1 + len(s["settings"]))
    print(f"bcdflow suite ({size}): {n_runs} runs — corpora {', '.join(s['corpora'])}; models "
          f"{', '.join(s['models'])}; seeds {', '.join(map(str, s['seeds']))}; settings {', '.join(s['settings'])} "
          f"on {info['gpu'] or info['cpu']} ({device}), flows at {flow_threads} thread(s)", flush=True)
    bk = book(size, prof, flow_threads, section="suite" if args.regime == "ours" else "paper")
    try:
        files = prepare(bk, s, corpus_dir)
    except BadInput as e:
        print(f"error: {e}")
        return 2
    with flow_server():
        res = suite(bk, s, files, out, meta, t0)
    print("\n" + report.text_table(table_rows(res), COLUMNS))
    print("\n" + report.text_table(base_rows(res), BASE_COLUMNS))
    for e in res["errors"]:
        print(f"ERROR in {e['corpus']} / {e['model']} / seed {e['seed']}: {e['error']}")
    print(f"\nwrote {out / 'suite.md'}, {out / 'suite.json'} and {len(res['plots'])} plot(s) in "
          f"{meta['seconds']:.0f} s")
    return 1 if res["errors"] else 0
