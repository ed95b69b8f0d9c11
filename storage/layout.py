"""The store layout: every key bcdflow reads or writes is built here and nowhere else (docs/DESIGN.md §5).

    datasets/{dataset_id}/                        a token dataset: {train,val}.zarr, {train,val}_mask.zarr
                                                  (supervised formats), tokenizer.json, meta.json (written last)
    probes/{token}                                an object store's exclusive-create probe, removed at once
    runs/{run_id}/config.json                     the resolved run config
    runs/{run_id}/states/{seq}.json               the run's state after its seq-th change, created exclusively (the
                                                  commit point; the current state is the highest seq)
    runs/{run_id}/state.json                      a copy of the current state, written after it (older runs: the state)
    runs/{run_id}/lease/{epoch}.json              the run's lease (one writer per run)
    runs/{run_id}/versions/{v}.json               manifest of version v: block -> file + checksum
    runs/{run_id}/blocks/{sha256[:32]}.safetensors  one block's tensors, content-addressed
    runs/{run_id}/hf/{name}                       a fine-tuned checkpoint's config and tokenizer files
    runs/{run_id}/visits/c{c}-b{b}/               one visit's working objects, removed once it is committed:
        activations.zarr/                         pre-inference output (one shard = one writer; on
                                                  ``bcd.act_store`` where set, at the same key)
        activations.zarr/done/{shard}.json        a shard's completion marker and checksums
        train-ckpt/                               the mid-visit checkpoint
        lease/{epoch}.json                        the visit's lease (every visit takes one)
        outcome.json                              why a visit failed, for a dispatcher (bad input, damage, busy)
        mlflow.json                               the visit's MLflow run id (an interrupted visit continues it)
        spent.json                                what the visit had spent when its latest attempt started
        nodes.json                                a visit across machines: its attempt's job (``bcdflow join``)
    runs/{run_id}/retention.json                  versions a user pinned and versions ``bcdflow prune`` removed

Beside these, a local store's root holds ``mlflow.db`` and ``mlartifacts/`` when MLflow defaults to SQLite there
(``RunConfig.resolved_tracking_uri``, ``tracking/tracker.py``). Keys are ``/``-joined relative to the store root
(``Store`` joins them onto its URL). A run id is checked once, where a key is first made from it.

A name read from the store's own content (the files a checkpoint pointer, a manifest entry or a visit record names,
a run's dataset id) becomes part of a key only when it is a plain name inside its folder (``is_plain_name``: no
separator, not ``.`` or ``..``, not absolute); anything else is damage (``UnsafeName``), so a pointer written by
hand or by a broken writer can never make bcdflow read, write or delete outside the run's own prefix.
"""
from __future__ import annotations

import re

from bcdflow.errors import BadInput, DamagedArtifact

RUNS, DATASETS = "runs", "datasets"
CONFIG, STATE, RETENTION = "config.json", "state.json", "retention.json"
OUTCOME, MLFLOW, SPENT = "outcome.json", "mlflow.json", "spent.json"
DATASET_META, DATASET_TOKENIZER = "meta.json", "tokenizer.json"

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")  # a first character that is not "." rules out . and ..


class UnsafeName(DamagedArtifact):
    """A name read from the store (or a key made from one) that would leave its folder."""


def is_plain_name(name) -> bool:
    """Whether ``name`` (read from store content) is a plain file name inside its folder: letters, digits, ``_ . -``,
    not starting with a dot, so no separator, no ``..``, no absolute path."""
    return isinstance(name, str) and bool(_PLAIN.match(name))


