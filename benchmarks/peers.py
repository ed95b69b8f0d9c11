"""``python -m benchmarks peers``: bcdflow's defaults beside the methods a user would otherwise run (issue 35), on the
same data, steps, time and memory, all through bcdflow's own pipeline.

Per corpus × model × seed of the profile's ``peers`` section (benchmarks/profiles.py): the suite's baseline (full
AdamW, ``bcdflow baseline``, 600 steps), bcdflow's defaults (``bcdflow train``: adaptive budget, kept moments,
landscape expansion rank 16; it stops at the first visit that reaches L*), and every peer as ``bcdflow baseline --set
optim.name=<peer>`` (models/peers.py) at its authors' settings, up to ``peer_steps`` steps. L* = the baseline's final
(``--regime paper``: best) validation loss + ``tol``, as in the suite (benchmarks/suite.py). Per method and seed:

- B-F × = steps to first reach L* / the baseline's (a validation point every ``train.eval_every`` steps for the
  baseline and the peers, once per visit for bcdflow); ``> x`` = never reached, x = its steps / the baseline's;
- tokens × the same in trained tokens; final and best validation loss;
- time per step: every method's training step on one batch of the model, timed round-robin in this process (so a
  slow spell on a shared machine hits every method alike), as a ratio to full AdamW's; bcdflow's is the mean over
  its plan's visits (each from pre-inferred activations, its adapters on);
- peak memory of that step, measured by the CPU tensor tracker (``benchmarks.common.LiveBytes``): the state alive
  before the step (weights, optimizer state, input; BAdam's fp32 copy of the active block) plus the most the step
  adds.

Beside them, at Llama-3-8B's shape (bf16, 2×1024): each method's device and host memory from its own published
accounting, next to bcdflow's planner (``bcdflow plan-memory``), the published RTX 4090 throughputs, and the
break-even B-F against an exact offloaded full training. Writes ``peers.md``, ``peers.json`` and ``peers-<corpus>.png``
(validation loss against steps, every method) to ``--out`` after every corpus × model × seed.

    python -m benchmarks peers --quick --out /tmp/peers
    python -m benchmarks peers --quick --corpora docsrc --models l4-d64 --seeds 0 --methods full bcdflow lisa
    python -m benchmarks peers --tiny --out /tmp/p     # the smoke size (tests/test_benchmarks.py)
"""
from __future__ import annotations

import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from benchmarks import corpora, report
from benchmarks.common import LiveBytes, Workload, round_robin, tensor_bytes
from benchmarks.runs import book, flow_server
from benchmarks.suite import begin, compare, interp, shown, spread
from benchmarks.training import run_row
from bcdflow.core.config import load_config
from bcdflow.errors import BadInput
from bcdflow.models import build_model, get_config
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.models.trainer import OptimSpec, make_optimizer
from bcdflow.models.visit_compute import visit_loss

GB = 1e9


