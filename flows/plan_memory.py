"""``bcdflow plan-memory -c run.yaml --gpu-gb 24``: how every visit of a run would hold its model on a card of that
size and what that costs, from the model config alone (models/memory.py, models/holding.py: a meta-device model,
no weights, no store), and the smallest ``bcd.blocks`` whose every visit fits.

The budget is the card less the CUDA context and a stated reserve (workspaces, fragmentation: models/memory.py
``device_budget``). Each visit is held as a run would hold it (``bcd.recompute``, ``train.offload``: with ``auto``,
the frozen layers that fit stay resident and only the rest stream, and recompute is used where it is the faster way
to fit); the table says which layers the visit trains and which it holds, how many of those stay resident, the
pinned host memory and bytes copied per step of what streams, and the predicted step time resident and as held
(a per-phase pipeline of compute at ``train.tflops`` and copies at ``train.pcie_gbs``, else ``spend.train_device``'s
rates: models/specs.CARD_RATES) with the tokens per step from which the copies hide.

    bcdflow plan-memory --set model.name=L-6B --set train.batch_size=2 --set data.seq_len=1024 \\
        --set train.precision=bf16 --gpu-gb 24
    bcdflow plan-memory --set model.from_hf=./llama-3-8b-config/ ...   # a directory with config.json alone will do
"""
from __future__ import annotations

import textwrap

from bcdflow.constants import MAX_MEMORY_GB
from bcdflow.errors import BadInput
from bcdflow.tracking.tables import strict_json

def add_parser(sub, common) -> None:
    sp = sub.add_parser("plan-memory", parents=[common],
                        help="how each visit holds its model on a card, its peak and step time; the blocks that fit")
    sp.add_argument("-c", "--config", help="YAML config file (as for train)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    sp.add_argument("--gpu-gb", type=float, default=24.0,
                    help="the card's memory, GB (1e9 bytes; default 24); the context and a reserve come off it")
    sp.add_argument("--pcie-gbs", type=float, default=None,
                    help="host-to-device bandwidth for streamed layers, GB/s (default: train.pcie_gbs, else "
                         "spend.train_device's: 25 on an rtx4090)")
    sp.add_argument("--tflops", type=float, default=None,
                    help="matmul throughput a step reaches, TFLOP/s (default: train.tflops, else spend.train_device's "
                         "at the precision: 40 in fp32, 80 in bf16 on an rtx4090)")
    sp.add_argument("--json", action="store_true", help="the tables and the recommendation as JSON")
    sp.set_defaults(fn=cmd_plan_memory)


def _visit_row(h, plan_, b: int) -> dict:
    e, t = h.estimate, h.time
    target = plan_.visits[b]
    row = dict(e.to_dict(), block=b, trains=list(target.layers), holds=list(e.layers), recompute=h.recompute,
               rows=None, streamed=list(h.streamed), resident_layers=e.frozen_layers - len(h.streamed), fits=h.fits,
               holding=h.words(), step_resident_s=t.resident_s, step_s=t.streamed_s, overhead=t.overhead,
               copy_fwd_bytes=t.copy_fwd_bytes, copy_bwd_bytes=t.copy_bwd_bytes,
               hides_at_tokens=t.hides_at_tokens)
    row.update(target.mechanism.report(target))  # a row visit: its matrix and rows, and its label
    return row


def _refused(cfg, settings: dict) -> str | None:
    """Why the run's config refuses a recommendation's ``settings`` (``section.key`` -> value), by the config's own
    checks (core/config.py: what ``--set`` of them would say), or None: a recommendation is only what the config
    takes."""
    from pydantic import ValidationError

    from bcdflow.core.config import RunConfig

    data = cfg.model_dump()
    for key, v in settings.items():
        section, name = key.split(".", 1)
        data[section] = {**data.get(section, {}), name: v}
    try:
        RunConfig.model_validate(data)
    except ValidationError as e:
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        return msg.split("; set ")[0]
    return None


