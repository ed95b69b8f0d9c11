"""Peak host memory while converting a sharded Hugging Face checkpoint into a run's version 0
(``core.hf_import.write_version0``, what ``init_run`` does for ``model.from_hf``), against the largest block and the
whole model.

1. Writes a random LLaMA checkpoint (default: Llama-3.2-1B's shape, 1.24B parameters, bf16) as ``--shards``
   safetensors files plus ``model.safetensors.index.json`` and ``config.json``. Each file is written header first,
   then tensor by tensor, each tensor generated in chunks: the whole model is never in memory.
2. Converts it in a child process that does nothing else: open the checkpoint, plan ``--blocks`` blocks (split by
   parameters, the run default), ``write_version0`` into a local store. The child samples its own RSS every 2 ms
   (psutil) and reports the kernel's high-water mark (``ru_maxrss``: resident pages, the mapped checkpoint pages
   it touched included) and its RSS just before converting (Python, torch, safetensors imported).

Target (issue): peak RSS below 1.5 x the largest block's bytes (as stored: the checkpoint's dtype), not the whole
model. A miss prints MISS; the exit status stays 0 (docs/CONVENTIONS.md 10).

    python benchmarks/hf_convert.py                          # 1.24B params bf16, 3 blocks: ~3 minutes on 2 cores
    python benchmarks/hf_convert.py --layers 4 --dtype float32 --blocks 2 --dir /mnt/scratch
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from bcdflow.core import hf_import
from bcdflow.models import hf_names as hfmap
from bcdflow.models import model_plan
from bcdflow.models.build import param_shapes
from bcdflow.models.model_config import ModelConfig, RopeScaling
from bcdflow.models.hf_names import config_from_hf
from bcdflow.storage.hf_checkpoint import Checkpoint
from bcdflow.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks.report, when run as a script

MB = 1 << 20
TARGET = 1.5
ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def llama_config(args):
    return ModelConfig(family="llama", n_layer=args.layers, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192,
                       n_ctx=131072, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, tie_embeddings=True,
                       bias=False, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192))


def write_checkpoint(directory: str, args) -> dict:
    """Random weights under HF names in ``args.shards`` files, streamed tensor by tensor."""
    mcfg = llama_config(args)
    dtype = hfmap.DTYPES[args.dtype]
    tensors = [(hfmap.hf_name(mcfg, n), hfmap.hf_shape(mcfg, n, s)) for n, s in param_shapes(mcfg).items()]
    nbytes = [torch.Size(s).numel() * dtype.itemsize for _, s in tensors]
    total, per_shard = sum(nbytes), -(-sum(nbytes) // args.shards)
    shards: list[list[int]] = [[]]
    acc = 0
    for i, b in enumerate(nbytes):  # consecutive tensors, about total/shards bytes per file
        if acc >= per_shard * len(shards) and len(shards) < args.shards:
            shards.append([])
        shards[-1].append(i)
        acc += b
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, idx in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for i in idx:
            header[tensors[i][0]] = {"dtype": ST_DTYPE[args.dtype], "shape": list(tensors[i][1]),
                                     "data_offsets": [off, off + nbytes[i]]}
            off += nbytes[i]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for i in idx:
                flat = torch.Size(tensors[i][1]).numel()
                for lo in range(0, flat, 1 << 24):  # 16M elements at a time
                    n = min(1 << 24, flat - lo)
                    chunk = (torch.randn(n, generator=g) * 0.02).to(dtype)
                    f.write(chunk.view(torch.uint8).numpy().tobytes() if dtype == torch.bfloat16
                            else chunk.numpy().tobytes())
                weight_map[tensors[i][0]] = name
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hfmap.config_to_hf(mcfg, "LlamaForCausalLM", args.dtype), f, indent=2)
    return {"n_params": sum(torch.Size(s).numel() for _, s in tensors), "bytes": total, "shards": len(shards)}


def convert(ckpt: str, store_dir: str, blocks: int) -> dict:
    """The child: the product's conversion, nothing else, with its memory sampled."""
    proc = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    ck = Checkpoint.open(ckpt)
    mcfg = config_from_hf(ck.config)
    plan = model_plan(mcfg, blocks)
    store = Store(store_dir)
    baseline = proc.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    entries = hf_import.write_version0(store, "bench", ck, mcfg, plan)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    return {"baseline_rss": baseline, "peak_rss_sampled": peak[0],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "block_bytes": [entries[b]["bytes"] for b in sorted(entries)],
            "block_layers": [list(b.layers) for b in plan.blocks], "seconds": seconds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 = Llama-3.2-1B)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(ST_DTYPE))
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=3, help="BCD blocks (bcd.blocks), split by parameters")
    ap.add_argument("--dir", help="scratch directory (default: a temp dir beside the repository)")
    ap.add_argument("--out", default="benchmarks/out/hf_convert.json")
    ap.add_argument("--convert", nargs=3, metavar=("CKPT", "STORE", "BLOCKS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.convert:  # the child
        print(json.dumps(convert(args.convert[0], args.convert[1], int(args.convert[2]))))
        return {}
    # not at the top: the --convert child runs this file too, and its RSS is the measurement (report loads matplotlib)
    from benchmarks import report

    scratch = tempfile.mkdtemp(prefix="bcdflow-hf-bench-", dir=args.dir or REPO.parent)
    t_start = time.perf_counter()
    try:
        ckpt = os.path.join(scratch, "ckpt")
        os.makedirs(ckpt)
        t0 = time.perf_counter()
        written = write_checkpoint(ckpt, args)
        print(f"checkpoint: {written['n_params'] / 1e9:.2f}B parameters, {args.dtype}, {written['bytes'] / MB:.0f} MB "
              f"in {written['shards']} shards ({time.perf_counter() - t0:.0f} s to write)")
        proc = subprocess.run([sys.executable, __file__, "--convert", ckpt, os.path.join(scratch, "store"),
                               str(args.blocks)], capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"conversion failed:\n{proc.stderr}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    largest, whole = max(child["block_bytes"]), sum(child["block_bytes"])
    peak = max(child["ru_maxrss"], child["peak_rss_sampled"])
    rows = [("baseline RSS (imports, before converting)", child["baseline_rss"]),
            ("peak RSS while converting (ru_maxrss)", child["ru_maxrss"]),
            ("peak RSS, sampled every 2 ms", child["peak_rss_sampled"]),
            ("largest block as stored", largest), ("whole model as stored", whole)]
    print(f"\nconverted into {args.blocks} blocks (layers {child['block_layers']}) in {child['seconds']:.1f} s")
    print(f"{'':44} {'MB':>9}")
    for label, v in rows:
        print(f"{label:44} {v / MB:>9.0f}")
    ratio_block, ratio_model = peak / largest, peak / whole
    ok = ratio_block < TARGET
    print(f"peak / largest block {ratio_block:.2f} (target < {TARGET}): {'PASS' if ok else 'MISS'}; "
          f"peak / whole model {ratio_model:.2f}; peak above baseline / largest block "
          f"{(peak - child['baseline_rss']) / largest:.2f}")
    result = {"args": {k: v for k, v in vars(args).items() if k != "convert"}, "argv": sys.argv,
              "checkpoint": written, "conversion": child, "peak_rss": peak, "largest_block_bytes": largest,
              "model_bytes": whole, "peak_over_block": ratio_block, "peak_over_model": ratio_model,
              "target": TARGET, "pass": ok, "wall_s": time.perf_counter() - t_start}
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
