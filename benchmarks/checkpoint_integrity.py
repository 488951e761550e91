"""Save and load time of a streamed checkpoint with checksums against without (issue 44).

A CPU HybridAdamW over ``--params`` fp32 params (fp32 moments, everything offloaded) is saved
with ``opt.save_streamed(path, model=model)`` (12 bytes per param: weights and two moments)
and loaded into the same optimizer with ``opt.load_streamed``, ``--repeats`` times each way,
alternating:

- with checksums: as shipped (xxh3-64 of every file while it is written; on load a verify
  pass over every part, then each part mapped, hashed again and applied);
- without: ``fsync_save`` replaced by a plain ``torch.save`` + fsync, and
  ``integrity.verify`` by a no-op (the load's pass over the parts then only maps each one to
  check its shapes, then applies).

Reports medians in s and GB/s (GB = 1e9 bytes of the folder), and xxh3-64 / ``zlib.crc32``
alone over the same bytes in memory. ``--cold`` drops the page cache before each load (needs
root; skipped with a note otherwise). Example::

    python benchmarks/checkpoint_integrity.py --params 184e6 --dir /tmp/ck-bench \\
        --out benchmarks/results/2026-12-06-checkpoint-integrity-cpu/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import zlib

import torch
import xxhash

from offloadopt import HybridAdamW
from offloadopt.state import integrity, streamed


def plain_save(obj, path: str) -> integrity.Written:
    """The save before checksums: ``torch.save``, flushed to the disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
        return integrity.Written(f.tell(), "0" * 16)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def folder_nbytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=184e6, help="fp32 params (12 B each saved)")
    ap.add_argument("--numel", type=int, default=4096 * 4096, help="elements per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/offloadopt-ck-bench", help="where the checkpoint goes")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    n = max(1, round(args.params / args.numel))
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(args.numel)) for _ in range(n)])
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "ck")
    real_save, real_verify = streamed.fsync_save, integrity.verify
    cold = args.cold and drop_caches()
    rows: dict[str, list[float]] = {}
    nbytes = 0
    for _ in range(args.repeats):
        for mode in ("without", "with"):
            if mode == "without":
                streamed.fsync_save = plain_save
                integrity.verify = lambda *a, **k: True  # noqa: E731 - the no-op check
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            opt.save_streamed(path, model=model)
            rows.setdefault(f"save {mode}", []).append(time.perf_counter() - t)
            nbytes = folder_nbytes(path)
            if cold:
                drop_caches()
            t = time.perf_counter()
            opt.load_streamed(path, model=model)
            rows.setdefault(f"load {mode}", []).append(time.perf_counter() - t)
            streamed.fsync_save, integrity.verify = real_save, real_verify
    data = open(os.path.join(path, "part-00000.pt"), "rb").read()
    for name, fn in (("xxh3_64 in memory", xxhash.xxh3_64_intdigest), ("zlib.crc32 in memory",
                                                                       zlib.crc32)):  # fmt: skip
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn(data)
            ts.append(time.perf_counter() - t)
        rows[name] = [min(ts) * nbytes / len(data)]  # scaled to the whole folder
    out = {"params": n * args.numel, "folder_bytes": nbytes, "parts": len(os.listdir(path)) - 1,
           "cold_cache": cold, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "median_s": {k: statistics.median(v) for k, v in rows.items()},
           "runs_s": rows}  # fmt: skip
    out["gb_per_s"] = {k: nbytes / 1e9 / v for k, v in out["median_s"].items()}
    print(f"{n * args.numel / 1e6:.0f}M params, folder {nbytes / 1e9:.3f} GB in {out['parts']} "
          f"parts, page cache {'dropped before each load' if cold else 'warm'}")  # fmt: skip
    for k, v in out["median_s"].items():
        print(f"{k:24s} {v:8.3f} s {out['gb_per_s'][k]:8.2f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    opt.close()


if __name__ == "__main__":
    main()
