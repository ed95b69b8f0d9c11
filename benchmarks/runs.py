"""Training runs through the real flows (``flows.bcd.bcd_train`` / ``full_train``), shared by the
validity, sampling, order and cost benchmarks and read back from the run state.

Runs live in a temporary store with MLflow off, under Prefect's test server (a temporary database)
unless a Prefect API is already configured (the test session's). A run is keyed by its configuration,
so benchmarks asking for the same run in one process get it once: the cyclic BCD-AdamW run of
``validity`` is the reference of ``sampling`` and ``order``, and ``cost`` prices whatever ran.

Curves come from ``storage.runs.read_state``: one point per BCD visit (``step_end``, ``val_loss``), the
full run's ``val_points`` in between, with cumulative tokens, seconds and GPU-hours from
``core.spend.curve`` and, added here, analytic FLOPs (training steps, pre-inference, evaluation) and
``stage_seconds`` (the measured seconds of those three stages, without orchestration, commits and store I/O).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import forward_flops, meta_model, step_flops
from bcdflow.core import spend
from bcdflow.core.config import load_config
from bcdflow.core.context import open_store
from bcdflow.models.model_config import ModelConfig
from bcdflow.models.plan import VisitTarget
from bcdflow.storage import runs
from bcdflow.storage.layout import DATASET_META, dataset_key

# Prefect and the flows (which import it) are imported inside the functions below, when runs start: Prefect reads
# its settings (PREFECT_HOME, ...) on import, and the command line sets them (cli.setup_env) after importing this.

_BOOKS: dict[tuple, "RunBook"] = {}


def book(profile_name: str, prof: dict, threads: int, section: str = "flows") -> "RunBook":
    """The process's run book for a profile's section (``flows``, ``suite``) and thread count (tests share
    runs across calls)."""
    key = (profile_name, section, threads)
    if key not in _BOOKS:
        _BOOKS[key] = RunBook(prof[section], threads)
    return _BOOKS[key]


@contextlib.contextmanager
def flow_server():
    """Prefect's test server (temporary database), unless an API URL is already set."""
    import prefect.settings  # local: see the note above

    if prefect.settings.PREFECT_API_URL.value():
        yield
        return
    from prefect.testing.utilities import prefect_test_harness  # local: see the note above (and it loads the server)

    with prefect_test_harness(server_startup_timeout=None):
        yield


class RunBook:
    def __init__(self, flows: dict, threads: int):
        self.flows, self.threads = flows, threads
        self.root = Path(tempfile.mkdtemp(prefix="bcdflow-bench-"))
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)
        self.runs: dict[str, dict] = {}  # key -> result
        self.order: list[str] = []

    def sets(self, optim: str, extra: list[str] = ()) -> list[str]:
        """The run's ``--set`` list: the book's, the optimizer (and its learning rate where the book has one per
        optimizer), the book's store, then ``extra`` (later keys win)."""
        lr = self.flows.get("lr", {}).get(optim)
        return [*self.flows["sets"], f"optim.name={optim}", *([f"optim.lr={lr}"] if lr is not None else []),
                f"store={self.root / 'store'}", "tracking_uri=none", *extra]

    def get(self, label: str, mode: str, optim: str, extra: list[str] = ()) -> dict:
        sets = self.sets(optim, extra)
        key = json.dumps([mode, sets])
        if key in self.runs:
            return self.runs[key]
        cfg = load_config(sets=sets)
        run_id = f"{mode}-{len(self.runs):02d}"
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        try:
            from bcdflow.flows.bcd import bcd_train, full_train  # local: imports Prefect (see the note above)

            (full_train if mode == "full" else bcd_train)(config=cfg.model_dump(), run_id=run_id)
        finally:
            torch.set_num_threads(prev)
        res = read_run(cfg, run_id, label, mode, optim, sets, time.perf_counter() - t0)
        print(f"  run {label}: {res['steps']} steps, final val {res['final_val']:.4f}, "
              f"stop {res['stop_reason']}, {res['wall_seconds']:.0f} s", flush=True)
        self.runs[key] = res
        self.order.append(key)
        return res

    def all(self) -> list[dict]:
        return [self.runs[k] for k in self.order]


