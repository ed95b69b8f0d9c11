"""``bcdflow`` command line: demo, train, baseline, resume, status, runs, export, compare, generate, prune, rm, config.

    bcdflow demo                         # tiny model, built-in corpus, embedded defaults
    bcdflow train -c run.yaml --set bcd.blocks=4 --run-id my-run
    bcdflow status my-run --json
    bcdflow runs [--store URL] [--json]  # every run of a store: done, running (which visit, how far) or interrupted
    bcdflow export my-run ./out
    bcdflow export my-run ./hf-out --format hf --dtype bf16   # a transformers model directory
    bcdflow baseline --like bcd-run --run-id full-run   # a baseline of a stored run's settings (flows/like.py)
    bcdflow compare full-run bcd-run --json   # loss and cost against the first run (the baseline)
    bcdflow compare full-run bcd-run --plot cmp.png   # and their validation curves against steps and spend
    bcdflow generate my-run "def main("       # sample text from a version, with the run's tokenizer
    bcdflow prune my-run --keep 2             # drop old versions and optimizer states; bcdflow rm my-run: the run
    bcdflow config show -c run.yaml           # the resolved config, every key with its meaning
    bcdflow worker --pool bcdflow-gpu         # a worker on a GPU box (visits as deployment runs, fleet.visit_pool)
    bcdflow plan-memory -c run.yaml --gpu-gb 24   # predicted peak memory per visit; the bcd.blocks that fits

The commands that only read (``--help``, ``runs``, ``status``, ``compare``, ``config show``'s parse) import neither
Prefect nor torch, so they answer at once; what needs them imports them inside the command.

What goes wrong is said in one line on stderr, never with a traceback (``--debug`` shows them):

- bad input (an unknown key or value, a missing data file, an empty or binary corpus, an invalid run id, a
  device this machine lacks, a store, MLflow server or PREFECT_HOME that cannot be reached or written, an
  argument out of its bounds): exit 2, checked before anything is written;
- a damaged store (a truncated state.json, a missing config.json, manifest or block file, a corrupt shard or
  checkpoint, any record out of its type or range): exit 1, naming the object and what to do;
- a closed output pipe (``bcdflow runs | head -1``): exit 141, quietly;
- a fault during a run (the store stayed down through the retries): exit 1, with the line that resumes it;
- Ctrl-C: the trainer checkpoints, exit 130 with the line that resumes it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from bcdflow.errors import BadInput, DamagedArtifact
from bcdflow.flows.compare import BRACKET_TOL, TOL
from bcdflow.flows.prefect_api import check_prefect_api, check_prefect_home, detach_temporary_server
from bcdflow.flows.status import cmd_runs, cmd_status, existing_state as _existing_state, status_dict, status_table
from bcdflow.flows.store_admin import cli_store as _store
from bcdflow.storage.backends import BACKENDS
from bcdflow.tracking.tables import strict_json

# Prefect, torch and what imports them (flows, tasks, core.context, core.config) are imported inside the commands
# that need them, after _env_defaults: Prefect reads PREFECT_HOME and its other settings when it is first imported,
# and the read-only commands answer at once (tests/test_cli.py checks what `bcdflow --help` imports).
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PIPE = 2, 1, 130, 141  # 141: 128 + SIGPIPE, as `yes | head`

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
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class RunFailed(Exception):
    """A run stopped on a fault (store outage, crash): its committed work is safe and resuming continues it. A run
    that failed before it existed (no state: nothing of it was kept, flows/bcd.py) gets no resume line."""

    def __init__(self, run_id: str, store: str, cause: BaseException, exists: bool = True):
        first = (str(cause).strip().splitlines() or [""])[0]
        if not exists:
            super().__init__(f"run {run_id} failed before it was created: {type(cause).__name__}: {first} (nothing "
                             "of it was kept; run the same command again)")
            return
        super().__init__(f"run {run_id} failed: {type(cause).__name__}: {first}\n"
                         f"bcdflow: committed visits are safe; continue with: {_resume_line(run_id, store)}")


def _resume_line(run_id: str, store: str) -> str:
    return f"bcdflow resume {run_id} --store {store}"


class _Interrupted(Exception):
    def __init__(self, run_id: str, store: str, exists: bool = True):
        super().__init__(f"interrupted; committed visits and the last checkpoint are safe; continue with: "
                         f"{_resume_line(run_id, store)}" if exists else
                         f"interrupted before run {run_id} was created (nothing of it was kept)")


def _exists(cfg, run_id: str) -> bool:
    """Whether the run has a state (a resume can continue it); True when the store cannot tell (it is down)."""
    from bcdflow.core.context import open_store
    from bcdflow.storage import runs

    try:
        return runs.read_state(open_store(cfg), run_id) is not None
    except Exception:  # noqa: BLE001 - the failure being reported is the one that matters
        return True


# -- console, signals, the temporary server --------------------------------------------------------

class _NoTracebacks(logging.Filter):
    """The console shows progress, not failures: Prefect's own failure reports (with tracebacks) are left to the
    Prefect UI, and the CLI says what went wrong once, in one line. ``--debug`` keeps everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.name.startswith("prefect"):
            return False
        record.exc_info, record.exc_text = None, None  # a retry warning keeps its message, not its traceback
        return True


