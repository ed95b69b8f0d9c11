"""Fleet overheads (docs/DESIGN.md §6): what dispatching a visit to a work pool costs next to an in-process subflow, and
pre-inference throughput on 1 vs 2 Dask worker processes.

    python benchmarks/fleet.py                 # tiny and gpt2-124m at half width; a few minutes on 2 cores
    python benchmarks/fleet.py --only dask     # or: --only dispatch

Dispatch: a real ``prefect server start`` and one ``bcdflow worker`` (worker poll every second, as docs/guide/fleet.md
advises for a fleet), a local store. For each config, the same visits run once as in-process subflows and once as
``bcd-visit/<pool>`` deployment runs; a visit's overhead is the parent's wall time for it minus the visit's own
(``VisitRecord.seconds``: pre-inference to commit), its share that over the parent's wall time. Dispatch overhead
is the worker's pickup (up to its poll interval), a fresh Python process (imports: torch, Prefect) and the
deployment's pull step; it does not grow with the visit, so its share falls as visits get longer.

Dask: the shard phase of one visit (``flows.visit.preinfer``) on a LocalCluster of 1 and of 2 worker processes
(one thread each), cluster start excluded; rows per second and the speedup. On a 2-core CPU the two workers
share the cores that one worker's torch already uses; on a GPU fleet each worker is its own GPU.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from bcdflow.core.context import open_store

import httpx

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

POOL = "bench-gpu"
CONFIGS = {
    "tiny": ["model.name=tiny", "data.seq_len=128", "data.vocab_size=2048", "data.builtin_bytes=600000",
             "bcd.blocks=3", "bcd.max_steps=60", "bcd.patience=0", "train.batch_size=16", "optim.lr=0.003"],
    "gpt2-124m-half": ["model.name=gpt2-124m", "model.d_model=384", "model.n_head=6", "data.seq_len=256",
                       "data.vocab_size=8192", "data.builtin_bytes=2000000", "bcd.blocks=3", "bcd.max_steps=60",
                       "bcd.patience=0", "train.batch_size=8", "optim.lr=0.001"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root: Path):
        self.root = root
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env = {**base, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_HOME": str(root / "client"),
                    "PREFECT_CLI_PROMPT": "false", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([Path(sys.executable).parent / "prefect", "server", "start", "--host",
                                      "127.0.0.1", "--port", str(port)], env={**self.env, "PREFECT_HOME": str(root / "srv")},
                                     stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT)
        self.env["PREFECT_API_URL"] = self.api
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and self.proc.poll() is None, "the Prefect server did not start"
            time.sleep(0.5)
        os.environ.update(PREFECT_API_URL=self.api)  # this process's flows use it too
        prefect = Path(sys.executable).parent / "prefect"
        env = {k: v for k, v in self.env.items() if k != "BCDFLOW_HOME"}
        subprocess.run([prefect, "work-pool", "create", POOL, "--type", "process"], env=env, check=True,
                       capture_output=True)
        # the repository's visit deployment, under this pool's name (a deployment per pool, named after it)
        code = ("from bcdflow.flows.visit import visit\n"
                f"visit.from_source('{ROOT}', 'flows/visit.py:visit').deploy(name='{POOL}', work_pool_name='{POOL}')")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, cwd=ROOT)
        self.worker = subprocess.Popen([Path(sys.executable).parent / "bcdflow", "worker", "--pool", POOL],
                                       env=self.env, stdout=open(root / "worker.log", "w"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.worker.terminate()
        self.worker.wait(timeout=60)
        self.proc.terminate()
        self.proc.wait(timeout=60)


def dispatch(name: str, sets: list[str], root: Path) -> dict:
    # local, here and in dask_throughput: Prefect and torch (under bcdflow) read PREFECT_HOME and OMP_NUM_THREADS when
    # imported, which main() sets first
    from prefect import flow

    from bcdflow.core.config import load_config
    from bcdflow.flows.fleet import dispatch_visit
    from bcdflow.flows.visit import visit
    from bcdflow.storage import runs
    from bcdflow.tasks.data import token_dataset
    from bcdflow.tasks.run import init_run

    out = {}
    for mode in ("in-process", "dispatch"):
        extra = [f"fleet.visit_pool={POOL}", "fleet.poll_seconds=0.5"] if mode == "dispatch" else []
        cfg = load_config(sets=[*sets, "tracking_uri=none", f"store={root / name / mode}", *extra])
        ds = token_dataset(cfg, open_store(cfg))
        init_run.fn(cfg, "b", ds)

        @flow(name=f"bench-{mode}")
        def parent() -> list[tuple[float, float]]:
            times, version = [], 0
            for block in range(3):
                t = time.perf_counter()
                if mode == "dispatch":
                    rec = dispatch_visit(cfg, "b", 0, block, version, ds)
                else:
                    rec = visit("b", 0, block, version, ds, cfg)
                times.append((time.perf_counter() - t, rec.seconds))
                version = rec.version
            return times

        times = parent()
        state = runs.read_state(open_store(cfg), "b")
        assert [v.block for v in state.visits] == [0, 1, 2]
        wall = sum(t for t, _ in times)
        own = sum(s for _, s in times)
        out[mode] = {"parent_s_per_visit": wall / 3, "visit_s_per_visit": own / 3,
                     "overhead_s_per_visit": (wall - own) / 3, "overhead_share": (wall - own) / wall}
    return out


def dask_throughput(sets: list[str], root: Path) -> dict:
    from distributed import LocalCluster  # the fleet extra (prefect-dask)
    from prefect import flow

    from bcdflow.core.config import load_config
    from bcdflow.core.context import RunContext
    from bcdflow.flows.visit import preinfer
    from bcdflow.storage import layout
    from bcdflow.core.rules import visit_rows
    from bcdflow.tasks.data import token_dataset
    from bcdflow.tasks.run import init_run

    out = {}
    for n in (1, 2):
        # an existing scheduler, as on a fleet (fleet.dask_address): the cluster's start is not a visit's cost
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, resources={"GPU": 1}) as cluster:
            cfg = load_config(sets=[*sets, "tracking_uri=none", f"store={root / f'dask{n}'}", "bcd.shard_rows=32",
                                    "bcd.max_steps=64", "fleet.preinfer=dask",
                                    f"fleet.dask_address={cluster.scheduler_address}"])
            ds = token_dataset(cfg, open_store(cfg))
            init_run.fn(cfg, "d", ds)
            rows = len(visit_rows(cfg, RunContext.of(cfg, "d", ds).dataset.n_train, 0, 2))

            @flow(name=f"bench-dask-{n}")
            def shards() -> float:
                t = time.perf_counter()
                preinfer(RunContext.of(cfg, "d", ds), 0, 2, 0)
                return time.perf_counter() - t

            first = shards()  # the workers load the prefix and the token arrays on their first shards
            open_store(cfg).rm(layout.acts_key("d", 0, 2))
            warm = shards()
        out[n] = {"rows": rows, "seconds_first": first, "seconds": warm, "rows_per_s": rows / warm}
    out["speedup"] = out[2]["rows_per_s"] / out[1]["rows_per_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("dispatch", "dask"))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/fleet.json"))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bcdflow-fleet-bench-"))
    os.environ.update({"PREFECT_HOME": str(root / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "DO_NOT_TRACK": "1", "PREFECT_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    # after the environment above: torch reads OMP_NUM_THREADS when imported (and report imports numpy)
    import torch

    from benchmarks import report

    torch.set_num_threads(1)
    result: dict = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}}
    server = Server(root)
    try:
        if args.only in (None, "dispatch"):
            result["dispatch"] = {c: dispatch(c, CONFIGS[c], root) for c in args.configs}
            print(f"{'config':<16}{'mode':<12}{'parent s/visit':>16}{'visit s':>10}{'overhead s':>12}{'share':>8}")
            for c, modes in result["dispatch"].items():
                for m, r in modes.items():
                    print(f"{c:<16}{m:<12}{r['parent_s_per_visit']:>16.2f}{r['visit_s_per_visit']:>10.2f}"
                          f"{r['overhead_s_per_visit']:>12.2f}{r['overhead_share']:>8.1%}")
        if args.only in (None, "dask"):
            result["dask"] = dask_throughput(CONFIGS["gpt2-124m-half"], root)
            d = result["dask"]
            print(f"pre-inference, gpt2-124m-half, {d[1]['rows']} rows: 1 Dask worker {d[1]['rows_per_s']:.1f} rows/s, "
                  f"2 workers {d[2]['rows_per_s']:.1f} rows/s: speedup {d['speedup']:.2f}x (first visit on a fresh "
                  f"cluster: {d[1]['seconds_first']:.1f} s / {d[2]['seconds_first']:.1f} s)")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