def check_run_id(run_id: str) -> str:
    """A run id is a plain name (letters, digits, ``_ . -``; no path separators, not ``.``/``..``)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise BadInput(f"--run-id: {run_id!r:.80} is not a valid run id (letters, digits, '_', '.', '-'; "
                       "at most 128 characters, starting with a letter or digit)")
    return run_id


def is_run_id(name: str) -> bool:
    return bool(_RUN_ID.match(name))


# -- a run ---------------------------------------------------------------------------------------------------
def run_key(run_id: str, *parts: str) -> str:
    return "/".join([RUNS, check_run_id(run_id), *parts])


def config_key(run_id: str) -> str:
    return run_key(run_id, CONFIG)


def state_key(run_id: str, seq: int | None = None) -> str:
    """``seq`` None: ``state.json``, the copy of the current state (the whole state of a run from before issue
    17); else the immutable state object number ``seq`` (``states/000000000007.json``)."""
    return run_key(run_id, STATE) if seq is None else run_key(run_id, "states", f"{seq:012d}.json")


def states_key(run_id: str) -> str:
    return run_key(run_id, "states")


def state_seq(name: str) -> int | None:
    """The sequence number of a state object's name (``000000000007.json`` -> 7); None for anything else."""
    stem = name.removesuffix(".json")
    return int(stem) if name.endswith(".json") and stem.isdigit() else None


def versions_key(run_id: str) -> str:
    return run_key(run_id, "versions")


def manifest_key(run_id: str, version: int) -> str:
    return run_key(run_id, "versions", f"{version}.json")


def blocks_key(run_id: str) -> str:
    return run_key(run_id, "blocks")


def block_file(sha256: str) -> str:
    """A block file's name as a manifest entry holds it, relative to the run (content-addressed)."""
    return f"blocks/{sha256[:32]}.safetensors"


_BLOCK_NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")
_BLOCK_TMP = re.compile(r"^\.tmp-[0-9a-f]{32}\.safetensors$")


def block_tmp_name(token: str) -> str:
    """The temporary name ``checkpoints.save_block`` writes a block file under in ``blocks/`` (``token``: 32 hex)
    before renaming it; one left by a writer that died is bcdflow's to remove (``bcdflow prune``, ``rm``)."""
    return f".tmp-{token}.safetensors"


def is_block_file_name(name: str) -> bool:
    """Whether ``name`` in a run's ``blocks/`` is a name bcdflow writes there: a content-addressed block file (or a
    kept optimizer state, named the same way) or ``save_block``'s temporary name. ``prune`` deletes nothing else."""
    return bool(_BLOCK_NAME.match(name) or _BLOCK_TMP.match(name))


def block_name(file) -> str | None:
    """The plain name in ``blocks/{name}``, a block file (or a block's kept optimizer state) as a manifest entry or
    a visit record names it (:func:`block_file`), or None when ``file`` is anything else: the caller names the
    damaged object."""
    folder, _, name = file.partition("/") if isinstance(file, str) else ("", "", None)
    return name if folder == "blocks" and is_plain_name(name) else None


def block_file_key(run_id: str, file) -> str | None:
    """The key of ``file`` (``blocks/{name}``) in the run, or None when it is not a plain name in ``blocks/``."""
    name = block_name(file)
    return None if name is None else run_key(run_id, "blocks", name)


def hf_key(run_id: str, name: str = "") -> str:
    """Where a run from ``model.from_hf`` keeps the checkpoint's config and tokenizer files."""
    return run_key(run_id, "hf", name) if name else run_key(run_id, "hf")


# -- a visit --------------------------------------------------------------------------------------------------
def visit_key(run_id: str, cycle: int, block: int) -> str:
    return run_key(run_id, "visits", f"c{cycle}-b{block}")


def visits_key(run_id: str) -> str:
    """Where a run's visits keep their working objects (one ``c{cycle}-b{block}`` folder each)."""
    return run_key(run_id, "visits")


def parse_visit(name: str) -> tuple[int, int] | None:
    """(cycle, block) of a visit folder's name (``c0-b2`` -> (0, 2)); None for anything else."""
    m = re.fullmatch(r"c(\d+)-b(\d+)", name)
    return (int(m[1]), int(m[2])) if m else None


def acts_key(run_id: str, cycle: int, block: int) -> str:
    return f"{visit_key(run_id, cycle, block)}/activations.zarr"


def shard_done_key(acts: str, shard: int | None = None) -> str:
    """The completion markers of an activation group's shards (``acts`` = the group's key)."""
    return f"{acts}/done" if shard is None else f"{acts}/done/{shard}.json"