def add_parser(sub) -> None:
    ap = sub.add_parser("peers", help="bcdflow vs BAdam, LISA, GaLore, APOLLO, LoRA and full AdamW: peers.md, plots",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized (the full size reuses it)")
    ap.add_argument("--tiny", action="store_true", help="smoke size: one corpus, model and seed, ~10 steps")
    ap.add_argument("--regime", default="ours", choices=("ours", "paper"),
                    help="ours: L* from the baseline's final loss; paper: a small corpus for many epochs, L* from its "
                         "best (the paper's protocol)")
    ap.add_argument("--out", default="benchmarks/out", help="output directory (default benchmarks/out)")
    ap.add_argument("--corpus-dir", help="where corpora are built and reused (default OUT/corpora)")
    for key in ("corpora", "models", "methods"):
        ap.add_argument(f"--{key}", nargs="+", metavar="NAME", help=f"a subset of the profile's {key}")
    ap.add_argument("--seeds", nargs="+", type=int, metavar="N", help="seeds (default: the profile's)")
    ap.add_argument("--set", dest="sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                    help="a config key for every run (repeatable)")
    ap.add_argument("--method-set", dest="method_sets", action="extend", nargs="+", default=[],
                    metavar="METHOD:KEY=VALUE", help="a config key for one method's runs, after the method's own "
                    "(repeatable): a tuned rate, e.g. full:optim.lr=1e-3 lisa:optim.lr=1e-3")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--flow-threads", type=int, help="torch threads for the runs (CPU default 1)")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="write one report from the peers.json of earlier runs "
                    "(e.g. one process per corpus) to --out, running nothing")


def select(s: dict, args) -> dict:
    s = dict(s)
    for key in ("corpora", "models", "methods"):
        want = getattr(args, key)
        if want:
            bad = [w for w in want if w not in s[key]]
            if bad:
                raise BadInput(f"--{key}: unknown {' '.join(bad)} (choose from {', '.join(s[key])})")
            s[key] = {k: v for k, v in s[key].items() if k in want}
    if "full" not in s["methods"]:
        raise BadInput("--methods: full is the reference every figure is relative to: include it")
    if args.seeds:
        s["seeds"] = args.seeds
    s["extra"] = list(args.sets)
    s["methods"] = {k: dict(v, sets=list(v["sets"])) for k, v in s["methods"].items()}
    for item in args.method_sets:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            raise BadInput(f"--method-set: {item!r} is not METHOD:KEY=VALUE")
        if name not in s["methods"]:
            raise BadInput(f"--method-set: unknown method {name!r} in {item!r} (choose from {', '.join(s['methods'])})")
        m = s["methods"][name]
        m["sets"].append(kv)
        key, _, value = kv.partition("=")
        if key == "optim.lr":  # the rate the report states and the step timing uses
            try:
                m["lr"] = float(value)
            except ValueError:
                raise BadInput(f"--method-set: optim.lr in {item!r} is not a number") from None
    return s


def run_sets(s: dict, model: str, files: list[str], seed: int, method: str, target: float | None = None) -> list[str]:
    """The ``--set`` list of one run: the profile's shared keys, the model, the corpus, the seed, the method's own
    keys, then the command line's."""
    m = s["methods"][method]
    stop = [f"stop.target_val_loss={target:.6f}"] if target is not None and m["mode"] == "bcd" else []
    return [*s["sets"], *s["models"][model], f"data.files={json.dumps(files)}", f"seed={seed}", *m["sets"], *stop,
            *s["extra"]]


# -- step time and memory, measured side by side -----------------------------------------------------------------

class MethodStep:
    """One training step of the whole model with a method's optimizer (and LoRA's wrapper), as the baseline's loop
    takes it (``run_steps``: zero_grad, the loss, backward, clip, step)."""

    def __init__(self, name: str, cfg, x, y, lr: float, seed: int = 0):
        from benchmarks.common import one_step

        self._one = one_step
        torch.manual_seed(seed)
        self.name, self.model, self.batch, self.times = name, build_model(cfg), (x, y), []
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.spec = OptimSpec(name, lr=lr)
        named = list(self.model.named_parameters())
        wrap = OPTIMIZERS[name].wrap
        if wrap:
            named, _ = wrap(self.model, self.spec)
        self.named, self.params = named, [p for _, p in named]
        self.opt = make_optimizer(named, self.spec)
        self.trainable = sum(p.numel() for p in self.params)

    def loss(self, batch):
        return visit_loss(self.model, *batch, 0, False)

    def step(self, timed: bool) -> None:
        t0 = time.perf_counter()
        self._one(self.loss, self.params, self.batch, self.opt, self.spec)
        if timed:
            self.times.append(time.perf_counter() - t0)

    def held(self) -> list:
        """What the method holds between steps: weights, optimizer state, BAdam's fp32 copy of its active block."""
        base = getattr(self.opt, "base_optimizer", None)
        extra = [p for g in base.param_groups for p in g["params"]] if base is not None else []
        return [list(self.model.parameters()), list(self.model.buffers()), extra, self.opt.state,
                base.state if base is not None else {}]

    def peak(self) -> int:
        self.opt.zero_grad(set_to_none=True)
        base = tensor_bytes(*self.held(), self.batch)
        with LiveBytes() as tracker:
            self.step(timed=False)
        return base + tracker.peak


def step_figures(s: dict, model: str, device) -> dict:
    """Each method's step time (round-robin, fastest of the rounds) and peak tensor bytes on one random batch of
    ``model``; bcdflow's: the mean over its plan's visits (``benchmarks.common.Workload``, expansion rank 16)."""
    cfg_run = load_config(sets=[*s["sets"], *s["models"][model]])
    over = {k: getattr(cfg_run.model, k) for k in ("n_layer", "d_model", "n_head") if getattr(cfg_run.model, k)}
    c = {"model": cfg_run.model.name, "overrides": {**over, "vocab_size": cfg_run.data.vocab_size},
         "batch_size": cfg_run.train.batch_size, "seq_len": cfg_run.data.seq_len, "precision": "fp32"}
    wl = Workload(c, device, random_weights=False)
    cfg = get_config(c["model"], **c["overrides"])
    items, out = {}, {}
    for name, m in s["methods"].items():
        if m["mode"] == "bcd":
            continue
        try:
            items[name] = MethodStep(m["optim"], cfg, wl.x, wl.y, m["lr"])
        except BadInput as e:  # a peer whose package cannot work here: said, not dropped
            out[name] = {"error": str(e)}
    visits = []
    if "bcdflow" in s["methods"]:
        blocks = load_config(sets=[*s["sets"], *s["models"][model], *s["methods"]["bcdflow"]["sets"]]).bcd.blocks
        plan = wl.plan(blocks)
        visits = [wl.visit(f"bcd b{b.index}", b, preinfer=True, expand=16) for b in plan.visits]
    all_items = [*items.values(), *visits]
    for it in all_items:
        it.step(timed=False)  # optimizer state exists before the peak is taken
    peaks = {n: it.peak() for n, it in items.items()}
    vpeaks = [v.peak()["peak_bytes"] for v in visits]
    timing = round_robin(all_items, warmup=1, steps=s["time_steps"], max_steps=2 * s["time_steps"], budget_s=60)
    for n, it in items.items():
        out[n] = {"step_s": min(it.times), "peak_bytes": peaks[n], "trainable": it.trainable,
                  "full_parameter": OPTIMIZERS[it.spec.name].full_parameter}
    if visits:
        out["bcdflow"] = {"step_s": statistics.mean(min(v.times) for v in visits), "peak_bytes": max(vpeaks),
                          "visit_peaks": vpeaks, "visit_step_s": [min(v.times) for v in visits],
                          "trainable": max(sum(p.numel() for p in v.params) for v in visits), "full_parameter": True}
    full = out.get("full", {}).get("step_s")
    for n, r in out.items():
        if full and "step_s" in r:
            r["time_ratio"] = r["step_s"] / full
            r["mem_ratio"] = r["peak_bytes"] / out["full"]["peak_bytes"]
    return {"methods": out, "timing": timing, "tokens_per_step": wl.tokens}


# -- Llama-3-8B at 2x1024, bf16: each method's published accounting beside bcdflow's planner -----------------------

def published(device_gb: float = 24.0) -> dict:
    """Device and host memory of each method at Llama-3-8B's shape (benchmarks/shapes/llama-3-8b, bf16 weights), by
    each one's own accounting (the formula and its source in ``rows[*]["source"]``), bcdflow's planner for a 24 GB
    card, and the published RTX 4090 throughputs of an exact offloaded full training."""
    from bcdflow.flows.plan_memory import plan

    shape = str(Path(__file__).parent / "shapes" / "llama-3-8b")
    cfg = load_config(sets=[f"model.from_hf={shape}", "train.batch_size=2", "data.seq_len=1024",
                            "train.precision=bf16"])
    planned = plan(cfg, device_gb)
    rec = planned["recommendation"]
    step_s = statistics.mean(v["step_s"] for v in rec["visits"]) if rec["visits"] else None
    d, f, L, V, kv = 4096, 14336, 32, 128256, 1024  # width, MLP, layers, vocabulary, k/v width (8 heads of 128)
    mats = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)]  # q k v o gate up down, (out, in)
    layer = sum(a * b for a, b in mats) + 2 * d
    emb = V * d
    M = L * layer + 2 * emb + d  # 8.03e9
    adam = 16  # bytes per trained parameter with mixed precision: bf16 weight 2 + grad 2 + fp32 master 4 + moments 8

    def galore_state(r):  # GaLore §4 (Table 1): a m x n matrix (m <= n) holds P (m x r) + moments 2 (r x n)
        return sum(min(a, b) * min(r, min(a, b)) + 2 * min(r, min(a, b)) * max(a, b) for a, b in mats)

    def apollo_state(r):  # APOLLO: moments of the r x n projection; the random projection is regenerated from a seed
        return sum(2 * min(r, min(a, b)) * max(a, b) for a, b in mats)

    rows = [
        {"method": "full AdamW", "device_gb": adam * M / GB, "host_gb": 0,
         "source": "16 bytes per parameter with mixed precision (ZeRO, Rajbhandari et al. 2020, §3.1); no offload"},
        {"method": "BAdam (D=32 layers)", "device_gb": (2 * M + 16 * M / L) / GB, "host_gb": 0,
         "source": "2M + 16M/D bytes (BAdam README and paper §2.3: bf16 weights plus the active block's fp32 copy, "
                   "gradient and Adam states)"},
        {"method": "LISA (γ=2, E+H)", "device_gb": (2 * M + (adam - 2) * (2 * emb + 2 * layer)) / GB, "host_gb": 0,
         "source": "the method's rule (Pan et al. 2024, §3): bf16 weights, gradients and AdamW state of the "
                   "embeddings, head and γ sampled layers (our accounting of it)"},
        {"method": "GaLore (r=1024)", "device_gb": (2 * M + 2 * M + 2 * (L * galore_state(1024) + 2 * 2 * emb)) / GB,
         "host_gb": 0, "source": "GaLore paper Table 1 (mr + 2nr state per m×n matrix), bf16 weights, gradients and "
                                 "states as its 7B runs; AdamW for embeddings and head"},
        {"method": "APOLLO (r=256)", "device_gb": (2 * M + 2 * M + 2 * (L * apollo_state(256) + 2 * 2 * emb)) / GB,
         "host_gb": 0, "source": "APOLLO paper §4 (2nr state per matrix, projection from a seed), bf16"},
        {"method": "APOLLO-Mini (r=1)", "device_gb": (2 * M + 2 * M + 2 * (L * apollo_state(1) + 2 * 2 * emb)) / GB,
         "host_gb": 0, "source": "APOLLO paper §4, rank 1 tensor-wise; README: LLaMA-7B pre-trained in 11 GB with "
                                 "int8 weights (Q-APOLLO-Mini)"},
        {"method": "LoRA (r=8, all linear maps)",
         "device_gb": (2 * M + adam * L * sum(8 * (a + b) for a, b in mats)) / GB, "host_gb": 0,
         "source": "frozen bf16 weights plus r(m+n) adapter parameters per matrix with gradients and AdamW state "
                   "(Hu et al. 2021, §4.2); not full-parameter"},
        {"method": "DeepSpeed ZeRO-3 + CPU offload (published)", "device_gb": 16.4, "host_gb": 176,
         "tokens_per_s": 1791, "source": "issue 35's figure for 8B on an RTX 4090 (exact full training)"},
        {"method": "torchtune, offloaded full (published)", "device_gb": 18.9 * 2**30 / GB, "host_gb": None,
         "tokens_per_s": 1650, "source": "issue 35's figure for 8B on an RTX 4090, 18.9 GiB (exact full training)"},
        {"method": f"bcdflow (planner, bcd.blocks={rec['blocks']})",
         "device_gb": (rec["worst_peak"] or 0) / GB, "host_gb": (rec["host_bytes"] or 0) / GB,
         "tokens_per_s": 2 * 1024 / step_s if step_s else None,
         "source": "bcdflow plan-memory --set model.from_hf=benchmarks/shapes/llama-3-8b --set train.batch_size=2 "
                   "--set data.seq_len=1024 --set train.precision=bf16 --gpu-gb 24 (predicted: 80 TFLOP/s, 25 GB/s; "
                   "no GPU has measured it)"},
    ]
    ours = rows[-1]["tokens_per_s"]
    for r in rows:
        if r.get("tokens_per_s") and ours and r is not rows[-1]:
            r["break_even_bf"] = ours / r["tokens_per_s"]
    return {"params": M, "rows": rows, "bcdflow_step_s": step_s, "plan_line": rec["line"]}


