"""Repack a bitsandbytes wheel for the GPU machine (benchmarks/gpu/wheels.sh): its Python package and only the native
libraries named, the rest (the other CUDA versions', ROCm's, XPU's: 41 of its 43 MB) left out; RECORD rewritten for
what is kept (sha256 and size of each file), so the result is a valid wheel pip installs as any other.

    python3 benchmarks/gpu/trim_wheel.py IN.whl OUT_DIR cpu cuda128 cuda130

Keeps ``bitsandbytes/libbitsandbytes_{name}.so`` for each name given. bitsandbytes loads the library of the CUDA
torch was built with, else the highest one below it of the same major version, else the lowest above it
(bitsandbytes/cextension.py): ``cuda128`` serves CUDA 12.8 and 12.9, ``cuda130`` every 13.x. Writes OUT_DIR/<the same
file name> and prints its size.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import zipfile
from pathlib import Path


def trim(src: Path, dest_dir: Path, keep: list[str]) -> Path:
    dest = dest_dir / src.name
    lib = re.compile(r"^bitsandbytes/libbitsandbytes_(\w+)\.(so|dll|dylib)$")
    with zipfile.ZipFile(src) as zin:
        names = [n for n in zin.namelist() if not (m := lib.match(n)) or m.group(1) in keep]
        found = {m.group(1) for n in names if (m := lib.match(n))}
        if missing := set(keep) - found:
            raise SystemExit(f"{src.name} has no libbitsandbytes_{sorted(missing)}: it holds "
                             f"{sorted(m.group(1) for n in zin.namelist() if (m := lib.match(n)))}")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        tmp = dest.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for n in names:
                if n == record:
                    continue
                data = zin.read(n)
                info = zin.getinfo(n)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append((n, f"sha256={digest}", str(len(data))))
            rows.append((record, "", ""))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            zout.writestr(zin.getinfo(record), buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(dest)
    return dest


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dest_dir, keep = Path(argv[0]), Path(argv[1]), argv[2:]
    out = trim(src, dest_dir, keep)
    print(f"{out.name}: {src.stat().st_size / 2**20:.1f} MiB -> {out.stat().st_size / 2**20:.1f} MiB "
          f"(kept libbitsandbytes_{{{','.join(keep)}}})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