def read_run(cfg, run_id: str, label: str, mode: str, optim: str, sets: list[str], wall: float) -> dict:
    store = open_store(cfg)
    state = runs.read_state(store, run_id)
    conf = runs.read_config(store, run_id)
    curve = spend.curve(state.visits)
    visits = [v.model_dump() for v in state.visits]
    mcfg = ModelConfig(**conf["model_resolved"])
    meta = meta_model(mcfg)
    blocks = conf["plan"]["blocks"] + conf["plan"].get("rows", [])  # row blocks (bcd.vocab_blocks) index after
    T = cfg.data.seq_len
    eval_tokens = cfg.train.eval_rows * T  # evaluate_model reads at most eval_rows rows
    flops_by_visit = []
    for v in visits:
        blk = blocks[v["block"]]
        lo = blk["layers"][0]
        pre = mode == "bcd" and VisitTarget.from_dict(blk).reads_activations(cfg.bcd.preinfer)
        train = step_flops(meta, set(blk["params"]), mcfg, T, grad_from=lo, lo=lo if pre else 0) * v["tokens"]
        prefix = forward_flops(meta, mcfg, T, 0, lo) * v["rows"] * T if pre else 0
        evals = (1 + len(v.get("val_points") or [])) * forward_flops(meta, mcfg, T, 0, mcfg.n_layer, head=True) \
            * eval_tokens
        flops_by_visit.append({"train": train, "preinfer": prefix, "eval": evals})
    # cumulative FLOPs and stage seconds on the curve, pro rata by step within a visit (as spend.curve does for
    # cost)
    acc, acc_s, start = 0.0, 0.0, 0
    for v, f in zip(visits, flops_by_visit):
        total = f["train"] + f["preinfer"] + f["eval"]
        secs = sum(float(v.get(f"{k}_seconds") or 0) for k in ("train", "preinfer", "eval"))
        for p in curve:
            if (p["cycle"], p["block"]) == (v["cycle"], v["block"]) and start < p["step"] <= v["step_end"]:
                frac = (p["step"] - start) / v["steps"] if v["steps"] else 1.0
                p["flops"] = acc + frac * total
                p["stage_seconds"] = acc_s + frac * secs
        acc += total
        acc_s += secs
        start = v["step_end"]
    ds = store.read_json(dataset_key(state.dataset, DATASET_META)) if state.dataset else {}
    return {"label": label, "run_id": run_id, "mode": mode, "optim": optim, "sets": sets,
            "store": cfg.store, "stop_reason": state.stop_reason, "visits": visits, "curve": curve,
            "steps": curve[-1]["step"] if curve else 0, "final_val": visits[-1]["val_loss"] if visits else None,
            "best_val": min(p["val_loss"] for p in curve) if curve else None, "wall_seconds": wall,
            "flops": {k: sum(f[k] for f in flops_by_visit) for k in ("train", "preinfer", "eval")},
            "stopped_by": [v["stopped_by"] for v in visits], "n_blocks": len(blocks),
            "time": {k: sum(float(v.get(f"{k}_seconds") or 0) for v in visits) for k in ("train", "preinfer", "eval")},
            "rows_per_visit": [v["rows"] for v in visits],
            "dataset": {k: ds.get(k) for k in ("id", "n_train", "n_val", "n_tokens", "n_docs", "seq_len")}}


def first_reach(curve: list[dict], target: float, key: str = "step"):
    """The first curve point at or below ``target`` (its ``key``), or None."""
    hit = next((p for p in curve if p["val_loss"] <= target), None)
    return hit[key] if hit else None
