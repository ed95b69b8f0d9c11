"""``--like RUN``: a stored run's settings as a command's starting point (issue 45). ``bcdflow train``, ``baseline``
and ``plan`` start from RUN's settings and apply ``-c`` and ``--set`` on top; ``bcdflow config show --run RUN``
prints them (with ``-c``/``--set`` on top too: what ``--like`` would start a run with).

    bcdflow baseline --like bcd-20250101-120000-1a2b --run-id full-1a2b   # a baseline of the demo's settings
    bcdflow compare full-1a2b bcd-20250101-120000-1a2b
    bcdflow train --like full-1a2b --set bcd.blocks=4      # BCD with a baseline's settings
    bcdflow plan --like bcd-20250101-120000-1a2b --set model.name=G-1.6B --tokens 1e9
    bcdflow config show --run bcd-20250101-120000-1a2b     # the stored run's settings, each with its meaning

The run id and the store are the command's own: RUN is read from the store the command uses (``--store``, else the
config's ``store``), and its ``store`` and the store's access options (``s3.*``) are not carried over. Everything else
is, the way each command reads it: a baseline sets its ``bcd`` keys itself (``flows/bcd.BASELINE_BCD``: one block,
one cycle, every row, ``train.steps`` steps, ...), so of a BCD run it takes the model, data, optimizer, batch, seed,
``train.*``, ``stop.*``, ``spend.*`` and the few ``bcd`` keys a one-block run still reads (``bcd.window``,
``bcd.min_delta``, ``bcd.freeze``, ``bcd.recompute``); a BCD command (``train``, ``plan``) like a baseline gets
those keys' defaults, not the baseline's one block (the baseline stored the values it set, not the ones it was
given).

RUN must be a run this bcdflow can read: one that is missing, whose state or config is damaged, or that a newer
bcdflow wrote is one ``BadInput`` line naming it (exit 2), before anything is written. Reading it imports neither
torch nor Prefect (``config show`` answers at once).
"""
from __future__ import annotations

from bcdflow.errors import BadInput, DamagedArtifact

HELP = "start from run RUN's stored settings (RUN in this command's store); -c and --set apply on top"


def add_argument(sp) -> None:
    """The ``--like RUN`` flag, with one meaning wherever it is (flows/cli.py, flows/plan.py)."""
    sp.add_argument("--like", metavar="RUN", help=HELP)


def like_config(file: str | None, sets: list[str] | None, like: str | None, mode: str | None = None):
    """The ``RunConfig`` of a command given ``-c`` ``file``, ``--set`` ``sets`` and ``--like`` ``like`` (None: no stored
    run, as ``core/config.load_config``). ``mode``: what the command runs, ``"bcd"`` or ``"full"`` (a baseline), or
    None to take the stored settings as they are (``config show``)."""
    from bcdflow.core.config import config_tree, load_config

    if like is None:
        return load_config(file, sets)
    return load_config(file, sets, base=like_settings(config_tree(file, sets), like, mode))


def like_settings(tree: dict, run_id: str, mode: str | None = None) -> dict:
    """Run ``run_id``'s settings as a nested dict to apply a command's overrides on, read from the store ``tree``
    (the command's own config keys, unchecked: ``core/config.config_tree``) names, without the store's URL and
    access options; of a baseline for a BCD command (``mode`` "bcd") without the ``bcd`` keys the baseline set."""
    from bcdflow.storage.backends import BACKENDS

    settings, stored_mode = stored_settings(_store(tree), run_id)
    out = settings.model_dump(mode="json", exclude={"store", *(b.name for b in BACKENDS.values())})
    if stored_mode == "full" and mode == "bcd":
        from bcdflow.flows.bcd import BASELINE_BCD

        out["bcd"] = {k: v for k, v in out["bcd"].items() if k not in BASELINE_BCD}
    return out


def _store(tree: dict):
    """The store the command's keys name (the default one if none), with its backend's access options, probed for
    reading (nothing is written)."""
    from bcdflow.core.config import RunConfig, parse_config
    from bcdflow.storage.backends import BACKENDS
    from bcdflow.storage.store import Store

    url = tree.get("store") or RunConfig.model_fields["store"].default
    access = parse_config({"store": url, **{b.name: tree[b.name] for b in BACKENDS.values() if b.name in tree}})
    store = Store(access.store, access.storage_options())
    store.probe(write=False)
    return store


def stored_settings(store, run_id: str):
    """(settings, mode): the ``RunConfig`` run ``run_id`` of ``store`` was made with (``core/config.stored_config``)
    and its mode ("bcd", "full"); one BadInput line naming the run when it is not there or cannot be read."""
    from bcdflow.core.config import stored_config
    from bcdflow.storage import layout, runs

    try:
        layout.check_run_id(run_id)
    except BadInput:
        raise BadInput(f"--like: {run_id!r:.80} is not a valid run id (letters, digits, '_', '.', '-')") from None
    where = f"run {run_id!r}"
    try:
        if runs.read_state(store, run_id) is None:
            raise BadInput(f"{where} not found in store {store.url} (bcdflow runs --store {store.url} lists them)")
        record = runs.read_config(store, run_id)
        fmt = record.get("format", 1)
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise runs.RunStateError(f"run config {store.url_of(layout.config_key(run_id))} is damaged (format: "
                                     f"{fmt!r:.40} is not a whole number)")
        if fmt > runs.RUN_FORMAT:
            raise BadInput(f"{where} was made by a newer bcdflow (run format {fmt}, this one reads up to "
                           f"{runs.RUN_FORMAT}); upgrade bcdflow to reuse its settings")
        return stored_config(record, store.url_of(layout.config_key(run_id))), record.get("mode") or "bcd"
    except DamagedArtifact as e:
        # the damaged run is this command's input, not an object of the run it makes: bad input (exit 2), said once
        raise BadInput(f"{where}: its settings cannot be read: {e}") from None
