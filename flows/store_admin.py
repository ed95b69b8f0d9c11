"""``bcdflow prune RUN`` and ``bcdflow rm RUN``: keep a store's size under control (storage/prune.py does the work).

    bcdflow prune my-run --keep 2 --pin 0          # the last 2 versions and version 0 (pinned for later prunes too)
    bcdflow prune my-run --dry-run                 # what would go, and how much it would free
    bcdflow rm my-run                              # the run's folder, whole

Both take the run's lease first, so a run that a live process trains (or one of its visits on a worker) is refused
with one line naming that process (exit 2), and nothing can start training it while they work; both print what they
free. ``rm`` leaves the run's token dataset (shared by the runs with the same data) and its MLflow runs.
"""
from __future__ import annotations

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
    """The store named on the command line (with ``--endpoint-url`` for S3), checked before use; ``write=False``
    for the commands that only read it (a read-only store is fine, and nothing is written)."""
    from bcdflow.storage.store import Store, check_url

    check_url(url)
    opts = {}
    if getattr(args, "endpoint_url", None):  # its backend's options (none for a store that takes no endpoint)
        from bcdflow.core.config import RunConfig

        opts = RunConfig(store=url, s3={"endpoint_url": args.endpoint_url}).storage_options()
    store = Store(url, opts)
    store.probe(write)
    return store


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _locked(store, run_id: str):
    """(the run's lease, not yet taken, its config), after checking that no visit of it is held by a live process
    (a fleet worker can train a visit while the run's own process is gone); taking the lease refuses a live run
    (LeaseHeld names its holder)."""
    from bcdflow.storage import layout, overview, runs
    from bcdflow.storage.lease import Lease

    if not runs.run_exists(store, run_id):
        raise BadInput(f"run {run_id!r} not found in store {store.url}")
    try:
        cfg = runs.read_config(store, run_id)
    except runs.RunStateError:  # a damaged run can still be removed
        cfg = {}
    ttl = float((cfg.get("fleet") or {}).get("lease_seconds", 60.0))
    lease = Lease(store, layout.run_key(run_id), f"run {run_id!r}", ttl=ttl)
    training = overview.training_visit(store, run_id)
    if training and training["lease_owner"]:
        raise BadInput(f"run {run_id!r}: visit {training['visit']} is being trained by "
                       f"{overview.owner_text(training['lease_owner'])}; wait for it, or stop it first")
    return lease, cfg


def cmd_prune(args) -> int:
    from bcdflow.storage import layout
    from bcdflow.storage.lease import LeaseHeld
    from bcdflow.storage.prune import apply_prune, plan_prune, size_of

    store = cli_store(args.store, args, write=not args.dry_run)
    lease, _ = _locked(store, args.run_id)
    if args.dry_run:  # writes nothing, its lease included; says what a prune would do now
        if (held := lease.holder()) is not None:
            raise LeaseHeld(lease.what, held)
        plan = plan_prune(store, args.run_id, args.keep, args.pin)
    else:
        with lease.held():
            plan = plan_prune(store, args.run_id, args.keep, args.pin)
            apply_prune(store, args.run_id, plan)
    left = size_of(store, layout.run_key(args.run_id))
    pinned = [v for v in plan.kept if v in plan.pinned]
    kept = ", ".join(map(str, plan.kept)) + (f" (pinned: {', '.join(map(str, pinned))})" if pinned else "")
    gone = ", ".join(map(str, plan.versions)) or "none"
    would = "would remove" if args.dry_run else "removed"
    print(f"run {args.run_id}: kept versions {kept}; {would} versions {gone}")
    for what, items, size in (("manifests", plan.versions, plan.manifest_bytes),
                              ("block files no kept version uses", plan.blocks, sum(b for _, b in plan.blocks)),
                              ("optimizer states of earlier visits", plan.moments, sum(b for _, b in plan.moments))):
        print(f"  {len(items):>4} {what:<36} {mb(size):>10}")
    if args.dry_run:
        print(f"would free {mb(plan.freed)}: the run holds {mb(left)}, {mb(left - plan.freed)} after a prune")
    else:
        print(f"freed {mb(plan.freed)}; the run now holds {mb(left)}")
    return 0


def cmd_rm(args) -> int:
    from bcdflow.storage.prune import dataset_users, remove_run

    store = cli_store(args.store, args)
    lease, cfg = _locked(store, args.run_id)
    lease.acquire()  # not released: it goes with the folder (a renewal thread would write it back)
    freed = remove_run(store, args.run_id)
    print(f"removed run {args.run_id} from {store.url}: freed {mb(freed)}")
    if dataset := cfg.get("dataset"):
        users = dataset_users(store, dataset)
        print(f"  its token dataset datasets/{dataset} stays" +
              (f" (used by {', '.join(users)})" if users else " (no other run uses it now)"))
    return 0
