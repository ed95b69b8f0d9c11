"""Is BCD as good as full training when fine-tuning? (issue 18): pretrain a small base with full training on one
corpus, export it as a Hugging Face checkpoint (``bcdflow export --format hf``), then fine-tune that checkpoint
(``model.from_hf``) full vs BCD on another corpus (text) and on prompt/completion records, several seeds, and
report the suite's figures (benchmarks/suite.py: B-F multiplier to L* = the full fine-tune's final validation loss
+ tol, equal-step gap, CPU-time ratio).

    python -m benchmarks finetune --out benchmarks/out/finetune            # ~40 min on 2 CPU cores
    python -m benchmarks finetune --seeds 0 --settings lora-r16            # one seed, the default BCD setting
    python -m benchmarks finetune --base-corpus docsrc --base-steps 6000   # a base that knows Python (~13 min)
    python -m benchmarks finetune --target best --bytes 1000000 --ft-steps 1500   # several epochs: L* from the best

The runs use the validity suite's quick profile (``_SUITE_QUICK``: model, batch, sequence, window, the BCD and
full settings) with ``optim.lr`` = ``--lr`` (2e-3, the pretraining rate) for the fine-tunes and ``--ft-steps``
full fine-tuning steps. Prompt/completion records (``sft``): the functions with a docstring in the ``pysrc``
packages' sources; the prompt is the ``def`` line and the docstring's first line, the completion the body after
the docstring; only completion tokens train (``data.format=prompt_completion``). Everything is built from what
is installed here; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import time
from pathlib import Path

from benchmarks import corpora
from benchmarks.profiles import profile
from benchmarks.report import text_table
from benchmarks.runs import book, flow_server
from benchmarks.suite import COLUMNS, compare, run_row, summarize

BASE_CORPUS, TEXT_CORPUS = "docs", "pysrc"


def sft_records(dest: Path, max_bytes: int) -> list[str]:
    """Prompt/completion records (JSON lines) from the functions with a docstring of the ``pysrc`` packages, in a
    fixed shuffled order, at most ``max_bytes`` of text; reused when built already."""
    path = dest / f"sft-{max_bytes}.jsonl"
    if path.is_file():
        return [str(path)]
    dest.mkdir(parents=True, exist_ok=True)
    records, seen = [], set()
    for pkg in corpora.PACKAGES[TEXT_CORPUS]:
        root = corpora.package_root(pkg)
        if root is None:
            continue
        for f in corpora.package_files(root, f"sft/{pkg}"):
            src = corpora.read_source(f)
            if src is None:
                continue
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            lines = src.splitlines(keepends=True)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                    continue
                doc = node.body[0]
                if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)) or len(node.body) < 2:
                    continue
                head = "".join(lines[node.lineno - 1:node.body[0].lineno - 1])  # the def line(s)
                summary = doc.value.value.strip().split("\n")[0].strip()
                indent = " " * node.body[0].col_offset
                prompt = f'{head}{indent}"""{summary}"""\n'  # what the function does, in a line
                completion = "".join(lines[node.body[1].lineno - 1:node.end_lineno])
                if (not summary or not completion.strip() or len(prompt) > 300 or len(completion) > 2000
                        or prompt in seen):
                    continue
                seen.add(prompt)
                records.append({"prompt": prompt, "completion": completion})
    random.Random("sft").shuffle(records)
    out, size = [], 0
    for r in records:
        size += len(r["prompt"]) + len(r["completion"])
        if size > max_bytes:
            break
        out.append(r)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in out))
    os.replace(tmp, path)
    return [str(path)]


def _positive(text: str) -> int:
    """An argparse type: a step count of at least 1 (argparse names the option and exits 2 otherwise)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps, at least 1 (got {text!r})")
    return n


