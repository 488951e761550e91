"""Why the CPU update runs slower inside a step than in the probe: torch's fused AdamW on an
offloadopt worker over the same number of fp32 elements, laid out and allocated in the ways
the optimizer and the probe do, one variant at a time.

Variants (interleaved, each a median over ``--reps`` rounds after one warm-up, ms and
ns/param):
  flat-randn      one tensor per operand from torch.randn/zeros (the probe's layout)
  flat-arena      (without CUDA) one tensor per operand from torch.empty, filled by a copy
  flat-pinned     as flat-arena, the master and the grad page-locked with cudaHostRegister
                  (with CUDA; the views and buckets below use this memory)
  views           the same pinned memory as a list of GPT-2 1.5B-shaped views, one call
  buckets         those views in calls of --bucket-mib of fp32 master each (the worker's calls)
  buckets-flat    each bucket's contiguous run as one flat view (one parallel region a bucket)

Run it twice, with and without ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator then aligns
allocations of 2 MiB or more to 2 MiB and asks for transparent huge pages), to see what huge
pages are worth. Prints a table; ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from offloadopt.link.host import _pin
from offloadopt.link.worker import Worker, usable_cores

BLOCK = [(1600,), (1600,), (1600, 4800), (4800,), (1600, 1600), (1600,), (1600,), (1600,),
         (1600, 6400), (6400,), (6400, 1600), (1600,)]  # fmt: skip


def shapes(blocks: int) -> list[tuple[int, ...]]:
    return [s for _ in range(blocks) for s in BLOCK]


def numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=12, help="GPT-2 1.5B blocks (30.7M params each)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="*", default=None)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shp = shapes(args.blocks)
    sizes = [numel(s) for s in shp]
    n = sum(sizes)
    step = torch.zeros(())
    res: dict = {"params": n, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""), "rows": []}

    def fused(ws, gs, ms, vs) -> None:
        torch._fused_adamw_(ws, gs, ms, vs, [], [step] * len(ws), amsgrad=False, lr=1e-4,
                            beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip

    def arena() -> list[torch.Tensor]:
        src = torch.randn(n)
        out = []
        for _ in range(4):
            t = torch.empty(n)
            t.copy_(src)
            out.append(t)
        out[2].mul_(0.01)
        out[3].abs_().mul_(1e-4)
        return out

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        out, o = [], 0
        for s, k in zip(shp, sizes, strict=True):
            out.append(flat[o : o + k].view(s))
            o += k
        return out

    def bucket_bounds() -> list[tuple[int, int]]:
        cap = args.bucket_mib * 2**20 // 4
        bounds, start, count, total = [], 0, 0, 0
        for i, k in enumerate(sizes):
            if count and total + k > cap:
                bounds.append((start, i))
                start, total = i, 0
            total += k
            count = i - start + 1
        bounds.append((start, len(sizes)))
        return bounds

    offsets = [0]
    for k in sizes:
        offsets.append(offsets[-1] + k)

    for threads in args.threads or [usable_cores() - 1, usable_cores()]:
        worker = Worker(threads, flush_denormal=True)
        t = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
        a = arena()
        pinned = torch.cuda.is_available()
        if pinned:
            _pin(a[0], "master")
            _pin(a[1], "grad")
        vs = [views(x) for x in a]
        bb = bucket_bounds()

        def buckets(vs=vs, bb=bb) -> None:
            for i, j in bb:
                fused(*[v[i:j] for v in vs])

        def buckets_flat(a=a, bb=bb) -> None:
            for i, j in bb:
                fused(*[[x[offsets[i] : offsets[j]]] for x in a])

        variants = {
            "flat-randn": lambda t=t: fused(*[[x] for x in t]),
            "flat-" + ("pinned" if pinned else "arena"): lambda a=a: fused(*[[x] for x in a]),
            "views": lambda vs=vs: fused(*vs),
            f"buckets({len(bb)})": buckets,
            "buckets-flat": buckets_flat,
        }
        # Interleaved: each round times every variant once, so drift hits them alike.
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.reps + 1):
            for name, fn in variants.items():
                got: dict[str, float] = {}

                def run(fn=fn, got=got) -> None:
                    t0 = time.perf_counter()
                    fn()
                    got["ms"] = (time.perf_counter() - t0) * 1e3

                worker.submit(run, "probe").wait(600)
                times[name].append(got["ms"])
        for name, ts in times.items():
            ms = statistics.median(ts[1:])
            r = {"threads": threads, "variant": name, "ms": ms, "ns_per_param": ms * 1e6 / n,
                 "min_ms": min(ts[1:]), "max_ms": max(ts[1:])}  # fmt: skip
            res["rows"].append(r)
            print(f"threads {threads:2d}  {name:14s} {ms:8.1f} ms ({r['min_ms']:.1f}-{r['max_ms']:.1f})  "
                  f"{r['ns_per_param']:.4f} ns/param", flush=True)  # fmt: skip
        if pinned:
            for x in a[:2]:
                torch.cuda.cudart().cudaHostUnregister(x.data_ptr())
        del a, vs, t, variants, buckets, buckets_flat
        worker.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
