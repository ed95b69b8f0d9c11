"""``bcdflow plan``: the whole run planned at the user's scale (issue 34) from the config, the dataset's size and stated
rates: per visit the rows it samples, the activation bytes it writes to and reads from the store, pre-inference,
store transfer, training and evaluation time; per cycle and for the run the wall time, GPU-hours per kind, the
store's peak and total bytes and the money (GPUs and object storage, priced by the ``spend`` section). The memory
part is ``plan-memory``'s (how each visit holds its model on the card; ``--json`` holds it whole under ``memory``).

    bcdflow plan --set model.from_hf=benchmarks/shapes/llama-3-8b --set data.seq_len=1024 \\
        --set train.precision=bf16 --set train.batch_size=8 --tokens 100e6 --gpu-gb 24 --store-gbs 0.2
    bcdflow plan -c run.yaml --probe            # the store's rates measured: a few shards written and read back
    bcdflow plan -c run.yaml                    # the dataset counted from its files (tokenized as the run will)

The arithmetic is ``core/forecast.py`` (torch-free, tested on its own); the model's figures are the planner's
(``core/figures.figures`` from ``models/holding.choose_holding``: each visit's step time as held, with and without pre-inference), the
dataset's size from ``--tokens`` or the prepared token dataset, and the rates from the flags or ``--probe``.
"""
from __future__ import annotations

import math

from bcdflow.constants import MAX_MEMORY_GB
from bcdflow.errors import BadInput
from bcdflow.flows import like
from bcdflow.tracking.tables import strict_json

GB = 1e9


