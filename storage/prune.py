"""A store that does not only grow: prune a run's old versions, remove a run (``bcdflow prune`` / ``bcdflow rm``).

A version is its manifest (``versions/{v}.json``) naming one content-addressed block file per block; versions share
every block a visit did not change (docs/DESIGN.md §5), and a visit of ``bcd.moments=keep`` leaves its optimizer
state beside the block files, named by its visit record. Pruning keeps the last ``keep`` versions and every version
a user pinned (``retention.json``, kept across prunes), removes the other manifests, then every file under
``blocks/`` that no kept manifest names, except the optimizer state each block's next visit starts from (the last
one its visits wrote): optimizer states of older visits go, block files still referenced stay.

What deletes proves what it deletes (issue 32). :func:`plan_prune` decides from the manifests, each one read and
checked, never from a number alone: the state's version must be one of them (a state that disagrees with the
manifests is damage: nothing is removed), every file a kept version names must be there at its recorded size (a
prune keeps only whole versions, so it never removes the last good copy of a block), and only names the layout
makes are candidates (``layout.is_block_file_name``), reached without a symbolic link (``Store.check_confined``).
``PrunePlan.deletions`` is the one list of keys: ``--dry-run`` prints it and :func:`apply_prune` removes exactly it.
The versions it removes are recorded first, so ``export`` and ``generate`` of one say it was pruned, and a prune
that stops half way leaves only files the next prune removes; on a full disk, where that record cannot be written,
the files no version names go first and the record follows once there is room (the freeing never waits on it).
The caller holds the run's lease (no process trains it meanwhile).

:func:`run_removal` is ``bcdflow rm``'s list the same way: the objects of the run's folder that the layout names
(``layout.is_run_object``), found without following a link; anything else (a user's file, a link) stays.

    plan = plan_prune(store, "r1", keep=2, pins=[0])   # what would go, with sizes (nothing removed)
    apply_prune(store, "r1", plan)
    freed, left = remove_run(store, "r1")              # the run's objects, and what was not bcdflow's
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bcdflow.errors import BadInput

from . import layout, runs
from .checkpoints import CheckpointError, read_manifest
from .store import Store

# what a write on a full disk raises: the commands that free space must not need it first
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class Retention(BaseModel):
    """``runs/{id}/retention.json``: the versions a user pinned and those ``bcdflow prune`` removed."""
    model_config = ConfigDict(extra="forbid", strict=True)
    pinned: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    pruned: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)


@dataclass
class PrunePlan:
    """What a prune keeps and removes: versions, and files as (name under ``blocks/``, bytes)."""
    run_id: str
    version: int
    kept: list[int]
    pinned: list[int]
    versions: list[int] = field(default_factory=list)
    manifest_bytes: int = 0
    blocks: list[tuple[str, int]] = field(default_factory=list)
    moments: list[tuple[str, int]] = field(default_factory=list)
    leftovers: list[tuple[str, int]] = field(default_factory=list)
    """Temporary block files of writers that died (``layout.block_tmp_name``)."""
    named_by_removed: set[str] = field(default_factory=set)
    """The files of ``blocks`` that a removed manifest names (the rest no manifest names at all)."""
    logged: list[int] = field(default_factory=list)
    """The removed versions MLflow logged a model of (a tracked run's visits log one per version they commit,
    pointing at the store's manifest, not a copy): after the prune they point at removed files."""
    mlflow_run_id: str | None = None

    @property
    def files(self) -> list[tuple[str, int]]:
        return self.blocks + self.moments + self.leftovers

    @property
    def freed(self) -> int:
        return self.manifest_bytes + sum(b for _, b in self.files)

    @property
    def deletions(self) -> list[str]:
        """Every key the prune removes, in the order it removes them: what ``--dry-run`` lists."""
        return ([layout.manifest_key(self.run_id, v) for v in self.versions]
                + [layout.run_key(self.run_id, "blocks", name) for name, _ in self.files])


def retention(store: Store, run_id: str) -> dict:
    """``{"pinned": [...], "pruned": [...]}``: the versions of a run a user pinned and those a prune removed; a record
    that is not one is damage naming it (RunStateError)."""
    key = layout.retention_key(run_id)
    try:
        rec = Retention.model_validate_json(store.read_bytes(key))
    except FileNotFoundError:
        rec = Retention()
    except ValidationError as e:
        raise runs.RunStateError(f"retention record {store.url_of(key)} is damaged ({runs._what(e)}); restore it or "
                                 "remove it (it only lists pinned and pruned versions)") from None
    return {"pinned": sorted(set(rec.pinned)), "pruned": sorted(set(rec.pruned))}


def check_not_pruned(store: Store, run_id: str, version: int) -> None:
    """BadInput when ``version`` of the run was removed by a prune (naming what is kept)."""
    if version in retention(store, run_id)["pruned"]:
        kept = ", ".join(map(str, _versions(store, run_id)))
        raise BadInput(f"--version: version {version} of run {run_id!r} was removed by bcdflow prune (kept: {kept})")


def _versions(store: Store, run_id: str) -> list[int]:
    names = store.listdir(layout.versions_key(run_id))
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _files(store: Store, key: str) -> dict[str, int]:
    """Name -> bytes of the plain files directly under ``key`` (a local store: regular files, never links)."""
    path = store.path(key)
    if store.is_local:
        try:
            with os.scandir(path) as it:
                return {e.name: e.stat(follow_symlinks=False).st_size for e in it
                        if e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    if not store.fs.exists(path):
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in store.fs.ls(path, detail=True) if e.get("type") != "directory"}


def size_of(store: Store, key: str) -> int:
    """Bytes of every object under ``key`` (0 when there is none)."""
    path = store.path(key)
    return int(store.fs.du(path, total=True)) if store.fs.exists(path) else 0


def _refuse(store: Store, run_id: str, why: str) -> None:
    raise runs.RunStateError(f"run {run_id!r} in {store.url}: {why}; nothing pruned")


def plan_prune(store: Store, run_id: str, keep: int, pins: list[int] = ()) -> PrunePlan:
    """What pruning run ``run_id`` to its last ``keep`` versions plus the pinned ones (``pins`` and those pinned
    before) would remove, read and checked from the store (module docstring). Bad input: ``keep`` < 1, a pin that is
    not a version of the run. Damage (nothing removed, one line naming the object): a state whose version has no
    manifest, a manifest or visit record that is not one, a kept version with a file missing or cut, a ``blocks/`` or
    ``versions/`` folder that is a link."""
    if keep < 1:
        raise BadInput(f"--keep: at least the last version is kept (got {keep})")
    state = runs.read_state(store, run_id)  # every record checked for type and range (storage/runs.py)
    if state is None:
        raise BadInput(f"run {run_id!r} not found in store {store.url}")
    for key in (layout.versions_key(run_id), layout.blocks_key(run_id)):
        store.check_confined(key)
    present = _versions(store, run_id)
    for v in pins:
        if v not in present:
            raise BadInput(f"--pin: run {run_id!r} has no version {v} (versions: {', '.join(map(str, present))})")
    if state.version not in present:
        _refuse(store, run_id, f"its state says version {state.version}, but {layout.manifest_key(run_id, state.version)}"
                f" does not exist (manifests: {', '.join(map(str, present)) or 'none'}): the state and the manifests "
                "disagree")
    pinned = sorted(set(retention(store, run_id)["pinned"]) | set(pins))
    kept = sorted({v for v in present if state.version - keep < v <= state.version} | (set(pinned) & set(present)))
    removed = [v for v in present if v not in kept and v <= state.version]
    # every manifest read and checked (a damaged one: CheckpointError naming it); those above the state's version
    # are a crashed commit's, left for the run's next holder to drop, and their files stay meanwhile
    plan_blocks = (runs.read_config(store, run_id).get("plan") or {}).get("blocks")
    # a kept version must hold every block of the run's plan (read_config checked its entries are objects)
    blocks = [i if b.get("index") is None else b["index"] for i, b in enumerate(plan_blocks)] if plan_blocks else None
    manifests = {v: read_manifest(store, run_id, v, blocks=blocks if v in kept else None) for v in present}
    files = _files(store, layout.blocks_key(run_id))
    named = _named(store, run_id, manifests, files, kept, removed)
    by_removed = {layout.block_name(e["file"]) for v in removed for e in manifests[v]["blocks"].values()} - named
    last_moments: dict[int, str] = {}  # what each block's next visit starts from (bcd.moments=keep)
    every_moments = set()
    for rec in state.visits:
        if rec.moments:  # a plain name in blocks/: VisitRecord checked it
            last_moments[rec.block] = layout.block_name(rec.moments["file"])
            every_moments.add(last_moments[rec.block])
    manifest_sizes = _files(store, layout.versions_key(run_id))
    plan = PrunePlan(run_id=run_id, version=state.version, kept=kept, pinned=pinned, versions=removed,
                     manifest_bytes=sum(manifest_sizes.get(f"{v}.json", 0) for v in removed),
                     named_by_removed=by_removed, mlflow_run_id=state.mlflow_run_id)
    if state.mlflow_run_id:  # a tracked run: each visit logged a model of the version it committed
        plan.logged = [v for v in removed if v in {r.version for r in state.visits}]
    for name, size in sorted(files.items()):
        if not layout.is_block_file_name(name) or name in named or name in last_moments.values():
            continue  # not bcdflow's, or still needed
        if name.startswith("."):  # a temporary name
            plan.leftovers.append((name, size))
        else:
            (plan.moments if name in every_moments else plan.blocks).append((name, size))
    return plan


def _named(store: Store, run_id: str, manifests: dict, files: dict[str, int], kept: list[int],
           removed: list[int]) -> set[str]:
    """The block files the versions not removed name; each of a kept version's whole (its size the manifest's), else
    CheckpointError naming it: a prune keeps only whole versions."""
    named: set[str] = set()
    for v, manifest in manifests.items():
        if v in removed:
            continue
        for b, e in manifest["blocks"].items():
            name = layout.block_name(e["file"])
            if v in kept and files.get(name) != e["bytes"]:
                what = "missing" if name not in files else f"{files[name]} bytes, its manifest says {e['bytes']}"
                raise CheckpointError(f"block file {store.url_of(layout.run_key(run_id, e['file']))} (block {b} of "
                                      f"kept version {v}) is {what}: a prune keeps only whole versions; nothing pruned")
            named.add(name)
    return named


def _record(store: Store, run_id: str, plan: PrunePlan) -> None:
    before = retention(store, run_id)
    store.write_json({"pinned": plan.pinned, "pruned": sorted(set(before["pruned"]) | set(plan.versions))},
                     layout.retention_key(run_id))


def apply_prune(store: Store, run_id: str, plan: PrunePlan) -> bool:
    """Remove exactly ``plan.deletions``: the versions are recorded as pruned first, then their manifests go, then the
    files (a kept manifest never names one of them). On a full disk the record waits: the files no manifest names go
    first (no version loses anything), then the record is tried again, and if there is still no room the rest goes
    before it (the record then follows, with the room it freed). Returns whether the record was written (False: the
    disk is still full; the removed versions are then gone unrecorded, and ``export`` of one says it is missing)."""
    def rm_files(names) -> None:
        for name in names:
            store.rm(layout.blocks_key(run_id), name)

    try:
        _record(store, run_id, plan)
        recorded = True
    except OSError as e:
        if e.errno not in FULL_DISK:
            raise
        recorded = False
    gone: set[str] = set()
    if not recorded:
        unnamed = [n for n, _ in plan.files if n not in plan.named_by_removed]
        rm_files(unnamed)
        gone.update(unnamed)
        try:
            _record(store, run_id, plan)
            recorded = True
        except OSError as e:
            if e.errno not in FULL_DISK:
                raise
    for v in plan.versions:
        store.rm(layout.manifest_key(run_id, v))
    rm_files(n for n, _ in plan.files if n not in gone)
    if not recorded:
        try:
            _record(store, run_id, plan)
            recorded = True
        except OSError as e:
            if e.errno not in FULL_DISK:
                raise
    return recorded


@dataclass
class Removal:
    """What ``bcdflow rm`` removes: the run's objects (key, bytes), and the entries it leaves (not bcdflow's)."""
    objects: list[tuple[str, int]] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(b for _, b in self.objects)


def run_removal(store: Store, run_id: str) -> Removal:
    """The objects of ``runs/{run_id}/`` that ``bcdflow rm`` removes: those the layout names (``is_run_object``),
    found without following a symbolic link, and the entries it leaves (a user's file, a link). The run's folder
    itself must be reached without a link (``check_confined``: UnsafeName, nothing removed)."""
    run = layout.run_key(run_id)
    store.check_confined(run)
    out = Removal()
    if store.is_local:
        top = store.path(run)
        for d, dirs, names in os.walk(top):  # followlinks=False: a link to a folder is listed, never entered
            for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                p = os.path.join(d, n)
                rel = os.path.relpath(p, top).replace(os.sep, "/")
                if layout.is_run_object(rel) and not os.path.islink(p):
                    out.objects.append((f"{run}/{rel}", os.lstat(p).st_size))
                else:
                    out.left.append(rel)
    else:
        base = store.path(run)
        for p, info in sorted(store.fs.find(base, detail=True).items()):
            rel = p[len(base):].lstrip("/")
            if layout.is_run_object(rel):
                out.objects.append((f"{run}/{rel}", int(info.get("size") or 0)))
            else:
                out.left.append(rel)
    out.objects.sort()
    out.left.sort()
    return out


def remove_run(store: Store, run_id: str, removal: Removal | None = None) -> Removal:
    """Remove the run's objects (``run_removal``); a local store's folders too, where nothing is left in them. The
    token dataset is shared and stays. Returns what was removed and what was left."""
    removal = removal or run_removal(store, run_id)
    paths = [store.path(k) for k, _ in removal.objects]
    for i in range(0, len(paths), 1000):  # one request per 1000 keys on S3
        try:
            store.fs.rm(paths[i:i + 1000])
        except FileNotFoundError:  # gone meanwhile (a visit's own cleanup): remove the rest one by one
            for p in paths[i:i + 1000]:
                if store.fs.exists(p):
                    store.fs.rm_file(p)
    if store.is_local:
        top = store.path(layout.run_key(run_id))
        for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):  # deepest first
            if not os.path.islink(d):
                try:
                    os.rmdir(d)
                except OSError:  # not empty: something that was not bcdflow's stays
                    pass
    return removal


def dataset_users(store: Store, dataset_id: str | None) -> list[str]:
    """The runs of the store whose config names token dataset ``dataset_id``."""
    if not dataset_id:
        return []
    out = []
    for r in runs.list_runs(store):
        try:
            if runs.read_config(store, r).get("dataset") == dataset_id:
                out.append(r)
        except runs.RunStateError:
            continue
    return out
