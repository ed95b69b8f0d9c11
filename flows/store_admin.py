"""``bcdflow prune RUN`` and ``bcdflow rm RUN``: keep a store's size under control (storage/prune.py does the work).

    bcdflow prune my-run --keep 2 --pin 0          # the last 2 versions and version 0 (pinned for later prunes too)
    bcdflow prune my-run --dry-run                 # what would go (every key), and how much it would free
    bcdflow rm my-run                              # the run's objects, whole

Both take the run's lease first, so a run that a live process trains (or one of its visits on a worker) is refused
with one line naming that process (exit 2), and nothing can start training it while they work; both print what they
free. ``prune`` checks everything it decides from before it writes anything (its lease included): damage is one line
naming the object, exit 1, nothing written or removed. ``rm`` removes a damaged run too, only the objects the layout
names, never through a link, and leaves the run's token dataset (shared by the runs with the same data) and its MLflow
runs. On a full disk both free space without first writing their lease (``_take``).
"""
from __future__ import annotations

import contextlib
import sys

from bcdflow.errors import BadInput


def add_parsers(sub, common, store_opts) -> None:
    sp = sub.add_parser("prune", parents=[common],
                        help="drop a run's old versions and optimizer states (keeps the last N and pinned ones)")
    store_opts(sp)
    sp.add_argument("--keep", type=int, default=2, help="the last versions to keep (default 2; at least 1)")
    sp.add_argument("--pin", type=int, action="append", default=[], metavar="VERSION",
                    help="also keep this version, in this prune and every later one (repeatable)")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    sp.set_defaults(fn=cmd_prune)
    sp = sub.add_parser("rm", parents=[common], help="remove a run from its store (its folder, whole)")
    store_opts(sp)
    sp.set_defaults(fn=cmd_rm)


def cli_store(url: str, args=None, write: bool = True):
    """The store named on the command line (with ``--endpoint-url``, its backend's endpoint option), checked before
    use; ``write=False`` for the commands that only read it (a read-only store is fine, and nothing is written).
    A command opens its store once, here, and hands it on."""
    from bcdflow.core.config import store_config
    from bcdflow.storage.store import Store, check_url

    check_url(url)
    store = Store(url, store_config(url, getattr(args, "endpoint_url", None)).storage_options())
    store.probe(write)
    return store


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _lease(store, run_id: str, cfg, damaged_ok: bool = False):
    """The run's lease (not yet taken), after checking that no visit of it is held by a live process (a fleet worker
    can train a visit while the run's own process is gone); taking it refuses a live run (LeaseHeld names its holder).
    ``cfg``: the run's settings (``fleet.lease_seconds``); ``damaged_ok`` (``rm``): a visit lease object that is damaged
    names no live process, and is passed over."""
    from bcdflow.storage import layout
    from bcdflow.storage.lease import Lease, LeaseDamaged

    ttl = cfg.fleet.lease_seconds
    for name in store.listdir(layout.visits_key(run_id)):
        if (cb := layout.parse_visit(name)) is None:
            continue
        try:
            held = Lease(store, layout.visit_key(run_id, *cb), name).holder()
        except LeaseDamaged:
            if not damaged_ok:
                raise
            held = None
        if held:
            from bcdflow.storage.overview import owner_text

            raise BadInput(f"run {run_id!r}: visit {name} is being trained by {owner_text(held.get('owner'))}; "
                           "wait for it, or stop it first")
    return Lease(store, layout.run_key(run_id), f"run {run_id!r}", ttl=ttl)


def _take(lease, stack=None) -> None:
    """Hold ``lease`` for the rest of ``stack`` (renewed meanwhile), or (no stack) take it for good. On a full disk its
    object cannot be written, and the command that frees the space must not need it first: the lease was found free
    (no live holder) just before, and no other process can write one either until space is freed, so the command goes
    on, saying so."""
    from bcdflow.storage.prune import FULL_DISK

    try:
        if stack is None:
            lease.acquire()
        else:
            stack.enter_context(lease.held())
    except OSError as e:
        if e.errno not in FULL_DISK:
            raise
        print(f"bcdflow: note: the store is full ({e.strerror}): {lease.what} is free, and is changed without writing "
              "its lease", file=sys.stderr)


def _exists(store, run_id: str) -> None:
    from bcdflow.storage import runs

    if not runs.run_exists(store, run_id):
        raise BadInput(f"run {run_id!r} not found in store {store.url}")