def add_parser(sub) -> None:
    ap = sub.add_parser("finetune", help="BCD vs full fine-tuning of a pretrained base: finetune.md, finetune.json",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/out/finetune")
    ap.add_argument("--corpus-dir", default=None, help="where corpora are built or reused (default OUT/corpora)")
    ap.add_argument("--profile", default="quick", choices=["quick", "tiny"], help="tiny: a smoke run (the tests)")
    ap.add_argument("--model", default=None, help="a model of the profile's suite (default: its first)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=None,
                    help="BCD settings of the profile's suite (default: lora-r16, the product's defaults)")
    ap.add_argument("--tasks", nargs="+", default=["text", "sft"], choices=["text", "sft"])
    ap.add_argument("--lr", type=float, default=2e-3,
                    help="fine-tuning learning rate, full and BCD alike (the full fine-tunes end lower at 2e-3 "
                         "than at 1e-3)")
    ap.add_argument("--ft-steps", type=int, default=300, help="full fine-tuning steps")
    ap.add_argument("--base-corpus", default=BASE_CORPUS, choices=["docs", "docsrc"],
                    help="what the base is pretrained on: docs (English reference prose: fine-tuning on code is a "
                         "new domain) or docsrc (Python sources of other packages than the fine-tuning data's)")
    ap.add_argument("--base-steps", type=_positive, default=None, help="the base's pretraining steps (default: the "
                                                                  "suite's baseline steps)")
    ap.add_argument("--bytes", type=int, default=3_000_000, help="size of each fine-tuning corpus")
    ap.add_argument("--target", default="final", choices=["final", "best"],
                    help="L* = the full fine-tune's final validation loss + tol (a short fine-tune, still falling), "
                         "or its best (a fine-tune of several epochs, past its minimum: early stopping)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides, every run")
    ap.add_argument("--bcd-set", action="append", default=[], metavar="KEY=VALUE",
                    help="overrides of the BCD fine-tunes only (a lever: bcd.blocks, bcd.lr_scales, ...)")


def main(args, argv: list[str]) -> int:
    """The ``finetune`` command (``benchmarks.cli.main`` parsed ``argv`` into ``args``)."""
    prof = profile(args.profile)
    s = prof["suite"]
    args.model = args.model or next(iter(s["models"]))
    args.settings = args.settings or [k for k in s["settings"] if k == "lora-r16"] or [next(iter(s["settings"]))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cdir = Path(args.corpus_dir) if args.corpus_dir else out / "corpora"
    t0 = time.perf_counter()
    base_bytes = s["corpora"].get(BASE_CORPUS, args.bytes)
    base_files = corpora.build(args.base_corpus, cdir / f"{args.base_corpus}-{base_bytes}", base_bytes)
    tasks = {"text": (corpora.build(TEXT_CORPUS, cdir / f"{TEXT_CORPUS}-{args.bytes}", args.bytes), []),
             "sft": (sft_records(cdir, args.bytes), ["data.format=prompt_completion"])}
    bk = book(args.profile, prof, 1, section="suite")
    optim, model = s["optim"], s["models"][args.model]
    res = {"command": "python -m benchmarks " + " ".join(argv),
           "rows": [], "seeds": {}}
    with flow_server():
        base_steps = [f"train.steps={args.base_steps}"] if args.base_steps else []
        base = bk.get("base", "full", optim, [*model, f"data.files={json.dumps(base_files)}", "seed=0", *s["full"],
                                              *base_steps, *args.set])
        ckpt = out / "base-hf"
        shutil.rmtree(ckpt, ignore_errors=True)  # this command's own output of an earlier run
        from bcdflow.flows.cli import main as cli

        if cli(["export", base["run_id"], str(ckpt), "--store", str(bk.root / "store"), "--format", "hf",
                "--dtype", "fp32"]) != 0:
            raise SystemExit("exporting the base failed")
        res["base"] = run_row(base)
        print(f"base: {args.base_corpus}, {args.model}, final val {base['final_val']:.4f}; exported to {ckpt}",
              flush=True)
        for task in args.tasks:
            files, extra = tasks[task]
            common = [f"model.from_hf={ckpt}", f"data.files={json.dumps(files)}", *extra, f"optim.lr={args.lr}",
                      *args.set]
            cells: dict[str, list[dict]] = {k: [] for k in args.settings}
            for seed in args.seeds:
                full = bk.get(f"{task}/s{seed}/full", "full", optim,
                              [*common, f"seed={seed}", *s["full"], f"train.steps={args.ft_steps}"])
                for k in args.settings:
                    target = full[f"{args.target}_val"] + s["tol"]
                    bcd = bk.get(f"{task}/s{seed}/{k}", "bcd", optim,
                                 [*common, f"seed={seed}", *s["bcd"], *s["settings"][k], *args.bcd_set,
                                  f"stop.target_val_loss={target:.6f}"])
                    cell = {**compare(full, bcd, s["tol"], args.target), "cap_steps": None, "run": run_row(bcd)}
                    cells[k].append(cell)
                    res["seeds"].setdefault(task, {}).setdefault(str(seed), {})[k] = cell
            for k in args.settings:
                res["rows"].append(summarize(task, args.model, k, cells[k]))
            res["seconds"] = time.perf_counter() - t0
            (out / "finetune.json").write_text(json.dumps(res, indent=1, default=str))
    from benchmarks.suite import table_rows

    table = text_table(table_rows({"groups": [{"rows": {r["setting"] + r["corpus"]: r for r in res["rows"]}}]}),
                       COLUMNS)
    b = res["base"]
    (out / "finetune.md").write_text(
        f"# Fine-tuning validity\n\n`{res['command']}`\n\nBase: full training on `{args.base_corpus}`, {b['steps']} "
        f"steps, final val {b['final_val']:.4f}. Full fine-tunes: {args.ft_steps} steps at lr {args.lr:g}; L* = their "
        f"{args.target} validation loss + {s['tol']}.\n\n```\n{table}\n```\n")
    print("\n" + table)
    print(f"\nwrote {out / 'finetune.json'} and {out / 'finetune.md'} in {time.perf_counter() - t0:.0f} s")
    return 0