def _quiet_console(debug: bool) -> None:
    import prefect.main  # noqa: F401 - configures Prefect's logging (its console handler sits on the root logger)

    if debug:
        return
    for h in logging.getLogger().handlers:
        if type(h).__name__ == "PrefectConsoleHandler" and not any(isinstance(f, _NoTracebacks) for f in h.filters):
            h.addFilter(_NoTracebacks())


# -- checks before anything runs ---------------------------------------------------------------------

def check_tracking(cfg) -> None:
    """An MLflow tracking server the run would log to must answer before anything is written (tracking/tracker.py):
    the one line names where its address came from (``tracking_uri``, or ``MLFLOW_TRACKING_URI``)."""
    from bcdflow.tracking.tracker import check_reachable

    setting = "tracking_uri" if cfg.tracking_uri else "MLFLOW_TRACKING_URI (in the environment)"
    check_reachable(cfg.resolved_tracking_uri(), setting)


def _check_run_id(run_id: str | None) -> None:
    from bcdflow.storage.layout import check_run_id

    if run_id is not None:
        check_run_id(run_id)


def _preflight(cfg, mode: str, store) -> None:
    """Checks that need the machine, the file system or the store, done before any flow starts (nothing
    written on failure): ``core/context.preflight`` of the config the run trains (a baseline's is one block:
    ``flows/bcd.full_config``; the flow's own call is then free) with the command's ``store`` (probed there, once),
    and the fleet extra."""
    from bcdflow.core.context import preflight

    if cfg.fleet.preinfer == "dask":
        try:
            import prefect_dask  # noqa: F401
        except ImportError:
            raise BadInput("fleet.preinfer: dask needs the fleet extra (pip install -e '.[fleet]')") from None
    if mode == "full":
        from bcdflow.flows.bcd import full_config

        cfg = full_config(cfg)
    preflight(cfg, store=store)


def _config(args, base: list[str] | None = None, mode: str | None = None):
    from bcdflow.flows.like import like_config

    sets = list(base or []) + list(args.set or [])
    if getattr(args, "store", None):
        sets.append(f"store={args.store}")
    cfg = like_config(args.config, sets, getattr(args, "like", None), mode)  # --like RUN: its settings under these
    check_prefect_home()
    check_prefect_api()
    check_tracking(cfg)
    return cfg


def _continuable(store, run_id: str, state=None) -> dict | None:
    """A run that exists must be whole before it is continued: its config, its state and every file of its last
    committed version (a finished run whose last manifest is gone is damaged, not done). Its stored config (the
    record), or None for a new run; ``state``: the run's, read already."""
    from bcdflow.storage import checkpoints, runs

    state = state or runs.read_state(store, run_id)
    if state is None:
        return None
    record = runs.read_config(store, run_id)
    checkpoints.check_version(store, run_id, state.version)
    return record


