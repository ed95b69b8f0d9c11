"""A store that does not only grow: prune a run's old versions, remove a run (``bcdflow prune`` / ``bcdflow rm``).

A version is its manifest (``versions/{v}.json``) naming one content-addressed block file per block; versions share
every block a visit did not change (docs/DESIGN.md §5), and a visit of ``bcd.moments=keep`` leaves its optimizer
state beside the block files, named by its visit record. Pruning keeps the last ``keep`` versions and every version
a user pinned (``retention.json``, kept across prunes), removes the other manifests, then every file under
``blocks/`` that no kept manifest names, except the optimizer state each block's next visit starts from (the last
one its visits wrote): optimizer states of older visits go, block files still referenced stay. The versions it
removed are recorded first, so ``export`` and ``generate`` of one say it was pruned, and a prune that stops half
way leaves only files the next prune removes. The caller holds the run's lease (no process trains it meanwhile).

    plan = plan_prune(store, "r1", keep=2, pins=[0])   # what would go, with sizes (nothing removed)
    apply_prune(store, "r1", plan)
    freed = remove_run(store, "r1")                    # runs/r1/ and everything in it
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bcdflow.errors import BadInput

from . import layout, runs
from .checkpoints import read_manifest
from .store import Store


@dataclass
class PrunePlan:
    """What a prune keeps and removes: versions, and files as (name under ``blocks/``, bytes)."""
    version: int
    kept: list[int]
    pinned: list[int]
    versions: list[int] = field(default_factory=list)
    manifest_bytes: int = 0
    blocks: list[tuple[str, int]] = field(default_factory=list)
    moments: list[tuple[str, int]] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return self.manifest_bytes + sum(b for _, b in self.blocks) + sum(b for _, b in self.moments)


def retention(store: Store, run_id: str) -> dict:
    """``{"pinned": [...], "pruned": [...]}``: the versions of a run a user pinned and those a prune removed."""
    key = layout.retention_key(run_id)
    out = store.read_json(key) if store.exists(key) else {}
    return {"pinned": sorted(set(out.get("pinned", []))), "pruned": sorted(set(out.get("pruned", [])))}


def check_not_pruned(store: Store, run_id: str, version: int) -> None:
    """BadInput when ``version`` of the run was removed by a prune (naming what is kept)."""
    if version in retention(store, run_id)["pruned"]:
        kept = ", ".join(map(str, _versions(store, run_id)))
        raise BadInput(f"--version: version {version} of run {run_id!r} was removed by bcdflow prune (kept: {kept})")


def _versions(store: Store, run_id: str) -> list[int]:
    names = store.listdir(layout.versions_key(run_id))
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _sizes(store: Store, key: str) -> dict[str, int]:
    """Name -> bytes of the objects directly under ``key``."""
    path = store.path(key)
    if not store.fs.exists(path):
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in store.fs.ls(path, detail=True) if e.get("type") != "directory"}


def size_of(store: Store, key: str) -> int:
    """Bytes of every object under ``key`` (0 when there is none)."""
    path = store.path(key)
    return int(store.fs.du(path, total=True)) if store.fs.exists(path) else 0


def plan_prune(store: Store, run_id: str, keep: int, pins: list[int] = ()) -> PrunePlan:
    """What pruning run ``run_id`` to its last ``keep`` versions plus the pinned ones (``pins`` and those pinned
    before) would remove. Bad input: ``keep`` < 1, a pin that is not a version of the run."""
    if keep < 1:
        raise BadInput(f"--keep: at least the last version is kept (got {keep})")
    state = runs.read_state(store, run_id)
    if state is None:
        raise BadInput(f"run {run_id!r} not found in store {store.url}")
    present = _versions(store, run_id)
    for v in pins:
        if v not in present:
            raise BadInput(f"--pin: run {run_id!r} has no version {v} (versions: {', '.join(map(str, present))})")
    pinned = sorted(set(retention(store, run_id)["pinned"]) | set(pins))
    kept = sorted({v for v in present if state.version - keep < v <= state.version} | set(pinned))
    plan = PrunePlan(version=state.version, kept=kept, pinned=pinned,
                     versions=[v for v in present if v not in kept and v <= state.version])
    manifests = _sizes(store, layout.versions_key(run_id))
    plan.manifest_bytes = sum(manifests.get(f"{v}.json", 0) for v in plan.versions)
    named = {layout.block_name(e["file"]) for v in kept  # read_manifest has checked each entry's file
             for e in read_manifest(store, run_id, v)["blocks"].values()}
    last_moments: dict[int, str] = {}  # what each block's next visit starts from (bcd.moments=keep)
    every_moments = set()
    for rec in state.visits:
        if rec.moments:
            name = layout.block_name(rec.moments.get("file") if isinstance(rec.moments, dict) else None)
            if name is None:  # nothing is removed on a record that cannot say what it keeps
                raise runs.RunStateError(f"{store.url_of(layout.state_key(run_id))}: the record of visit "
                                         f"c{rec.cycle}-b{rec.block} names no block file for its kept moments "
                                         f"({rec.moments!r:.80}): nothing pruned")
            last_moments[rec.block] = name
            every_moments.add(name)
    for name, size in sorted(_sizes(store, layout.blocks_key(run_id)).items()):
        if name in named or name in last_moments.values():
            continue
        (plan.moments if name in every_moments else plan.blocks).append((name, size))
    return plan


def apply_prune(store: Store, run_id: str, plan: PrunePlan) -> None:
    """Remove what ``plan`` names: the versions are recorded as pruned first, then their manifests go, then the
    files (a kept manifest never names one of them)."""
    kept = retention(store, run_id)
    store.write_json({"pinned": plan.pinned, "pruned": sorted(set(kept["pruned"]) | set(plan.versions))},
                     layout.retention_key(run_id))
    for v in plan.versions:
        store.rm(layout.manifest_key(run_id, v))
    for name, _ in plan.blocks + plan.moments:
        store.rm(layout.blocks_key(run_id), name)


def remove_run(store: Store, run_id: str) -> int:
    """Remove ``runs/{run_id}/`` whole; returns the bytes it held. The token dataset is shared and stays."""
    freed = size_of(store, layout.run_key(run_id))
    store.rm(layout.run_key(run_id))
    return freed


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
