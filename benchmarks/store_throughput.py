"""Store throughput: one visit's activations written and read back through the Zarr layer
(``storage/activations.py``) against raw writes/reads of the same bytes on the same medium, side by side in one run.

Media: a local directory (``--dir``, default a temp dir beside the repository, on its disk) and the S3 test
server (moto on loopback, in this process, as ``tests/conftest.py``'s ``S3Server``). Paths on each medium:

  ``raw``        each shard's hidden and targets bytes as two plain objects (local: open/write/read, no fsync;
                 S3: s3fs ``pipe_file`` / ``cat_file``); no metadata.
  ``zarr``       the product path: ``create_group`` + ``write_shard`` per shard (its marker: sha256 of the shard's
                 bytes, fsynced JSON), ``ActivationReader`` (marker listing on open) and ``read`` (torch float32).
  ``zarr-bare``  the same arrays with the marker, checksums and per-call group opens taken out: one open group,
                 ``hidden[lo:hi] = ...``; reads return the stored numpy arrays. ``zarr`` minus this is their cost.

Phases, each timed on its own: write every shard; read all rows in contiguous ``--batch-rows`` ranges in order
(as training does); read whole shards. The reader/files are opened inside the read timing. Local figures: the
page cache is dropped (``/proc/sys/vm/drop_caches``, root only) before each read phase so reads come from the
disk for every path alike; writes are not fsynced (zarr's LocalStore does not), and the time to fsync what a
write phase left behind is reported separately ("w+flush"). MB/s counts the stored, uncompressed bytes
(hidden + targets), identical for every path. Medians over ``--repeats``, the paths taking turns in a rotating
order so a busy spell on a shared machine hits them alike (the JSON keeps every repeat and the best). Whole-shard
reads first-touch a fresh shard-sized output array in every path; on a VM just after a cache drop that touch is
sometimes slow (kernel page clearing inside read()), so read/shard is the noisier figure. moto serves S3 from
this process (it competes for the same CPU and GIL) and is slow, so S3 moves ``--s3-mb`` of the data, not ``--mb``.

Target (issue): Zarr on local disk >= 70% of raw. A miss prints MISS; the exit status stays 0 (docs/CONVENTIONS.md 10).

    python benchmarks/store_throughput.py                         # 256 MB local + 64 MB S3, about 2 minutes
    python benchmarks/store_throughput.py --no-s3 --dtype bfloat16 --compression zstd
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import zarr

from bcdflow.storage.activations import ActivationReader, create_group, write_shard
from bcdflow.storage.store import Store
from bcdflow.core.config import BcdSection

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: benchmarks.report from the repository
    sys.path.insert(0, str(REPO))
from benchmarks import report  # noqa: E402

MB = 2**20
PATHS = ("raw", "zarr", "zarr-bare")
TARGET = 0.70


@dataclass(frozen=True)
class Layout:
    n_rows: int
    seq_len: int
    d_model: int
    shard_rows: int
    dtype: str
    compression: str

    @property
    def n_shards(self) -> int:
        return -(-self.n_rows // self.shard_rows)

    def shard(self, s: int) -> tuple[int, int]:
        return s * self.shard_rows, min((s + 1) * self.shard_rows, self.n_rows)

    def batches(self, rows: int) -> list[tuple[int, int]]:
        return [(lo, min(lo + rows, self.n_rows)) for lo in range(0, self.n_rows, rows)]


class Data:
    """Hidden (n, T, d) in the logical dtype (write_shard's input; no conversion on the clock) and its stored
    numpy view (what raw writes), targets (n, T) int32."""

    def __init__(self, lay: Layout, seed: int):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(lay.n_rows, lay.seq_len, lay.d_model, generator=g)  # (n, T, d) float32
        self.hidden = h if lay.dtype == "float32" else h.to(getattr(torch, lay.dtype))
        self.stored = (self.hidden.view(torch.int16).numpy().view(np.uint16) if lay.dtype == "bfloat16"
                       else self.hidden.numpy())
        self.targets_t = torch.randint(50257, (lay.n_rows, lay.seq_len), generator=g, dtype=torch.int32)
        self.targets = self.targets_t.numpy()  # (n, T)
        self.nbytes = self.stored.nbytes + self.targets.nbytes


# -- the three paths: write(), read(ranges) -> last (hidden, targets) read, for the correctness check ----------
class Raw:
    def __init__(self, store: Store, lay: Layout, data: Data):
        self.store, self.lay, self.data, self.fs = store, lay, data, store.fs
        self.row_bytes = {"hidden": data.stored[0].nbytes, "targets": data.targets[0].nbytes}

    def _path(self, name: str, s: int) -> str:
        return self.store.path(f"{name}.{s}.bin")

    def write(self) -> None:
        if self.store.is_local:
            os.makedirs(self.store.root, exist_ok=True)
        for s in range(self.lay.n_shards):
            lo, hi = self.lay.shard(s)
            for name, arr in (("hidden", self.data.stored), ("targets", self.data.targets)):
                if self.store.is_local:
                    with open(self._path(name, s), "wb") as f:
                        f.write(arr[lo:hi].data)
                else:  # botocore takes bytes, not a memoryview: the copy zarr's FsspecStore makes too
                    self.fs.pipe_file(self._path(name, s), arr[lo:hi].tobytes())

    def _read(self, name: str, lo: int, hi: int, like: np.ndarray) -> np.ndarray:
        """Rows [lo, hi) of one array into a fresh array: one ranged read per shard the range touches."""
        out = np.empty((hi - lo, *like.shape[1:]), like.dtype)
        rb, row = self.row_bytes[name], lo
        while row < hi:
            s = row // self.lay.shard_rows
            a, b = row - s * self.lay.shard_rows, min(hi, (s + 1) * self.lay.shard_rows) - s * self.lay.shard_rows
            dst = out[row - lo:row - lo + b - a]  # rows [a, b) of shard s
            if self.store.is_local:
                with open(self._path(name, s), "rb") as f:
                    f.seek(a * rb)
                    f.readinto(memoryview(dst).cast("B"))
            else:
                dst[...] = np.frombuffer(self.fs.cat_file(self._path(name, s), start=a * rb, end=b * rb),
                                         like.dtype).reshape(dst.shape)
            row += b - a
        return out

    def read(self, ranges) -> tuple:
        for lo, hi in ranges:
            out = self._read("hidden", lo, hi, self.data.stored), self._read("targets", lo, hi, self.data.targets)
        return out


class ZarrProduct:
    def __init__(self, store: Store, lay: Layout, data: Data):
        self.store, self.lay, self.data = store, lay, data

    def write(self) -> None:
        lay = self.lay
        create_group(self.store, "acts", n_rows=lay.n_rows, seq_len=lay.seq_len, d_model=lay.d_model,
                     shard_rows=lay.shard_rows, dtype=lay.dtype, compression=lay.compression)
        for s in range(lay.n_shards):
            lo, hi = lay.shard(s)
            write_shard(self.store, "acts", s, self.data.hidden[lo:hi], self.data.targets_t[lo:hi])

    def read(self, ranges) -> tuple:
        reader = ActivationReader(self.store, "acts")
        for lo, hi in ranges:
            out = reader.read(lo, hi)  # (B, T, d) float32, (B, T) long
        return out


class ZarrBare(ZarrProduct):
    def write(self) -> None:
        lay = self.lay
        create_group(self.store, "acts", n_rows=lay.n_rows, seq_len=lay.seq_len, d_model=lay.d_model,
                     shard_rows=lay.shard_rows, dtype=lay.dtype, compression=lay.compression)
        group = zarr.open_group(self.store.zarr_store("acts"), mode="r+")
        h, t = group["hidden"], group["targets"]
        for s in range(lay.n_shards):
            lo, hi = lay.shard(s)
            h[lo:hi] = self.data.stored[lo:hi]
            t[lo:hi] = self.data.targets[lo:hi]

    def read(self, ranges) -> tuple:
        group = zarr.open_group(self.store.zarr_store("acts", read_only=True), mode="r")
        h, t = group["hidden"], group["targets"]
        for lo, hi in ranges:
            out = h[lo:hi], t[lo:hi]
        return out


IMPLS = {"raw": Raw, "zarr": ZarrProduct, "zarr-bare": ZarrBare}


# -- local-disk helpers -----------------------------------------------------------------------------------------
def drop_caches() -> bool:
    """Drop the clean page cache (root only) so the next read comes from the disk. Files are fsynced first."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def check(out: tuple, data: Data, lo: int, hi: int) -> bool:
    h, y = (np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x) for x in out)
    want = data.hidden[lo:hi].float().numpy() if h.dtype == np.float32 else data.stored[lo:hi]
    return bool(np.array_equal(h, want) and np.array_equal(y, data.targets[lo:hi]))