def _check_same_settings(record: dict | None, run_id: str, cfg, mode: str) -> None:
    """A run continues with the settings that define what it computes (``tasks/run.IDENTITY``; ``record``: its stored
    config, None: a new run): another value is refused naming the keys here, before its lease or anything else is
    written (``init_run`` checks again, for a deployment's run)."""
    if record is None:
        return
    from bcdflow.flows.bcd import full_config
    from bcdflow.storage.runs import RUN_FORMAT
    from bcdflow.tasks.run import SETTINGS_IDENTITY, check_same_identity

    run_cfg = full_config(cfg) if mode == "full" else cfg  # as the flow stores it
    check_same_identity(record, {**run_cfg.model_dump(), "mode": mode, "format": RUN_FORMAT}, run_id,
                        keys=SETTINGS_IDENTITY)


def _check_same_data(record: dict | None, run_id: str, cfg) -> None:
    """A run continues on the data it started on: the token dataset id of the data now (a hash of the files'
    contents and the tokenizer, computed without writing) must be the run's (``record``: its stored config; None: a
    new run). The same ``data.files`` glob with new contents would otherwise mix the old data's checkpoint and
    activations with the new."""
    from bcdflow.tasks.data import data_id

    if record is None:
        return
    old, new = record.get("dataset"), data_id(cfg)
    if old is not None and old != new:
        key = "data.files" if cfg.data.files else "data.path" if cfg.data.path else "data"
        raise BadInput(f"{key}: the data of run {run_id!r} changed since it started (token dataset {old}, now "
                       f"{new}: a file's contents, the list of files or the tokenizer); restore it or use a new "
                       "--run-id")


# -- commands --------------------------------------------------------------------------------------------

def _call(fn, cfg, run_id: str, debug: bool = False) -> dict:
    _quiet_console(debug)
    detach_temporary_server()
    try:
        return fn(config=cfg, run_id=run_id)  # the RunConfig as it is: the flat form is the deployments' (flows/bcd.py)
    except (BadInput, DamagedArtifact, SystemExit):
        raise
    except KeyboardInterrupt:
        raise _Interrupted(run_id, cfg.store, _exists(cfg, run_id)) from None
    except Exception as e:
        raise RunFailed(run_id, cfg.store, e, _exists(cfg, run_id)) from e


def _run(args, mode: str, base: list[str] | None = None) -> dict:
    """A run started from the command line: the config, the checks, the store opened and probed once (what the
    command reads is read once), then the flow."""
    cfg = _config(args, base, mode)
    from bcdflow.core.context import open_store
    from bcdflow.flows.bcd import bcd_train_config, full_train_config
    from bcdflow.flows.params import new_run_id

    store = open_store(cfg)
    _preflight(cfg, mode, store)
    run_id = args.run_id or new_run_id(mode)
    record = _continuable(store, run_id)
    _check_same_settings(record, run_id, cfg, mode)
    _check_same_data(record, run_id, cfg)
    summary = _call(full_train_config if mode == "full" else bcd_train_config, cfg, run_id, args.debug)
    print(strict_json(summary))
    return {"cfg": cfg, "run_id": run_id, "summary": summary, "store": store}


def cmd_train(args) -> int:
    _run(args, "bcd")
    return 0


def cmd_baseline(args) -> int:
    _run(args, "full")
    return 0


def cmd_join(args) -> int:
    """``bcdflow join RUN --node-rank K``: this machine's ``train.gpus`` processes join each of the run's visits
    across machines (tasks/train_dist.join) as torchrun's node K."""
    from bcdflow.tasks.train_dist import join

    if args.node_rank < 1:
        raise BadInput(f"--node-rank: must be 1 or more (node 0 is the machine whose task trains the visit), got "
                       f"{args.node_rank}")
    return 1 if join(_store(args.store, args), args.run_id, args.node_rank, once=args.once) else 0