# -- the runs and their figures ----------------------------------------------------------------------------------

def seed_runs(bk, s: dict, corpus: str, model: str, files: list[str], seed: int) -> dict:
    tag = f"{corpus}/{model}/s{seed}"
    target_from = s.get("target", "final")
    full = bk.get(f"{tag}/full", "full", "adamw", run_sets(s, model, files, seed, "full"))
    target = full[f"{target_from}_val"] + s["tol"]
    out = {"full": run_row(full) | {"dataset": full["dataset"]}, "methods": {}, "target": target}
    for name, m in s["methods"].items():
        if name == "full":
            continue
        try:
            r = bk.get(f"{tag}/{name}", m["mode"], m["optim"], run_sets(s, model, files, seed, name, target))
        except Exception as e:  # a method that fails here is reported with its error, the others still run
            traceback.print_exc()
            out["methods"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out["methods"][name] = {**compare(full, r, s["tol"], target_from), "run": run_row(r)}
    return out


def summarize(group: dict, s: dict) -> dict:
    rows = {}
    for name in s["methods"]:
        cells = [r["methods"].get(name) if name != "full" else None for r in group["seeds"].values()]
        if name == "full":
            fulls = [r["full"] for r in group["seeds"].values()]
            rows[name] = {"steps": spread([1.0] * len(fulls)), "tokens": spread([1.0] * len(fulls)),
                          "final": spread([f["final_val"] for f in fulls]),
                          "best": spread([min(p["val_loss"] for p in f["curve"]) for f in fulls]), "at2x": None,
                          "ran": spread([f["steps"] for f in fulls])}
            continue
        if not any(cells):  # a method this group's runs did not run (a report merged from several)
            continue
        ok = [c for c in cells if c and "error" not in c]
        errors = [c["error"] for c in cells if c and "error" in c]
        at = [interp(c["run"]["curve"], 2 * c["steps_full"]) for c in ok]  # val loss after twice full's steps
        rows[name] = {"at2x": spread([v if where is None else None for v, where in at]),
                      "steps": spread([c["steps"]["value"] for c in ok], [not c["steps"]["reached"] for c in ok]),
                      "tokens": spread([c["tokens"]["value"] for c in ok], [not c["tokens"]["reached"] for c in ok]),
                      "final": spread([c["run"]["final_val"] for c in ok]),
                      "best": spread([min(p["val_loss"] for p in c["run"]["curve"]) for c in ok if c["run"]["curve"]]),
                      "ran": spread([c["run"]["steps"] for c in ok]), "errors": errors}
    return rows


COLUMNS = [("method", "method"), ("what", "trains"), ("bf", "B-F × (steps to L* / full's)"), ("tok", "tokens ×"),
           ("time", "time per step × full"), ("mem", "peak memory (× full)"), ("final", "final val"),
           ("best", "best val"), ("at2x", "val at 2× full's steps"), ("ran", "steps run")]


def table_rows(res: dict, corpus: str, model: str) -> list[dict]:
    group = next((g for g in res["groups"] if g["corpus"] == corpus and g["model"] == model), None)
    steps = res["steps"].get(model, {}).get("methods", {})
    out = []
    for name, m in res["peers"]["methods"].items():
        r = (group or {}).get("rows", {}).get(name)
        st = steps.get(name, {})
        if r is None:
            continue
        err = "; ".join(r.get("errors") or []) or st.get("error")
        mem = (f"{st['peak_bytes'] / 2**20:.1f} MiB ({st['mem_ratio']:.2f})" if "peak_bytes" in st else "–")
        out.append({"method": name, "what": m["label"],
                    "bf": ("error: " + err) if err and not r["steps"] else shown(r["steps"]),
                    "tok": shown(r["tokens"]), "time": f"{st['time_ratio']:.2f}" if "time_ratio" in st else "–",
                    "mem": mem, "final": shown(r["final"], ".3f"), "best": shown(r["best"], ".3f"),
                    "at2x": shown(r.get("at2x"), ".3f"),
                    "ran": shown(r["ran"], ".0f", False)})
    return out


def markdown(res: dict) -> str:
    m, s = res["meta"], res["peers"]
    dev = m["machine"]["gpu"] or m["machine"]["cpu"]
    corp = "; ".join(f"{c}: {i['bytes'] / 1e6:.1f} MB from {', '.join(i['packages'])}" for c, i in res["corpora"].items())
    lines = [f"# bcdflow against the methods you would otherwise use ({m['profile']}"
             + (", the paper's protocol: L* from the baseline's best" if s.get("target") == "best" else "") + ")", "",
             f"`{m['command']}` on {dev} ({m['machine']['device']}), torch {m['machine']['torch']}, runs at "
             f"{m['flow_threads']} thread(s), {m['started']}, {m['seconds']:.0f} s.", "",
             f"Corpora (benchmarks/corpora.py): {corp}. Every run: `{' '.join(s['sets'])}`"
             + (f"; command line `{' '.join(s['extra'])}`" if s["extra"] else "") + ". Models: "
             + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in s["models"].items()) + ".", "",
             "Methods (each through bcdflow's pipeline; its settings and their source):", ""]
    for name, meth in s["methods"].items():
        lines.append(f"- **{name}** ({meth['label']}): `{' '.join(meth['sets']) or '(the profile)'}`; {meth['source']}")
    lines += ["", f"Per seed: L* = full AdamW's {s.get('target', 'final')} val loss + {s['tol']}. B-F × = a method's "
              "optimizer steps to first reach L* / full AdamW's (validated every `train.eval_every` steps; bcdflow "
              "once per visit); `> x` = never reached within its steps, x = its steps / full's (a lower bound). Time "
              "per step and peak memory: one training step of the whole model (bcdflow: the mean step and the worst "
              "visit of its plan) on one batch, timed round-robin in one process (the ratio to full AdamW's step "
              "measured in the same rounds) and measured by the CPU tensor tracker (weights, gradients, optimizer "
              "state, activations; BAdam's fp32 copy of its block). Mean [min–max] over seeds.", ""]
    for g in res["groups"]:
        if not g["seeds"]:
            continue
        lines += [f"## {g['corpus']} / {g['model']} ({len(g['seeds'])} seed(s))", "",
                  report.md_table(table_rows(res, g["corpus"], g["model"]), [(k, h, "s") for k, h in COLUMNS]), ""]
        for e in g.get("errors", []):
            lines.append(f"- **error**, seed {e['seed']}: `{e['error']}`")
    pub = res.get("published")
    if pub:
        lines += ["## Memory at Llama-3-8B's shape (bf16, batch 2×1024), each method's own accounting", "",
                  f"{pub['params'] / 1e9:.2f}B parameters. bcdflow's row is its planner's for a 24 GB card "
                  f"({pub['plan_line']}). Break-even B-F = bcdflow's tokens/s / the offloaded full training's: "
                  "bcdflow reaches L* first on the same card when its B-F is below it.", "",
                  report.md_table([{**r, "host_gb": "–" if r["host_gb"] is None else f"{r['host_gb']:.1f}",
                                    "tps": f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "–",
                                    "be": f"{r['break_even_bf']:.2f}" if r.get("break_even_bf") else "–"}
                                   for r in pub["rows"]],
                                  [("method", "method", "s"), ("device_gb", "device GB", ".1f"),
                                   ("host_gb", "host GB", "s"), ("tps", "tokens/s (4090)", "s"),
                                   ("be", "break-even B-F", "s"), ("source", "source", "s")]), ""]
    lines += [f"![{p}]({p})" for p in res.get("plots", [])]
    for e in res["errors"]:
        lines += ["", f"**error** in {e['corpus']} / {e['model']} / seed {e['seed']}: `{e['error']}`"]
    return "\n".join(lines) + "\n"