def cmd_prune(args) -> int:
    from bcdflow.core.config import read_settings
    from bcdflow.storage import layout
    from bcdflow.storage.lease import LeaseHeld
    from bcdflow.storage.prune import apply_prune, plan_prune, size_of

    store = cli_store(args.store, args, write=not args.dry_run)
    _exists(store, args.run_id)
    cfg = read_settings(store, args.run_id)  # damage: one line naming it, nothing written
    # the plan is made and checked before anything is written (the lease included): damage removes nothing
    plan = plan_prune(store, args.run_id, args.keep, args.pin)
    lease = _lease(store, args.run_id, cfg)
    if args.dry_run:  # writes nothing, its lease included; says what a prune would do now
        if (held := lease.holder()) is not None:
            raise LeaseHeld(lease.what, held)
    else:
        with contextlib.ExitStack() as stack:
            _take(lease, stack)
            plan = plan_prune(store, args.run_id, args.keep, args.pin)  # again, under the lease: what is removed
            if not apply_prune(store, args.run_id, plan):
                print(f"bcdflow: note: the store is still full: {layout.retention_key(args.run_id)} could not record "
                      f"versions {', '.join(map(str, plan.versions))} as pruned", file=sys.stderr)
    left = size_of(store, layout.run_key(args.run_id))
    pinned = [v for v in plan.kept if v in plan.pinned]
    kept = ", ".join(map(str, plan.kept)) + (f" (pinned: {', '.join(map(str, pinned))})" if pinned else "")
    gone = ", ".join(map(str, plan.versions)) or "none"
    would = "would remove" if args.dry_run else "removed"
    print(f"run {args.run_id}: kept versions {kept}; {would} versions {gone}")
    for what, items, size in (("manifests", plan.versions, plan.manifest_bytes),
                              ("block files no kept version uses", plan.blocks, sum(b for _, b in plan.blocks)),
                              ("optimizer states of earlier visits", plan.moments, sum(b for _, b in plan.moments)),
                              ("files of writes that died", plan.leftovers, sum(b for _, b in plan.leftovers))):
        if items or what != "files of writes that died":
            print(f"  {len(items):>4} {what:<36} {mb(size):>10}")
    if args.dry_run:
        print(f"would free {mb(plan.freed)}: the run holds {mb(left)}, {mb(left - plan.freed)} after a prune")
        what = {**{n: "weights no kept version uses" for n, _ in plan.blocks},
                **{n: "optimizer state of an earlier visit, bcd.moments=keep" for n, _ in plan.moments},
                **{n: "temporary file of a write that died" for n, _ in plan.leftovers}}
        for key in plan.deletions:  # exactly what `bcdflow prune` with the same arguments removes now
            kind = what.get(key.rsplit("/", 1)[-1]) if key.startswith(layout.blocks_key(args.run_id)) else None
            print(f"  would remove {key}" + (f"   ({kind})" if kind else ""))
    else:
        print(f"freed {mb(plan.freed)}; the run now holds {mb(left)}")
    if plan.logged:  # MLflow's logged models point at the store's versions (no copy of the weights)
        print(f"note: MLflow logged a model of versions {', '.join(map(str, plan.logged))} (MLflow run "
              f"{plan.mlflow_run_id}'s visits), pointing at the store: after the prune they "
              f"{'would point' if args.dry_run else 'point'} at removed files (MLflow keeps the entries; bcdflow "
              "export and generate of such a version say it was pruned)")
    return 0


def cmd_rm(args) -> int:
    """Remove a run, damaged or not: a damaged config, state or lease does not stop it (it removes what the layout
    names, never through a link), and nothing but the run's own objects goes."""
    from bcdflow.core.config import RunConfig, read_settings
    from bcdflow.storage import runs
    from bcdflow.storage.lease import LeaseDamaged
    from bcdflow.storage.prune import dataset_users, remove_run, run_removal

    store = cli_store(args.store, args)
    _exists(store, args.run_id)
    try:
        dataset = runs.read_config(store, args.run_id).get("dataset")
    except runs.RunStateError:  # a damaged run can still be removed
        dataset = None
    try:
        cfg = read_settings(store, args.run_id)
    except runs.RunStateError:  # its lease then lasts what a run's lasts by default
        cfg = RunConfig()
    run_removal(store, args.run_id)  # refused before anything is written when the run's folder is a link
    lease = _lease(store, args.run_id, cfg, damaged_ok=True)
    try:
        _take(lease)  # not released: it goes with the folder (a renewal would write it back)
    except LeaseDamaged as e:  # names no live process: the run is removed all the same
        print(f"bcdflow: note: {e}", file=sys.stderr)
    removal = remove_run(store, args.run_id, run_removal(store, args.run_id))
    print(f"removed run {args.run_id} from {store.url}: freed {mb(removal.freed)}")
    if removal.left:
        shown = ", ".join(removal.left[:5]) + (f" and {len(removal.left) - 5} more" if len(removal.left) > 5 else "")
        print(f"  left in runs/{args.run_id}/ what bcdflow did not write: {shown}")
    if dataset:
        users = dataset_users(store, dataset)
        print(f"  its token dataset datasets/{dataset} stays" +
              (f" (used by {', '.join(users)})" if users else " (no other run uses it now)"))
    return 0