def cmd_resume(args) -> int:
    """Continue a run from its stored config: committed visits are skipped, complete shards reused, an
    interrupted visit continues from its last checkpoint, the MLflow run is continued."""
    from bcdflow.core.config import stored_config
    from bcdflow.storage import layout

    store = _store(args.store, args)
    state = _existing_state(store, args.run_id)
    record = _continuable(store, args.run_id, state)  # a finished run whose last version is gone is damaged, not done
    if state.status == "done":
        print(_finished(state, args.store))
        return 0
    # a run continues as it was trained: its stored settings, at the store it is resumed from
    cfg = stored_config(record, store.url_of(layout.config_key(args.run_id)), args.store)
    check_prefect_home()
    check_prefect_api()
    check_tracking(cfg)
    _preflight(cfg, record.get("mode") or "bcd", store)
    _check_same_data(record, args.run_id, cfg)
    from bcdflow.flows.bcd import bcd_train_config, full_train_config

    fn = full_train_config if record.get("mode") == "full" else bcd_train_config
    print(strict_json(_call(fn, cfg, args.run_id, args.debug)))
    return 0


def _finished(state, store: str) -> str:
    """What ``resume`` says of a run that is done: there is nothing to resume, and what would train it further (keyed
    by the reasons' owner, core/rules.py)."""
    from bcdflow.core.rules import CYCLES, FURTHER

    val = f", val loss {state.visits[-1].val_loss:.4f}" if state.visits else ""
    more = FURTHER.get(state.stop_reason or "", FURTHER[CYCLES])
    return (f"run {state.run_id} is done ({state.stop_reason}: {state.stop_detail}) at version {state.version}{val}: "
            f"nothing to resume.\nTo train it further: bcdflow train --run-id {state.run_id} --like {state.run_id} "
            f"--store {store} {more} (--like: with the run's own settings)")


def cmd_demo(args) -> int:
    out = _run(args, "bcd", DEMO)
    cfg, run_id = out["cfg"], out["run_id"]
    print(status_table(status_dict(out["store"], run_id)))
    uri = cfg.resolved_tracking_uri()
    print(f"\nresults: store {cfg.store} run {run_id}")
    print(f"  bcdflow status {run_id} --store {cfg.store}")
    link = "http://127.0.0.1:5000"
    if out["summary"].get("mlflow_run_id"):  # the run's page, in MLflow's model-training view
        from bcdflow.tracking.tracker import Tracker

        link = Tracker(uri, cfg.experiment).run_url(out["summary"]["mlflow_run_id"])
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {uri}   (then open {link})")
    print("              (the link opens the model-training view; MLflow's home is its GenAI view, where the run looks "
          "empty: switch the GenAI / Model training toggle at the top left)")
    print("  Prefect UI: prefect server start   (then open http://127.0.0.1:4200; the demo's flow runs are in "
          f"{os.environ.get('PREFECT_HOME', '~/.prefect')}/prefect.db)")
    print(next_steps(run_id, cfg.store))
    return 0


def next_steps(run_id: str, store: str) -> str:
    """The demo's last lines: what to type next."""
    bin_dir = os.path.dirname(sys.executable)
    active = os.environ.get("VIRTUAL_ENV") and os.path.samefile(os.environ["VIRTUAL_ENV"], os.path.dirname(bin_dir))
    rel = os.path.relpath(bin_dir)
    venv = rel if not rel.startswith("..") else bin_dir
    s = "" if store == "./bcdflow-store" else f" --store {store}"
    lines = ["\nnext:"]
    if not active:
        lines.append(f"  . {venv}/activate      # puts bcdflow, mlflow and prefect on PATH (or call {venv}/bcdflow)")
    full = f"full-{run_id[4:]}" if run_id.startswith("bcd-") else f"{run_id}-full"  # as a baseline's own ids read
    lines += [f"  bcdflow baseline --like {run_id} --run-id {full}{s}   # full training on the demo's settings",
              f"  bcdflow compare {full} {run_id}{s}   # then the demo against it: loss, steps and cost",
              f"  bcdflow config show --run {run_id}{s}   # the demo's settings, each key with its meaning",
              f"  bcdflow train --set data.files='~/corpus/*.txt' --run-id mine{s}      # your own text files",
              f"  bcdflow generate {run_id} \"def main(\"{s}    # sample from the demo's model",
              f"  bcdflow export {run_id} ./demo-model{s}    # model.safetensors + config.json + tokenizer.json"]
    return "\n".join(lines)