def plot(out: Path, res: dict) -> list[str]:
    """Validation loss against steps, one PNG per corpus, one panel per model, every method (every seed; L* of the
    first seed dashed)."""
    names = []
    methods = list(res["peers"]["methods"])
    for corpus in dict.fromkeys(g["corpus"] for g in res["groups"]):
        groups = [g for g in res["groups"] if g["corpus"] == corpus and g["seeds"]]
        if not groups:
            continue
        fig, axes = report.figure(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
        for ax, g in zip(axes[0], groups):
            curves = []
            for i, r in enumerate(g["seeds"].values()):
                runs = [("full", r["full"])] + [(k, c["run"]) for k, c in r["methods"].items() if "run" in c]
                for name, run in runs:
                    pts = run["curve"]
                    curves.append(pts)
                    color = "k" if name == "full" else f"C{methods.index(name) % 10}"
                    ax.plot([p["step"] for p in pts], [p["val_loss"] for p in pts], "o-" if name == "bcdflow" else "-",
                            color=color, ms=2.5, lw=1.6 if name in ("full", "bcdflow") else 1,
                            alpha=0.85 if i == 0 else 0.3, label=name if i == 0 else None)
                if i == 0:
                    ax.axhline(r["target"], ls="--", lw=0.8, color="gray")
            top = max((p["step"] for c in curves for p in c), default=1)
            late = [p["val_loss"] for c in curves for p in c if p["step"] >= 0.15 * top]
            if late:
                ax.set_ylim(min(late) - 0.05, min(max(late), min(late) + 2.5) + 0.05)
            ax.set_title(f"{corpus} / {g['model']} ({len(g['seeds'])} seed(s)); dashed: L*", fontsize=9)
            ax.set_xlabel("optimizer steps")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7, ncol=2)
        names.append(report.save(fig, out, f"peers-{corpus}.png"))
    return names