def run_path(name: str, store: Store, lay: Layout, data: Data, batch_rows: int, can_drop: bool) -> dict:
    """One repeat of one path: write, (flush), read in batches, read whole shards. Seconds per phase."""
    store.rm()
    impl = IMPLS[name](store, lay, data)
    t: dict = {}
    t0 = time.perf_counter()
    impl.write()
    t["write"] = time.perf_counter() - t0
    if store.is_local:
        t0 = time.perf_counter()
        fsync_tree(store.root)
        t["flush"] = time.perf_counter() - t0
    ok = True
    for phase, ranges in (("read_batch", lay.batches(batch_rows)),
                          ("read_shard", [lay.shard(s) for s in range(lay.n_shards)])):
        if store.is_local and can_drop:
            drop_caches()
        t0 = time.perf_counter()
        out = impl.read(ranges)
        t[phase] = time.perf_counter() - t0
        ok &= check(out, data, *ranges[-1])
    t["ok"] = ok
    store.rm()
    return t


def bench_medium(medium: str, stores: dict[str, Store], lay: Layout, data: Data, args, can_drop: bool) -> list[dict]:
    # warm-up, off the clock: imports, codec pipelines, connections (one small shard per path)
    warm_lay = Layout(min(lay.shard_rows, 8), lay.seq_len, lay.d_model, lay.shard_rows, lay.dtype, lay.compression)
    warm = Data(warm_lay, 1)
    for name in PATHS:
        run_path(name, stores[name], warm_lay, warm, min(args.batch_rows, warm_lay.n_rows), False)
    times: dict[str, list[dict]] = {n: [] for n in PATHS}
    for r in range(args.repeats):
        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]  # rotate: no path always runs first
        for name in order:
            times[name].append(run_path(name, stores[name], lay, data, args.batch_rows, can_drop))
    rows = []
    for name in PATHS:
        row = {"medium": medium, "path": name, "url": stores[name].url, "bytes": data.nbytes,
               "ok": all(t["ok"] for t in times[name])}
        for phase in ("write", "flush", "read_batch", "read_shard"):
            if phase not in times[name][0]:
                continue
            secs = [t[phase] for t in times[name]]
            row[f"{phase}_s"] = secs
            row[f"{phase}_s_median"] = statistics.median(secs)
            row[f"{phase}_s_min"] = min(secs)
        if "flush_s" in row:  # write then fsync of what it left, per repeat
            row["write_flush_s_median"] = statistics.median(w + f for w, f in zip(row["write_s"], row["flush_s"]))
        for phase in ("write", "write_flush", "read_batch", "read_shard"):
            if f"{phase}_s_median" in row:
                row[f"{phase}_MBps"] = data.nbytes / MB / row[f"{phase}_s_median"]
        rows.append(row)
    raw = rows[0]
    for row in rows:
        row["ratio_to_raw"] = {k[:-5]: row[k] / raw[k] for k in row if k.endswith("_MBps")}
    return rows