def plan(cfg, gpu_gb: float) -> dict:
    """Every visit at the config's ``bcd.blocks`` as the run would hold it on a ``gpu_gb`` card, full training, and
    the recommendation with its own visits."""
    from dataclasses import replace

    from bcdflow.core.context import model_config  # torch: not for `bcdflow --help` (flows/cli.py)
    from bcdflow.models import model_plan
    from bcdflow.models.holding import choose_holding, recommend, recommend_state
    from bcdflow.models.memory import GB, device_budget, plan_visits, visit_memory

    mcfg = model_config(cfg)
    t, shape, split = cfg.train, cfg.step_shape(), cfg.bcd.split
    B, T, p, opt = shape.batch, shape.seq, shape.precision, shape.optim
    budget = device_budget(gpu_gb * GB, gpus=t.world)
    full = visit_memory(mcfg, None, None, shape)

    def visits(blocks: int, boundaries: list[int] | None, vocab_blocks: int) -> list[dict]:
        plan_ = model_plan(mcfg, blocks, boundaries, split=split, freeze=shape.freeze, vocab_blocks=vocab_blocks)
        hs = [choose_holding(mcfg, plan_, b, shape, budget.usable) for b in range(len(plan_.visits))]
        return [_visit_row(h, plan_, b) for b, h in enumerate(hs)]

    # the fewest blocks that fit, their cut points chosen by fit, with the lighter state where it halves them
    rec = recommend_state(mcfg, shape, budget, split, cfg.bcd.shard_rows)
    if "bcd.vocab_blocks" in rec.settings and (why := _refused(cfg, rec.settings)):
        # row blocks fit where whole matrices fit in no block count, but this config refuses them (bcd.order=greedy,
        # a peer, several processes): recommending them sent the user to a config that then refused; say so instead
        k = rec.settings["bcd.vocab_blocks"]
        rec = recommend(mcfg, shape, budget, split, cfg.bcd.shard_rows)
        rec.hint = f"row blocks (bcd.vocab_blocks={k}) would fit, but not with this config ({why})"
    if rec.blocks is None and not shape.freeze:  # what freezing the big-vocabulary parts would make fit (a trade-off)
        alt = recommend(mcfg, replace(shape, freeze=("embeddings", "head")), budget, split, cfg.bcd.shard_rows)
        if alt.blocks is not None:
            rec.hint = "; ".join(h for h in (rec.hint, (
                f"with bcd.freeze=[embeddings,head] (no longer full-parameter): bcd.blocks={alt.blocks} fits (worst "
                f"visit {alt.worst_peak / GB:.1f} GB)")) if h)
    out = {"model": mcfg.to_dict(), "batch": B, "seq_len": T, "precision": p, "optim": opt, "gpu_gb": gpu_gb,
           "budget": {"card": budget.card, "free": budget.free, "reserve": budget.reserve, "usable": budget.usable,
                      "line": budget.line()},
           "blocks": cfg.bcd.blocks, **({"boundaries": cfg.bcd.boundaries} if cfg.bcd.boundaries else {}),
           "full": dict(full.to_dict(), fits=full.peak <= budget.usable),
           "pcie_gbs": shape.pcie_gbs, "tflops": shape.tflops, "stream_window": t.stream_window,
           "card": cfg.spend.train_device,
           "recompute": cfg.bcd.recompute, "offload": shape.offload,
           "visits": visits(cfg.bcd.blocks, cfg.bcd.boundaries, cfg.bcd.vocab_blocks),
           "recommendation": {"blocks": rec.blocks, "host_bytes": rec.host_bytes, "worst_peak": rec.worst_peak,
                              "line": rec.line() + (f"; {rec.hint}" if rec.hint else ""), "visits": []}}
    if rec.blocks is not None:
        plan_ = model_plan(mcfg, rec.blocks, rec.boundaries, split=split, freeze=shape.freeze,
                           vocab_blocks=rec.vocab_blocks)
        out["recommendation"]["visits"] = [_visit_row(h, plan_, b) for b, h in enumerate(rec.holdings)]
        out["recommendation"].update(boundaries=rec.boundaries, settings=rec.settings)
    if t.world > 1:  # per process, the batch split over the GPUs (as tasks/train_dist.choose_parallel plans one)
        out["per_gpu"] = {mode: max(e.peak for e in plan_visits(
            mcfg, cfg.bcd.blocks, replace(shape, recompute="off", parallel=mode), split)) for mode in ("ddp", "fsdp")}
    return out


WIDTH = 120  # the text output's columns

# the text table's columns: (header, width, group); a group's label spans its columns on the line above
# (units there, so the headers stay short and the table fits 120 columns; --json has every figure, the overhead too)
_GROUPS = {"mem": "GB at its peak", "frozen": "frozen", "stream": "streamed GB", "time": "step s"}
_COLS = (("visit", 8, None), ("trains", 9, None), ("holds", 7, None), ("params", 7, None),
         ("weights", 8, "mem"), ("grads", 6, "mem"), ("optim", 6, "mem"), ("act", 6, "mem"), ("peak", 7, "mem"),
         ("recomp", 7, "frozen"), ("kept", 6, "frozen"), ("pinned", 7, "stream"), ("copy", 6, "stream"),
         ("resident", 9, "time"), ("held", 7, "time"), ("hides at", 9, None), ("fits", 5, None))


def _cells(cells: list[str]) -> str:
    return "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w, _)) in enumerate(zip(cells, _COLS)))


def _group_line() -> str:
    line, at = "", 0
    for i, (_, w, g) in enumerate(_COLS):
        if g and (i == 0 or _COLS[i - 1][2] != g):  # a group's first column: its label over the group's span
            span = sum(w for _, w, gg in _COLS[i:] if gg == g)
            line = line.ljust(at) + f" {_GROUPS[g]} ".center(span - 1, "-").rjust(span)
        at += w
    return line