def write(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = plot(out, res)
    (out / "peers.json").write_text(json.dumps(res, indent=2, default=report._json_default))
    (out / "peers.md").write_text(markdown(res))


def merge(dirs: list[str], out: Path) -> dict:
    """One report of several runs' ``peers.json``: groups of the same corpus and model joined, a seed's methods
    from the first run that ran them (each figure is against the baseline of the run that measured it); the
    methods, settings and step figures of the run with the most methods; the commands of all."""
    parts = [json.loads((Path(d) / "peers.json").read_text()) for d in dirs]
    widest = max(parts, key=lambda p: len(p["peers"]["methods"]))
    res = dict(widest)
    groups: dict[tuple, dict] = {}
    for p in parts:
        for g in p["groups"]:
            if not g["seeds"]:
                continue
            have = groups.setdefault((g["corpus"], g["model"]), {**g, "seeds": {}})
            for seed, cell in g["seeds"].items():
                mine = have["seeds"].setdefault(seed, {**cell, "methods": {}})
                for name, c in cell["methods"].items():
                    mine["methods"].setdefault(name, c)
    res["groups"] = list(groups.values())
    ran = {c for c, _ in groups}
    res["corpora"] = {c: i for p in parts for c, i in p["corpora"].items() if c in ran}
    res["errors"] = [e for p in parts for e in p["errors"]]
    res["steps"] = {m: max((p for p in parts if m in p["steps"]), key=lambda p: len(p["steps"][m]["methods"]))[
        "steps"][m] for p0 in parts for m in p0["steps"]}
    res["meta"] = {**widest["meta"], "command": "; ".join(p["meta"]["command"] for p in parts),
                   "seconds": sum(p["meta"]["seconds"] for p in parts),
                   "started": ", ".join(p["meta"]["started"] for p in parts)}
    for g in res["groups"]:
        g["rows"] = summarize(g, res["peers"])
    write(out, res)
    return res


def main(args, argv: list[str]) -> int:
    """The ``peers`` command: exit 0, 1 when a run failed (the others still ran), 2 for bad input."""
    if args.merge:
        res = merge(args.merge, Path(args.out))
        print(f"wrote {Path(args.out) / 'peers.md'} from {len(args.merge)} run(s), {len(res['groups'])} group(s)")
        return 0
    start = begin(args, argv, "peers" if args.regime == "ours" else "peers_paper", select)
    if start is None:
        return 2
    size, prof, s, t0, device, flow_threads, out, corpus_dir, info, meta = start
    bk = book(size, prof, flow_threads, section="peers" if args.regime == "ours" else "peers_paper")
    files = {}
    try:
        for name, nbytes in s["corpora"].items():
            files[name] = corpora.build(name, corpus_dir / f"{name}-{nbytes}", nbytes)
        for c in files:  # every run's config checked before hours of runs
            for model in s["models"]:
                for meth in s["methods"]:
                    load_config(sets=bk.sets(s["methods"][meth]["optim"], run_sets(s, model, files[c], 0, meth, 1.0)))
    except BadInput as e:
        print(f"error: {e}")
        return 2
    print(f"bcdflow peers ({size}): corpora {', '.join(files)}; models {', '.join(s['models'])}; seeds "
          f"{', '.join(map(str, s['seeds']))}; methods {', '.join(s['methods'])} on {info['gpu'] or info['cpu']}",
          flush=True)
    res = {"meta": meta, "peers": s, "corpora": {c: corpora.info(Path(files[c][0]).parent) for c in files},
           "groups": [], "errors": [], "steps": {}, "plots": []}
    prev = torch.get_num_threads()
    torch.set_num_threads(flow_threads)
    try:
        for model in s["models"]:
            res["steps"][model] = step_figures(s, model, device)
            print(f"step figures {model}: " + ", ".join(
                f"{n} {r['step_s'] * 1e3:.0f} ms {r['peak_bytes'] / 2**20:.1f} MiB" if "step_s" in r else f"{n} error"
                for n, r in res["steps"][model]["methods"].items()), flush=True)
    finally:
        torch.set_num_threads(prev)
    if size != "tiny":
        res["published"] = published()
    with flow_server():
        for c in files:
            for model in s["models"]:
                group = {"corpus": c, "model": model, "seeds": {}, "rows": {}, "errors": []}
                res["groups"].append(group)
                for seed in s["seeds"]:
                    print(f"\n== {c} / {model} / seed {seed}", flush=True)
                    try:
                        group["seeds"][seed] = seed_runs(bk, s, c, model, files[c], seed)
                    except Exception as e:
                        traceback.print_exc()
                        res["errors"].append({"corpus": c, "model": model, "seed": seed,
                                              "error": f"{type(e).__name__}: {e}"})
                    group["rows"] = summarize(group, s)
                    res["meta"]["seconds"] = time.perf_counter() - t0
                    write(out, res)
    for g in res["groups"]:
        print(f"\n{g['corpus']} / {g['model']}\n" + report.text_table(table_rows(res, g["corpus"], g["model"]),
                                                                     COLUMNS))
    failed = res["errors"] or any(c.get("error") for g in res["groups"] for r in g["seeds"].values()
                                  for c in r["methods"].values())
    print(f"\nwrote {out / 'peers.md'}, {out / 'peers.json'} and {len(res['plots'])} plot(s) in "
          f"{res['meta']['seconds']:.0f} s")
    return 1 if failed else 0