class S3Server:
    """moto's S3 on loopback, as tests/conftest.py::S3Server (a benchmark does not import the test harness)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer  # local: moto is a test dependency, needed only for S3

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()


# -- report ------------------------------------------------------------------------------------------------------
def machine(scratch: str) -> dict:
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    try:
        df = subprocess.run(["df", "-T", scratch], capture_output=True, text=True, check=True).stdout.split("\n")[1]
        dev, fstype = df.split()[:2]
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        dev = fstype = "unknown"
    mem_gb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gb": mem_gb, "loadavg_start": os.getloadavg(),
            "kernel": platform.release(), "python": platform.python_version(),
            "scratch_dir": scratch, "scratch_device": dev, "scratch_fs": fstype,
            "versions": {p: version(p) for p in ("zarr", "numpy", "torch", "fsspec", "s3fs", "moto")}}


def print_table(rows: list[dict]) -> None:
    def cell(row, phase):
        v = row.get(f"{phase}_MBps")
        return f"{'-':>9}{'':>7}" if v is None else f"{v:>9.0f}{row['ratio_to_raw'][phase]:>6.2f}x"

    head = (f"{'medium':<7}{'path':<11}{'write':>9}{'x raw':>7}{'w+flush':>9}{'x raw':>7}"
            f"{'read/batch':>11}{'x raw':>7}{'read/shard':>11}{'x raw':>7}  ok")
    print("MB/s (medians)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['medium']:<7}{r['path']:<11}{cell(r, 'write')}{cell(r, 'write_flush')}  {cell(r, 'read_batch')}"
              f"  {cell(r, 'read_shard')}  {'yes' if r['ok'] else 'NO'}")


def summarize(rows: list[dict]) -> dict:
    z = next(r for r in rows if r["medium"] == "local" and r["path"] == "zarr")
    ratios = dict(z["ratio_to_raw"])
    worst = min(("write", "read_batch", "read_shard"), key=lambda k: ratios[k])
    return {"target": TARGET, "zarr_local_ratios": ratios, "worst": worst, "worst_ratio": ratios[worst],
            "pass": all(ratios[k] >= TARGET for k in ("write", "read_batch", "read_shard"))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256, help="local data size, MB of float32 hidden states")
    ap.add_argument("--s3-mb", type=float, default=64, help="S3 data size (moto is slow), MB of float32 hidden")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--shard-rows", type=int, default=BcdSection.model_fields["shard_rows"].default)
    ap.add_argument("--batch-rows", type=int, default=32, help="rows per training read")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compression", default="none", choices=("none", "zstd"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=BcdSection.model_fields["store_concurrency"].default,
                    help="zarr async.concurrency (the run config's bcd.store_concurrency)")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-drop-caches", action="store_true", help="leave the page cache alone between phases")
    ap.add_argument("--dir", help="scratch directory on the disk to test (default: a temp dir beside the repo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/out/store_throughput.json")
    args = ap.parse_args(argv)
    zarr.config.set({"async.concurrency": args.concurrency})

    row_f32 = args.seq_len * args.d_model * 4

    def layout(mb: float) -> Layout:
        return Layout(max(1, round(mb * MB / row_f32)), args.seq_len, args.d_model, args.shard_rows, args.dtype,
                      args.compression)

    scratch = tempfile.mkdtemp(prefix="bcdflow-store-bench-", dir=args.dir or REPO.parent)
    info = machine(scratch)
    can_drop = not args.no_drop_caches and drop_caches()
    info["page_cache_dropped"] = can_drop
    notes = [f"local scratch {scratch} ({info['scratch_fs']} on {info['scratch_device']}); "
             + ("page cache dropped before each local read phase" if can_drop else
                "page cache NOT dropped: local reads may come from memory (alike for every path)"),
             "local writes are not fsynced (as zarr's LocalStore); w+flush adds fsync of the written files"]
    rows: list[dict] = []
    layouts: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        lay = layout(args.mb)
        data = Data(lay, args.seed)
        layouts["local"] = {**asdict(lay), "n_shards": lay.n_shards, "stored_bytes": data.nbytes}
        print(f"local: {lay.n_rows} rows x {lay.seq_len} x {lay.d_model} {lay.dtype} ({data.nbytes / MB:.0f} MB "
              f"stored), {lay.n_shards} shards of {lay.shard_rows} rows, compression {lay.compression}, "
              f"batches of {args.batch_rows} rows; {info['scratch_fs']} at {scratch}; "
              f"page cache {'dropped' if can_drop else 'NOT dropped'} before reads; {args.repeats} repeats")
        stores = {n: Store(os.path.join(scratch, n)) for n in PATHS}
        rows += bench_medium("local", stores, lay, data, args, can_drop)
        del data
        if not args.no_s3:
            os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1")
            lay = layout(args.s3_mb)
            data = Data(lay, args.seed)
            layouts["s3"] = {**asdict(lay), "n_shards": lay.n_shards, "stored_bytes": data.nbytes}
            print(f"s3: moto in-process, {lay.n_rows} rows ({data.nbytes / MB:.0f} MB stored, --s3-mb), "
                  f"{lay.n_shards} shards, async.concurrency {args.concurrency}")
            notes.append(f"S3 moves {data.nbytes / MB:.0f} MB stored (--s3-mb {args.s3_mb:g} MB of float32), not --mb: "
                         "moto is slow and serves from this process; S3 ratios compare S3 paths only")
            with S3Server() as srv:
                opts = {"endpoint_url": srv.endpoint}
                Store("s3://bench", opts).fs.mkdir("bench")
                stores = {n: Store(f"s3://bench/{n}", opts) for n in PATHS}
                rows += bench_medium("s3", stores, lay, data, args, False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()

    summary = summarize(rows)
    print_table(rows)
    print(f"zarr / raw on local disk: write {summary['zarr_local_ratios']['write']:.2f}, "
          f"read/batch {summary['zarr_local_ratios']['read_batch']:.2f}, "
          f"read/shard {summary['zarr_local_ratios']['read_shard']:.2f} (target >= {TARGET:.2f} each): "
          f"{'PASS' if summary['pass'] else 'MISS (worst: ' + summary['worst'] + ')'}")
    for n in notes:
        print("note: " + n)
    result = {"machine": info, "args": vars(args), "argv": sys.argv, "layouts": layouts, "notes": notes,
              "results": rows, "summary": summary, "wall_s": time.perf_counter() - t_start}
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
