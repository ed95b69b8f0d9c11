"""``bcdflow`` command line: demo, train, baseline, resume, status, export, compare.

    bcdflow demo                         # tiny model, built-in corpus, embedded defaults
    bcdflow train -c run.yaml --set bcd.blocks=4 --run-id my-run
    bcdflow status my-run --json
    bcdflow export my-run ./out
    bcdflow export my-run ./hf-out --format hf --dtype bf16   # a transformers model directory
    bcdflow compare full-run bcd-run --json   # loss and cost against the first run (the baseline)

Bad input (unknown key or value, missing data file, empty corpus, ...) prints one line naming the
key or file and exits with status 2, before anything is written to the store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from core.errors import BadInput, DamagedArtifact

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1

DEMO = [
    "model.name=tiny", "data.seq_len=128", "data.vocab_size=2048", "bcd.blocks=3", "bcd.cycles=2",
    "bcd.max_steps=60", "bcd.window=10", "bcd.shard_rows=256", "optim.lr=0.003", "optim.warmup_steps=10",
    "train.batch_size=16", "train.steps=240", "train.eval_rows=128",
]


def _env_defaults() -> None:
    # the embedded default: Prefect's temporary server, nothing phoned home, patience for a first migration
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class RunFailed(Exception):
    """A run stopped on a fault (store outage, preemption, crash): its committed work is safe."""

    def __init__(self, run_id: str, store: str, cause: BaseException):
        first = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"run {run_id} failed: {type(cause).__name__}: {first}\n"
                         f"bcdflow: committed visits are safe; continue with: bcdflow resume {run_id} --store {store}")


def _preflight(cfg) -> None:
    """Checks that need the file system, done before any flow starts (nothing written on failure)."""
    from tasks.data import data_files

    if cfg.data.tokenizer and not os.path.isfile(cfg.data.tokenizer):
        raise BadInput(f"data.tokenizer: no such file {cfg.data.tokenizer!r}")
    if cfg.model.from_hf:  # every shard, tensor and the tokenizer, before a flow starts
        from core.hf import check_checkpoint

        check_checkpoint(cfg)
    files = data_files(cfg) if cfg.data.files else None
    if files is not None and sum(os.path.getsize(f) for f in files) == 0:
        raise BadInput(f"data.files: corpus is empty (0 bytes in {len(files)} files)")


def _config(args, base: list[str] | None = None):
    from core.config import load_config

    sets = list(base or []) + list(args.set or [])
    if getattr(args, "store", None):
        sets.append(f"store={args.store}")
    cfg = load_config(args.config, sets)
    _preflight(cfg)
    return cfg


def _run(args, mode: str, base: list[str] | None = None) -> dict:
    cfg = _config(args, base)
    from flows.params import new_run_id

    run_id = args.run_id or new_run_id(mode)
    from flows.bcd import bcd_train, full_train

    fn = full_train if mode == "full" else bcd_train
    summary = _call(fn, cfg, run_id)
    print(json.dumps(summary, indent=2))
    return {"cfg": cfg, "run_id": run_id, "summary": summary}


def cmd_resume(args) -> int:
    """Continue a run from its stored config: committed visits are skipped, complete shards reused, an
    interrupted visit continues from its last checkpoint, the MLflow run is continued."""
    from storage import runs
    from core.config import RunConfig, parse_config

    store = _store(args.store, args)
    if runs.read_state(store, args.run_id) is None:
        raise BadInput(f"run {args.run_id!r} not found in store {args.store}")
    stored = runs.read_config(store, args.run_id)
    raw = {k: v for k, v in stored.items() if k in RunConfig.model_fields}
    cfg = parse_config({**raw, "store": args.store})
    from flows.bcd import bcd_train, full_train

    fn = full_train if stored.get("mode") == "full" else bcd_train
    print(json.dumps(_call(fn, cfg, args.run_id), indent=2))
    return 0


def _call(fn, cfg, run_id: str) -> dict:
    from flows.params import RunParams

    try:
        return fn(config=RunParams.from_config(cfg), run_id=run_id)
    except (BadInput, DamagedArtifact, SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        raise RunFailed(run_id, cfg.store, e) from e


def _store(url: str, args=None):
    """The store named on the command line, with the s3 options of a stored run config where needed."""
    from storage.store import Store
    from core.config import RunConfig

    opts = {}
    if url.startswith("s3://") and getattr(args, "endpoint_url", None):
        opts = RunConfig(store=url, s3={"endpoint_url": args.endpoint_url}).storage_options()
    return Store(url, opts)


def cmd_train(args) -> int:
    _run(args, "bcd")
    return 0


def cmd_baseline(args) -> int:
    _run(args, "full")
    return 0


def cmd_demo(args) -> int:
    out = _run(args, "bcd", DEMO)
    cfg, run_id = out["cfg"], out["run_id"]
    print(_status_table(cfg.store, run_id, args))
    uri = cfg.resolved_tracking_uri()
    print(f"\nresults: store {cfg.store} run {run_id}")
    print(f"  bcdflow status {run_id} --store {cfg.store}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000)")
    print("  Prefect UI: prefect server start   (then open http://127.0.0.1:4200; the demo's flow runs are in "
          f"{os.environ.get('PREFECT_HOME', '~/.prefect')}/prefect.db)")
    return 0


def status_dict(store_url: str, run_id: str, args=None) -> dict:
    from storage import runs

    store = _store(store_url, args)
    state = runs.read_state(store, run_id)
    if state is None:
        raise BadInput(f"run {run_id!r} not found in store {store_url}")
    cfg = runs.read_config(store, run_id)
    keep = ("cycle", "block", "version", "steps", "train_loss", "val_loss", "val_ppl", "seconds",
            "preinfer_seconds", "train_seconds", "tokens_per_s", "stopped_by")
    return {"run_id": run_id, "version": state.version, "status": state.status,
            "mode": state.mode, "blocks": cfg["plan"]["blocks"],
            "visits": [v.model_dump(include=set(keep)) for v in state.visits]}


def _status_table(store_url: str, run_id: str, args=None) -> str:
    st = status_dict(store_url, run_id, args)
    lines = [f"run {run_id}: version {st['version']} ({st['status']}, {st['mode']})",
             f"{'cycle':>5} {'block':>5} {'ver':>4} {'steps':>6} {'train':>8} {'val':>8} {'secs':>7}"]
    for v in st["visits"]:
        lines.append(f"{v['cycle']:>5} {v['block']:>5} {v['version']:>4} {v['steps']:>6} "
                     f"{v['train_loss']:>8.4f} {v['val_loss']:>8.4f} {v['seconds']:>7.1f}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    if args.json:
        print(json.dumps(status_dict(args.store, args.run_id, args), indent=2))
    else:
        print(_status_table(args.store, args.run_id, args))
    return 0


def cmd_compare(args) -> int:
    from flows.compare import CompareError, compare

    try:
        result = compare(_store(args.store, args), args.run_ids)
    except CompareError as e:
        raise BadInput(str(e)) from None
    print(json.dumps(result, indent=2) if args.json else result["markdown"])
    return 0


def cmd_export(args) -> int:
    from storage import runs
    from core.export import export_hf, export_version

    store = _store(args.store, args)
    state = runs.read_state(store, args.run_id)
    if state is None:
        raise BadInput(f"run {args.run_id!r} not found in store {args.store}")
    version = state.version if args.version is None else args.version
    if not 0 <= version <= state.version:
        raise BadInput(f"--version: run {args.run_id!r} has versions 0..{state.version}, got {version}")
    if args.format == "hf":
        n = export_hf(store, args.run_id, version, args.out_dir, dtype=args.dtype)
    elif args.dtype:
        raise BadInput("--dtype: only with --format hf (the bcdflow format keeps the stored tensors as they are)")
    else:
        n = export_version(store, args.run_id, version, args.out_dir)
    print(f"exported run {args.run_id} version {version} ({n} tensors, {args.format} format) to {args.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bcdflow", description="Block coordinate descent training on Prefect.")
    sub = p.add_subparsers(dest="command", required=True)

    def run_opts(sp):
        sp.add_argument("-c", "--config", help="YAML config file")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
        sp.add_argument("--run-id", help="run id (an existing id resumes that run)")
        sp.add_argument("--store", help="store URL (same as --set store=URL)")

    for name, fn, helptext in (("demo", cmd_demo, "tiny model on the built-in corpus, embedded defaults"),
                               ("train", cmd_train, "train with block coordinate descent"),
                               ("baseline", cmd_baseline, "full-parameter baseline")):
        sp = sub.add_parser(name, help=helptext)
        run_opts(sp)
        sp.set_defaults(fn=fn)
    def store_opts(sp):
        sp.add_argument("run_id")
        sp.add_argument("--store", default="./bcdflow-store", help="store URL (default ./bcdflow-store)")
        sp.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// store")

    sp = sub.add_parser("resume", help="continue an interrupted run where it stopped")
    store_opts(sp)
    sp.set_defaults(fn=cmd_resume)
    sp = sub.add_parser("status", help="a run's blocks and visits")
    store_opts(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_status)
    sp = sub.add_parser("export", help="write model.safetensors + config.json of a version")
    store_opts(sp)
    sp.add_argument("out_dir")
    sp.add_argument("--version", type=int)
    sp.add_argument("--format", choices=("bcdflow", "hf"), default="bcdflow",
                    help="bcdflow (default) or hf: a directory transformers' from_pretrained loads")
    sp.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                    help="tensor dtype of --format hf (default: the source checkpoint's, else fp32)")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("compare", help="loss and cost of runs against the first (B-F multiplier, what-if cost)")
    sp.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="the baseline first, then the others")
    sp.add_argument("--store", default="./bcdflow-store", help="store URL (default ./bcdflow-store)")
    sp.add_argument("--endpoint-url", help="S3-compatible endpoint for an s3:// store")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BadInput as e:
        print(f"bcdflow: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (DamagedArtifact, RunFailed) as e:
        print(f"bcdflow: error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
