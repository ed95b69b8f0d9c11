"""Commit cost per visit (manifest + state), before (state.json overwritten, the code of 6aee57b) and after (fenced
exclusive create of states/{seq}.json): `python benchmarks/commit_cost.py local|s3` (s3: a moto server on loopback).
The old storage/runs.py is read from git (`git show 6aee57b:storage/runs.py`)."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.store import Store
_OLD = os.path.join(tempfile.mkdtemp(), "runs_old.py")
with open(_OLD, "wb") as f:
    f.write(subprocess.run(["git", "show", "6aee57b:storage/runs.py"], capture_output=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout)
spec = importlib.util.spec_from_file_location("bcdflow.storage.runs_old", _OLD)
old = importlib.util.module_from_spec(spec); sys.modules[spec.name] = old; spec.loader.exec_module(old)

def rec(v):
    return runs.VisitRecord(cycle=0, block=0, version=v, steps=4, step_end=4*v, stopped_by="max_steps", rows=32,
                            tokens=1024, first_loss=5.0, train_loss=4.0, val_loss=4.1, val_ppl=60.0, tokens_per_s=1e3, seconds=1.0)

def bench(url, mod, n=20, **so):
    store = Store(url, so)
    e = [checkpoints.save_block(store, "r", {f"x{b}": torch.full((4,), float(b))}) for b in range(3)]
    checkpoints.write_manifest(store, "r", 0, dict(enumerate(e)))
    if mod is runs:
        runs.write_state(store, runs.RunState(run_id="r"), {"run": 0})
    else:
        old.write_state(store, old.RunState(run_id="r"))
    ts = []
    for v in range(1, n + 1):
        t = time.perf_counter()
        st = mod.read_state(store, "r")
        assert st.version == v - 1
        checkpoints.commit_version(store, "r", v - 1, v, {0: e[v % 3]})
        if mod is runs:
            runs.append_visit(store, "r", rec(v), {"run": 0}, base=st)
        else:
            old.append_visit(store, "r", rec(v))
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1000 * ts[len(ts) // 2]

if __name__ == "__main__":
    which = sys.argv[1]
    if which == "local":
        for name, mod in (("before", old), ("after", runs)):
            print(f"local {name}: {bench(tempfile.mkdtemp() + '/s', mod):.2f} ms median per commit")
    else:
        from moto.server import ThreadedMotoServer
        import s3fs
        os.environ.update(AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t", AWS_DEFAULT_REGION="us-east-1")
        srv = ThreadedMotoServer(ip_address="127.0.0.1", port=5123, verbose=False); srv.start()
        ep = "http://127.0.0.1:5123"
        fs = s3fs.S3FileSystem(endpoint_url=ep)
        for name, mod in (("before", old), ("after", runs)):
            fs.mkdir(f"b-{name}")
            print(f"moto S3 {name}: {bench(f's3://b-{name}/p', mod, endpoint_url=ep):.2f} ms median per commit")
        srv.stop()