def add_parser(sub, common) -> None:
    sp = sub.add_parser("plan", parents=[common],
                        help="the whole run at your scale: bytes stored and moved per visit, time and money per cycle")
    sp.add_argument("-c", "--config", help="YAML config file (as for train)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    like.add_argument(sp)  # --like RUN: a stored run's settings (its store: --set store=URL), -c and --set on top
    sp.add_argument("--tokens", help="the dataset's token count (e.g. 100e6); default: counted from data.files "
                                     "(the token dataset is prepared in the store, as the run would)")
    sp.add_argument("--gpu-gb", type=float, default=24.0, help="the training card's memory, GB (default 24)")
    sp.add_argument("--store-gbs", type=float, default=None,
                    help="store bandwidth both ways, GB/s (default: train.store_gbs, 0.2: a rented box's ~1.6 Gbit/s)")
    sp.add_argument("--write-gbs", type=float, default=None, help="store write bandwidth, GB/s (overrides --store-gbs)")
    sp.add_argument("--read-gbs", type=float, default=None, help="store read bandwidth, GB/s (overrides --store-gbs)")
    sp.add_argument("--preinfer-gpus", type=float, default=None,
                    help="cheap GPUs computing pre-inference beside the training box (priced as "
                         "spend.preinfer_device; default: the training box itself, or fleet.dask_workers)")
    sp.add_argument("--preinfer-tflops", type=float, default=None,
                    help="one pre-inference GPU's forward TFLOP/s (default: with --preinfer-gpus or a Dask fleet, "
                         "spend.preinfer_device's; else the training card's)")
    sp.add_argument("--tflops", type=float, default=None,
                    help="the training card's TFLOP/s (default: train.tflops, else spend.train_device's)")
    sp.add_argument("--pcie-gbs", type=float, default=None,
                    help="host-to-device GB/s (default: train.pcie_gbs, else spend.train_device's)")
    sp.add_argument("--nodes", type=float, default=None,
                    help="machines a visit spans, --gpus GPUs on each (default: train.nodes, 1): the cluster priced, "
                         "each step's all-reduce included")
    sp.add_argument("--gpus", type=float, default=None, help="GPUs on each machine (default: train.gpus)")
    sp.add_argument("--link-gbs", type=float, default=None,
                    help="bandwidth between machines, GB/s (default: train.link_gbs, 1.25 = 10 Gbit/s)")
    sp.add_argument("--gpu-link-gbs", type=float, default=None,
                    help="all-reduce bandwidth between the GPUs of one machine, GB/s (default: train.gpu_link_gbs, "
                         "else spend.train_device's)")
    sp.add_argument("--bf", type=float, default=None,
                    help="B-F, BCD's steps to full training's loss over full training's, for the comparison with "
                         "full training (default: the validity suite's at the plan's block count, 1.21 at 3 blocks "
                         "to 2.42 at 8; bcdflow compare measures yours)")
    sp.add_argument("--probe", action="store_true",
                    help="measure the store's write and read GB/s with a few activation shards (written, read, removed)")
    sp.add_argument("--json", action="store_true", help="the plan (and plan-memory's tables) as JSON")
    sp.set_defaults(fn=cmd_plan)


# -- the dataset's size ---------------------------------------------------------------------------------------------

def dataset_size(cfg, tokens):
    """``--tokens`` as given, else the run's token dataset prepared in the store (tokenized once, as the run would;
    a run started later reuses it) and its row counts read back."""
    from bcdflow.core.forecast import Dataset

    if tokens is not None:
        return Dataset.of_tokens(_number("--tokens", tokens), cfg.data.seq_len, cfg.data.val_fraction)
    from bcdflow.core.context import open_store
    from bcdflow.storage.layout import DATASET_META, dataset_key
    from bcdflow.tasks.data import token_dataset

    store = open_store(cfg)
    store.probe()
    ds_id = token_dataset(cfg, store)
    meta = store.read_json(dataset_key(ds_id, DATASET_META))
    return Dataset(int(meta.get("n_tokens", (meta["n_train"] + meta["n_val"]) * (cfg.data.seq_len + 1))),
                   meta["n_train"], meta["n_val"])


def _number(flag: str, text) -> float:
    from bcdflow.core.forecast import positive

    return positive(flag, text)


# -- the store's rates, measured -------------------------------------------------------------------------------------

def probe_store(cfg, d_model: int) -> dict:
    """The configured store's rates with activation shards of the run's layout (``storage/probe.py``)."""
    from bcdflow.core.context import open_store
    from bcdflow.storage import probe

    store = open_store(cfg)
    store.probe()
    b = cfg.bcd
    return probe.probe_store(store, cfg.data.seq_len, d_model, b.shard_rows, b.act_dtype, b.act_compression)


# -- the command -----------------------------------------------------------------------------------------------------

def build(cfg, args) -> dict:
    """The plan as a dict: the run's (core/forecast.RunForecast) and plan-memory's."""
    from bcdflow.core.context import block_plan, model_config
    from bcdflow.core.figures import figures
    from bcdflow.core.forecast import forecast_run, run_rates
    from bcdflow.flows.plan_memory import plan as memory_plan
    from bcdflow.models.memory import device_budget

    mcfg = model_config(cfg)
    ds = dataset_size(cfg, args.tokens)
    measured = probe_store(cfg, mcfg.d_model) if args.probe else None
    rates = run_rates(cfg, args.store_gbs, args.write_gbs, args.read_gbs, args.preinfer_gpus, args.preinfer_tflops,
                      measured)
    budget = device_budget(args.gpu_gb * GB, gpus=cfg.train.world).usable
    bplan = block_plan(cfg, mcfg)
    p = forecast_run(cfg, figures(cfg, mcfg, bplan, budget), ds, rates,
                     **({"bf": args.bf} if args.bf is not None else {}))
    out = p.to_dict()
    out["model"] = {"family": mcfg.family, "n_layer": mcfg.n_layer, "d_model": mcfg.d_model,
                    "vocab_size": mcfg.vocab_size}
    out["config"] = {"blocks": len(bplan.blocks), "visits": len(bplan.visits), "plan": bplan.counts(),
                     "batch_size": cfg.train.batch_size, "seq_len": cfg.data.seq_len, "max_steps": cfg.bcd.max_steps, "sample_rate": cfg.bcd.sample_rate, "precision":
                     cfg.train.precision, "act_dtype": cfg.bcd.act_dtype, "preinfer": cfg.bcd.preinfer,
                     "train_gpus": cfg.spend.train_gpus or cfg.train.world, "train_device": cfg.spend.train_device,
                     "preinfer_device": cfg.spend.preinfer_device, "gpu_gb": args.gpu_gb}
    for v in out["visits"]:  # what a visit of another kind than a block's own trains (a row visit: matrix[lo:hi])
        target = bplan.visits[v["block"]]
        v["trains"] = target.mechanism.label(target)
        if v["trains"]:
            v["kind"] = target.kind
    out["memory"] = memory_plan(cfg, args.gpu_gb)
    return out


def _gb(b: float) -> str:
    """Bytes in GB, or TB from 10 TB."""
    return f"{b / GB:,.1f} GB" if b < 1e13 else f"{b / 1e12:,.1f} TB"


def _h(s: float) -> str:
    """Hours in a table's column (its head says so), seconds below 0.01 h: ``0.3s``, ``<0.1s`` (not ``0s``)."""
    from bcdflow.core.forecast import duration_text

    return f"{s / 3600:.2f}" if s >= 36 else duration_text(s)


def _usd(x: float) -> str:
    """Dollars, sub-cent ones with two significant digits (``$0.00031``, not ``$0.00``)."""
    from bcdflow.core.forecast import usd_text

    return usd_text(x)


def _gpu_h(h: float) -> str:
    from bcdflow.core.forecast import small_text

    return f"{h:,.1f}" if h >= 0.05 or h <= 0 else small_text(h)


def table(res: dict) -> str:
    c, r, m = res["config"], res["rates"], res["model"]
    ds = res["dataset"]
    lines = [f"{m['family']} {m['n_layer']} layers, d={m['d_model']}, vocab={m['vocab_size']}; {ds['tokens']:,} tokens "
             f"= {ds['n_train']:,} training rows of {c['seq_len']}; {c['plan']}, batch {c['batch_size']}, "
             f"step cap {c['max_steps']}, sample rate {c['sample_rate']:g}, {c['precision']}, activations "
             f"{c['act_dtype']}; {res['cycles']} cycle(s).",
             f"Rates: store write {r['write_gbs']:g} GB/s, read {r['read_gbs']:g} GB/s"
             + (" (measured by --probe)" if r.get("measured") else "")
             + f"; training {c['train_gpus']} x {c['train_device']} at {r['train_tflops']:g} TFLOP/s; pre-inference "
             f"{r['preinfer_gpus']} x {c['preinfer_device']} at {r['preinfer_tflops']:g} TFLOP/s"
             + (" beside the training box" if r["preinfer_elsewhere"] else " (the training box)") + ".", "",
             "Per visit: activation bytes pre-inference writes and training reads, mid-visit checkpoints written; hours "
             "(s: seconds) of pre-inference, store transfers (all of them, overlapped or not), training, evaluation, "
             "the visit's wall time; GB = 1e9 bytes:"]
    head = (f"{'visit':<7}{'layers':>8}{'rows':>10}{'steps':>6}  {'pre':<4}{'written':>12}{'read':>12}"
            f"{'ckpts':>12}{'pre-inf':>9}{'store':>8}{'train':>8}{'eval':>7}{'wall':>8}{'GPU $':>10}  fits")
    lines += [head, "-" * len(head)]
    for v in res["visits"]:
        io = (v["preinfer_write_s"] + v["read_s"] + v["load_s"] + v["prefix_load_s"] + v["checkpoint_s"]
              + v["commit_s"])
        where = v["kind"] if v.get("trains") else "%d-%d" % tuple(v["layers"])
        lines.append(f"b{v['block']:<6}{where:>8}{v['rows']:>10,}{v['steps']:>6}  "
                     f"{'yes' if v['preinfer'] else 'no':<4}{_gb(v['written']):>12}{_gb(v['read']):>12}"
                     f"{_gb(v['checkpoints'] * v['checkpoint_bytes']):>12}"
                     f"{_h(v['preinfer_s']):>9}{_h(io):>8}{_h(v['train_s']):>8}{_h(v['eval_s']):>7}"
                     f"{_h(v['wall_s']):>8}{_usd(v['gpu_usd']).replace('$', ''):>10}  {'yes' if v['fits'] else 'NO'}")
    lines.append("")
    lines += [f"  b{v['block']}: " + (f"trains {v['trains']}; " if v.get("trains") else "") + v["why"]
              for v in res["visits"]]
    lines += _comm_lines(res)
    for name, t in (("one cycle", res["cycle"]), (f"the run ({res['cycles']} cycles)", res["run"])):
        hours = ", ".join(f"{_gpu_h(h)} {k}" for k, h in t["gpu_hours"].items())
        wall = f"{t['wall_s'] / 3600:,.2f} h" if t["wall_s"] >= 36 else _h(t["wall_s"])
        lines += ["", f"{name}: {wall} wall; GPU-hours {hours}; activations written "
                      f"{_gb(t['written'])}, read {_gb(t['read'])}; store written {_gb(t['store_written'])}, "
                      f"peak {_gb(t['store_peak'])}",
                  f"  {_usd(t['usd'])} = GPUs {_usd(t['gpu_usd'])} + storage {_usd(t['storage_usd'])} + requests "
                  f"{_usd(t['request_usd'])} + egress {_usd(t['egress_usd'])}"]
    lines += ["", f"store peak: token dataset {_gb(res['dataset_bytes'])} + versions (version 0: "
                  f"{_gb(res['model_bytes'])}, each visit adds its block files) + one visit's activations and two "
                  "mid-visit checkpoints"]
    lines += [f"note: {n}" for n in res["notes"]]
    lines += _full_lines(res)
    mem = res["memory"]["recommendation"]["line"]
    lines += ["", f"memory (bcdflow plan-memory for the tables): {mem}"]
    return "\n".join(lines)


def _comm_lines(res: dict) -> list[str]:
    """Each visit's all-reduce a step, where several processes train it."""
    full = res.get("full")
    if not full or full["gpus"] == 1:
        return []
    lines = ["", f"All-reduce a step on {full['cluster']} (ring: each GPU sends 2(n-1)/n of the gradients; exposed: "
                 "what outlasts the backward that makes them):"]
    for v in res["visits"]:
        c = v["comm"]
        lines.append(f"  b{v['block']}: {_gb(c['bytes'])} of gradients, {_gb(c['wire_bytes'])} sent a GPU, "
                     f"{_sec(c['seconds'])} ({_sec(c['exposed_s'])} exposed) against a {_sec(v['step_s'])} step")
    return lines


def _sec(s: float) -> str:
    """A step's seconds: ``24s``, ``0.31s``, ``<0.1s`` (core/forecast.duration_text below 10 s)."""
    from bcdflow.core.forecast import duration_text

    return f"{s:,.0f}s" if s >= 9.95 else duration_text(s)


def _full_lines(res: dict) -> list[str]:
    """Full training beside the run, on the same cluster, to the same loss."""
    full = res.get("full")
    if not full:
        return []
    lines = ["", f"Full training to the same loss on the same {full['cluster']} ({full['steps']:,.0f} steps; "
                 "bcdflow's run: every stage counted):"]
    bcd = full["bcd"]
    from bcdflow.core.forecast import duration_text

    head = f"  {'':<22}{'step':>9}{'of it, comm':>13}{'wall':>12}{'money':>13}"
    lines += [head, f"  {'bcdflow (this plan)':<22}{'':>9}{'':>13}{duration_text(bcd['wall_s']):>12}"
                    f"{_usd(bcd['usd']):>13}"]
    for w in full["ways"]:
        fits = "" if w["fits"] else f"  does not fit ({w['peak'] / GB:,.1f} GB a GPU)"
        lines.append(f"  {w['way']:<22}{_sec(w['step_s']):>9}{_sec(w['comm']['exposed_s']):>13}"
                     f"{duration_text(w['wall_s']):>12}{_usd(w['usd']):>13}{fits}")
    b = full["best"]
    if b is None:
        lines.append("  full training fits no way on this card: bcdflow is the way that runs")
    else:
        t, u = b["time_x"], b["usd_x"]
        lines.append(f"  bcdflow takes {t:.2f}x the time of {b['way']}" + (f" and {u:.2f}x its money" if u else "")
                     + ("" if t < 1 else " (full training wins here)"))
    return lines


def cmd_plan(args) -> int:
    for flag, v in (("--gpu-gb", args.gpu_gb), ("--store-gbs", args.store_gbs), ("--write-gbs", args.write_gbs),
                    ("--read-gbs", args.read_gbs), ("--preinfer-gpus", args.preinfer_gpus),
                    ("--preinfer-tflops", args.preinfer_tflops), ("--tflops", args.tflops),
                    ("--pcie-gbs", args.pcie_gbs), ("--nodes", args.nodes), ("--gpus", args.gpus),
                    ("--link-gbs", args.link_gbs), ("--gpu-link-gbs", args.gpu_link_gbs), ("--bf", args.bf)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise BadInput(f"{flag}: must be a positive number, got {v:g}")
    if args.gpu_gb > MAX_MEMORY_GB:  # finite, but its bytes overflowed the planner's integers
        raise BadInput(f"--gpu-gb: must be a positive number of GB up to {MAX_MEMORY_GB:g} (past any card), got "
                       f"{args.gpu_gb:g}")
    for flag, v, what in (("--preinfer-gpus", args.preinfer_gpus, "GPUs"), ("--nodes", args.nodes, "machines"),
                          ("--gpus", args.gpus, "GPUs")):
        if v is not None and v != int(v):
            raise BadInput(f"{flag}: must be a whole number of {what}, got {v:g}")
    sets = list(args.set or [])
    sets += [f"train.nodes={int(args.nodes)}"] if args.nodes else []
    sets += [f"train.gpus={int(args.gpus)}"] if args.gpus else []
    sets += [f"train.link_gbs={args.link_gbs}"] if args.link_gbs else []
    sets += [f"train.gpu_link_gbs={args.gpu_link_gbs}"] if args.gpu_link_gbs else []
    sets += [f"train.pcie_gbs={args.pcie_gbs}"] if args.pcie_gbs else []
    sets += [f"train.tflops={args.tflops}"] if args.tflops else []
    res = build(like.like_config(args.config, sets, args.like, "bcd"), args)
    print(strict_json(res) if args.json else table(res))
    return 0