def _table(rows: list[dict], full: dict | None, cap: float) -> list[str]:
    gb = 1e9
    head = _cells([h for h, _, _ in _COLS])
    lines = [_group_line(), head, "-" * len(head)]
    for r in ([full] if full else []) + rows:
        lo, hi = r.get("trains") or r["layers"]
        hl, hh = r["layers"]
        if "holding" not in r:  # full training: one row, resident
            tail = ["-", "all", "-", "-", "-", "-", "-"]
        else:
            frozen = r["resident_layers"] + len(r["streamed"])
            tail = ["yes" if r["recompute"] else "no", f"{r['resident_layers']}/{frozen}" if frozen else "-",
                    f"{r['host_bytes'] / gb:.1f}", f"{(r['copy_fwd_bytes'] + r['copy_bwd_bytes']) / gb:.1f}",
                    f"{r['step_resident_s']:.3f}", f"{r['step_s']:.3f}",
                    f"{r['hides_at_tokens']:,}" if r["hides_at_tokens"] else "-"]
        trains = r.get("label") or f"{lo}-{hi}"
        mem = [r["weights"], r["grads_total"], r["optim"], r["activations"] + r["logits"]]
        lines.append(_cells([r["name"], trains, f"{hl}-{hh}", f"{r['trainable_params'] / 1e6:.0f}M",
                             *(f"{v / gb:.2f}" for v in mem), f"{r['peak'] / gb:.2f}", *tail,
                             "yes" if r["peak"] <= cap else "no"]))
    return lines


def _plan_words(blocks: int, boundaries: list[int] | None) -> str:
    return f"bcd.boundaries=[{','.join(map(str, boundaries))}]" if boundaries else f"bcd.blocks={blocks}"


def _rates_of(res: dict) -> str:
    """Whose rates the time model used: the card kind's (``spend.train_device``), or those set over it."""
    from bcdflow.models.specs import CARD_RATES

    card = CARD_RATES.get(res["card"])
    if card is None:
        return "train.tflops, train.pcie_gbs"
    given = [k for k, v in (("tflops", card.tflops(res["precision"])), ("pcie_gbs", card.pcie_gbs)) if res[k] != v]
    return ", ".join(f"train.{k}" for k in given) + f", else {res['card']}'s" if given else f"{res['card']}'s rates"


def table(res: dict) -> str:
    b = res["budget"]
    cap = b["usable"]
    lines = [f"{res['model']['family']} {res['model']['n_layer']} layers, d={res['model']['d_model']}, "
             f"vocab={res['model']['vocab_size']}; batch {res['batch']}x{res['seq_len']}, {res['precision']}, "
             f"{res['optim']}. A {res['gpu_gb']:g} GB card: {b['line']}.",
             f"Each visit as the run holds it (bcd.recompute={res['recompute']}, train.offload={res['offload']}, "
             f"{res['stream_window']} stream slots): the layers it trains and holds, its trainable parameters, "
             "predicted GB of one training step at its peak (act: activations and logits), whether it recomputes its "
             "frozen layers and how many it keeps resident, the pinned host GB and GB copied per step of those that "
             f"stream, the step's seconds all resident and as held (compute at {res['tflops']:g} TFLOP/s, copies at "
             f"{res['pcie_gbs']:g} GB/s: {_rates_of(res)}), and the tokens per step from which the copies hide.", "",
             f"{_plan_words(res['blocks'], res.get('boundaries'))} (this config):"]
    lines += _table(res["visits"], res["full"], cap)
    rec = res["recommendation"]
    if rec["blocks"] is not None and (rec["blocks"] != res["blocks"] or rec.get("boundaries") != res.get("boundaries")
                                      or {"optim.name", "bcd.vocab_blocks"} & set(rec.get("settings", {}))):
        words = " ".join([_plan_words(rec["blocks"], rec.get("boundaries"))]
                         + [f"{k}={v}" for k, v in rec.get("settings", {}).items()])
        lines += ["", f"{words} (recommended):"]
        lines += _table(rec["visits"], None, cap)
    if "per_gpu" in res:
        lines.append("per GPU, worst visit: " + ", ".join(f"{m} {v / 1e9:.2f}" for m, v in res["per_gpu"].items()))
    lines += ["", rec["line"]]
    # prose wrapped to the table's 120 columns (a terminal's width, not 434); --json keeps each line whole
    return "\n".join(textwrap.fill(ln, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
                     if len(ln) > WIDTH else ln for ln in lines)


def cmd_plan_memory(args) -> int:
    from bcdflow.core.config import load_config

    if not 0 < args.gpu_gb <= MAX_MEMORY_GB:
        raise BadInput(f"--gpu-gb: must be a positive number of GB up to {MAX_MEMORY_GB:g} (past any card), got "
                       f"{args.gpu_gb:g}")
    for flag, v in (("--pcie-gbs", args.pcie_gbs), ("--tflops", args.tflops)):
        if v is not None and not v > 0:
            raise BadInput(f"{flag}: must be positive, got {v:g}")
    sets = list(args.set or [])
    sets += [f"train.pcie_gbs={args.pcie_gbs}"] if args.pcie_gbs else []
    sets += [f"train.tflops={args.tflops}"] if args.tflops else []
    res = plan(load_config(args.config, sets), args.gpu_gb)
    print(strict_json(res) if args.json else table(res))
    return 0