def train_ckpt_key(visit: str) -> str:
    """The mid-visit checkpoint of a visit (``visit`` = its key)."""
    return f"{visit}/train-ckpt"


def nodes_key(run_id: str, cycle: int, block: int) -> str:
    """A visit across machines: the job the other machines join (``bcdflow join``), there while it trains."""
    return f"{visit_key(run_id, cycle, block)}/nodes.json"


def outcome_key(run_id: str, cycle: int, block: int) -> str:
    return f"{visit_key(run_id, cycle, block)}/{OUTCOME}"


def mlflow_key(run_id: str, cycle: int, block: int) -> str:
    return f"{visit_key(run_id, cycle, block)}/{MLFLOW}"


def spent_key(run_id: str, cycle: int, block: int) -> str:
    """What a visit had spent when its latest attempt started (core/spend.earlier_attempts)."""
    return f"{visit_key(run_id, cycle, block)}/{SPENT}"


def retention_key(run_id: str) -> str:
    """The versions of a run a user pinned and those ``bcdflow prune`` removed (storage/prune.py)."""
    return run_key(run_id, RETENTION)


# Store.write_bytes's temporary name beside an object (``{name}.tmp-{pid}-{thread}``), left by a writer that died
_WRITE_TMP = r"(\.tmp-\d+-\d+)?"
_RUN_FOLDERS = {"states": re.compile(rf"^\d{{12}}\.json{_WRITE_TMP}$"), "lease": re.compile(rf"^\d{{12}}\.json{_WRITE_TMP}$"),
                "versions": re.compile(rf"^\d+\.json{_WRITE_TMP}$")}
_RUN_FILES = re.compile(rf"^(config\.json|state\.json|retention\.json){_WRITE_TMP}$")


def is_run_object(rel: str) -> bool:
    """Whether ``rel`` (a key relative to ``runs/{id}/``) names an object bcdflow writes in a run's folder (the
    layout above, and the temporary names of writes that died): ``bcdflow rm`` removes these and leaves anything
    else (a file a user put there). Below a visit's folder everything is the visit's working objects."""
    parts = rel.split("/")
    if len(parts) == 1:
        return bool(_RUN_FILES.match(parts[0]))
    top, name = parts[0], parts[1]
    if top == "visits":
        return parse_visit(name) is not None
    if len(parts) != 2:
        return False
    if top == "blocks":
        return is_block_file_name(name)
    if top == "hf":
        return is_plain_name(name)
    return top in _RUN_FOLDERS and bool(_RUN_FOLDERS[top].match(name))


# -- leases -------------------------------------------------------------------------------------------------
def lease_key(owner_key: str, epoch: int | None = None) -> str:
    """The lease objects of a run or a visit (``owner_key`` = ``run_key(id)`` or ``visit_key(...)``)."""
    return f"{owner_key}/lease" if epoch is None else f"{owner_key}/lease/{epoch:012d}.json"


def lease_epoch(name: str) -> int | None:
    """The epoch of a lease object's name (``000000000007.json`` -> 7); None for anything else."""
    stem = name.removesuffix(".json")
    return int(stem) if name.endswith(".json") and stem.isdigit() else None


# -- the store itself ------------------------------------------------------------------------------------------
def probe_key(token: str) -> str:
    """A key that ``Store`` creates twice and removes, to learn whether an exclusive create is exclusive."""
    return f"probes/{token}"


def throughput_key(token: str) -> str:
    """Where ``bcdflow plan --probe`` writes and reads its few activation shards, removed after."""
    return f"probes/throughput-{token}"


# -- datasets -------------------------------------------------------------------------------------------------
def dataset_key(dataset_id: str, *parts: str) -> str:
    """A token dataset's key. Its id may come from the store (a run's config.json), so it must be a plain name."""
    if not is_plain_name(dataset_id):
        raise UnsafeName(f"dataset id {dataset_id!r} is not a plain name (read from a damaged run config or state); "
                         "restore the run's config.json")
    return "/".join([DATASETS, dataset_id, *parts])