def cmd_compare(args) -> int:
    from bcdflow.flows.compare import check_plot_path, check_tolerances, compare, plot

    check_tolerances(args.tol, args.bracket_tol)
    if args.plot:
        check_plot_path(args.plot)
    store = _store(args.store, args, write=False)
    result = compare(store, args.run_ids, target=args.target, tol=args.tol, bracket_tol=args.bracket_tol)
    print(strict_json(result) if args.json else result["markdown"])
    if args.plot:
        plot(store, result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_export(args) -> int:
    from bcdflow.core.export import (check_outside_store, check_room, check_target, export_bytes, export_hf,
                                     export_version, written_whole)
    from bcdflow.flows.status import stored_version

    check_target(args.out_dir)
    if args.dtype and args.format != "hf":
        raise BadInput("--dtype: only with --format hf (the bcdflow format keeps the stored tensors as they are)")
    store = _store(args.store, args, write=False)
    check_outside_store(args.out_dir, store)
    _, version = stored_version(store, args.run_id, args.version)
    # before anything is written: the version is whole (its manifest holds every block of the plan) and fits
    check_room(args.out_dir, export_bytes(store, args.run_id, version, args.format, args.dtype))
    with written_whole(args.out_dir) as tmp:
        n = (export_hf(store, args.run_id, version, tmp, dtype=args.dtype) if args.format == "hf"
             else export_version(store, args.run_id, version, tmp))
    print(f"exported run {args.run_id} version {version} ({n} tensors, {args.format} format) to {args.out_dir}")
    return 0


def cmd_worker(args) -> int:
    from bcdflow.flows.worker import run

    extra = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    return run(args.pool, args.grace, extra)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's failure reports")
    p = argparse.ArgumentParser(prog="bcdflow", description="Block coordinate descent training on Prefect.",
                                parents=[common])
    sub = p.add_subparsers(dest="command", required=True)

    def run_opts(sp):
        sp.add_argument("-c", "--config", help="YAML config file")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
        sp.add_argument("--run-id", help="run id (an existing id resumes that run)")
        sp.add_argument("--store", help="store URL (same as --set store=URL)")

    for name, fn, helptext in (("demo", cmd_demo, "tiny model on the built-in corpus, embedded defaults"),
                               ("train", cmd_train, "train with block coordinate descent"),
                               ("baseline", cmd_baseline, "full-parameter baseline")):
        sp = sub.add_parser(name, help=helptext, parents=[common])
        run_opts(sp)
        if name != "demo":  # the demo's settings are its own
            from bcdflow.flows import like

            like.add_argument(sp)
        sp.set_defaults(fn=fn)

    def store_opts(sp, one_run: bool = True):
        if one_run:
            sp.add_argument("run_id")
        sp.add_argument("--store", default="./bcdflow-store", help="store URL (default ./bcdflow-store)")
        sp.add_argument("--endpoint-url", help="an object store's endpoint (" + ", ".join(
            f"{b.example.partition('://')[0]}:// {b.name}.{b.endpoint}" for b in BACKENDS.values() if b.endpoint) + ")")

    sp = sub.add_parser("resume", help="continue an interrupted run where it stopped", parents=[common])
    store_opts(sp)
    sp.set_defaults(fn=cmd_resume)
    sp = sub.add_parser("status", help="a run's blocks and visits", parents=[common])
    store_opts(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_status)
    sp = sub.add_parser("runs", help="every run of a store: status, visits done, last val loss, spend",
                        parents=[common])
    store_opts(sp, one_run=False)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_runs)
    sp = sub.add_parser("export", help="write model.safetensors + config.json of a version", parents=[common])
    store_opts(sp)
    sp.add_argument("out_dir")
    sp.add_argument("--version", type=int)
    sp.add_argument("--format", choices=("bcdflow", "hf"), default="bcdflow",
                    help="bcdflow (default) or hf: a directory transformers' from_pretrained loads")
    sp.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                    help="tensor dtype of --format hf (default: the source checkpoint's, else fp32)")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("compare", help="loss and cost of runs against the first (B-F multiplier, what-if cost)",
                        parents=[common])
    sp.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="the baseline first, then the others")
    store_opts(sp, one_run=False)
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--plot", metavar="FILE.png",
                    help="also draw validation loss against steps and spend, L* and each run's crossing marked")
    sp.add_argument("--target", metavar="L*", default="best",
                    help="best (default: the baseline's best validation loss + --tol), final (its last + --tol), "
                         "common (the worst of the runs' best losses) or a loss")
    sp.add_argument("--tol", type=float, default=TOL, help=f"what L* adds to the baseline's loss (default {TOL})")
    sp.add_argument("--bracket-tol", type=float, default=BRACKET_TOL,
                    help="the widest bracket of a crossing, as a fraction of its step, that still gives a B-F "
                         f"(default {BRACKET_TOL})")
    sp.set_defaults(fn=cmd_compare)
    sp = sub.add_parser("join", help="on another machine of a run's visits across train.nodes machines: join them",
                        parents=[common])
    store_opts(sp)
    sp.add_argument("--node-rank", type=int, required=True,
                    help="this machine's place among the visit's train.nodes machines: 1 to train.nodes - 1 (node 0 "
                         "is the machine whose task trains the visit)")
    sp.add_argument("--once", action="store_true", help="join one visit, then exit with its torchrun's exit code "
                                                       "(default: every visit, until the run is done)")
    sp.set_defaults(fn=cmd_join)
    sp = sub.add_parser("worker", help="a Prefect process worker whose flow runs checkpoint on SIGTERM (spot GPUs)",
                        parents=[common])
    sp.add_argument("--pool", required=True, help="the work pool (e.g. bcdflow-gpu)")
    sp.add_argument("--grace", type=float, default=60.0,
                    help="seconds the flow runs get to checkpoint on SIGTERM before the worker stops (default 60)")
    sp.add_argument("worker_args", nargs=argparse.REMAINDER, help="more `prefect worker start` options, after --")
    sp.set_defaults(fn=cmd_worker)
    from bcdflow.flows import generate, keys, plan, plan_memory, store_admin

    generate.add_parser(sub, common, store_opts)
    store_admin.add_parsers(sub, common, store_opts)
    keys.add_parser(sub, common)
    plan_memory.add_parser(sub, common)
    plan.add_parser(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    args = build_parser().parse_args(argv)
    try:
        for run_id in [getattr(args, "run_id", None), *getattr(args, "run_ids", [])]:
            _check_run_id(run_id)
        if args.command == "worker":
            check_prefect_home()
            _quiet_console(args.debug)  # Prefect's console filter; the run commands set it where a flow starts
        code = args.fn(args)
        sys.stdout.flush()  # a reader that closed the pipe (`bcdflow runs | head -1`) shows here, not at exit
        return code
    except BrokenPipeError:  # the reader has what it wanted: no message, no traceback at exit
        _drop_stdout()
        return EXIT_PIPE
    except BadInput as e:
        _say(e, args)
        return EXIT_BAD_INPUT
    except (DamagedArtifact, RunFailed) as e:
        _say(e, args)
        return EXIT_FAILED
    except (_Interrupted, KeyboardInterrupt) as e:
        _say(e if isinstance(e, _Interrupted) else "interrupted", args)
        return EXIT_INTERRUPTED
    except OSError as e:  # outside a run (export, a plot): a full disk, a permission; one line naming the file
        _say(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else f"{type(e).__name__}: {e}", args)
        return EXIT_FAILED


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not raise on a closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a test's captured stdout)
        pass


MAX_LINE = 1000  # an error line is cut to this: a value it echoes may be anything a user or a store handed over


def _say(err, args) -> None:
    if getattr(args, "debug", False) and isinstance(err, BaseException):
        import traceback

        traceback.print_exception(err, file=sys.stderr)
    lines = [ln if len(ln) <= MAX_LINE else f"{ln[:MAX_LINE - 200]} … {ln[-180:]}" for ln in str(err).split("\n")]
    print("bcdflow: error: " + "\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
