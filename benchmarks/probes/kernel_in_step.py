"""Why does the compressed CPU update run about 2x slower inside a training step than alone
(GPT-2 1.5B, bf16-sr masters + int8 moments, backward mode: 229 ms of worker time in the step
against 116 ms for the same kernel over the same params alone)? One candidate at a time, the
same kernel over the same state (1.558e9 params by default, GPT-2 1.5B's shapes):

  alone, one call       one call over every tensor on the main thread (benchmarks/cpu_kernel.py)
  worker, buckets       on an offloadopt worker (15 threads, the training thread's core left),
                        in calls of --bucket-mib of master each, as the step makes them
  + DMA                 the same while two side streams copy pinned host memory to and from the
                        GPU without pause (the step's link traffic, both directions at once)
  + fwd/bwd             the same while the main thread runs GPT-2 1.5B's forward+backward
                        (batch 4 x 1024) in a loop: launches, autograd, the GIL
  + GIL hog             the same while the main thread spins in Python (the GIL alone)
and, to tell the candidates apart: the buckets on the main thread (16 threads, unpinned), in
calls 4x larger, one call on the worker, a worker of 16 unpinned threads, and the one call over
pageable copies of the masters and grads (the pinned ones are page-locked by CUDA).

Each row: the worker's wall ms for the whole update (sum of its calls), the kernel's own ms
(``kernels.kernel_ms``: inside its parallel regions, no GIL), and their ratio to "alone". The
state holds real values: moments from --warm-steps earlier updates with N(0, 1e-3) grads.
Needs CUDA. Prints a table; --out writes JSON.

Answer (2026-12-06, cedc1b9, two H100 machines): not the GIL, the buckets or the worker. 92-94%
of the worker's update time in the step is inside the kernel; the same work took 149-327 ms
from row to row and call to call on the shared host (the 116 ms "alone" was a good moment),
and the link's DMA slows it 1.2-2.0x when flat out. benchmarks/results/
2026-12-06-kernel-in-step-h100/notes.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from offloadopt import kernels
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.link.worker import Worker, plan_cpus

BF16, U8 = torch.bfloat16, torch.uint8


def normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std) draws, a block of 2**20 tiled (torch's CPU sampler is serial: minutes here)."""
    block = torch.randn(min(t.numel(), 2**20)).mul_(std).to(t.dtype)
    full = t.numel() // block.numel() * block.numel()
    t[:full].view(-1, block.numel()).copy_(block.expand(full // block.numel(), -1))
    t[full:].copy_(block[: t.numel() - full])
    return t


def state_for(sizes: list[int], pinned: bool):
    pin = dict(pin_memory=True) if pinned else {}
    p = [normal_(torch.empty(n, dtype=BF16, **pin), 0.02) for n in sizes]
    g = [torch.empty(n, dtype=BF16, **pin) for n in sizes]
    m = [torch.zeros(n, dtype=U8) for n in sizes]
    v = [torch.zeros(n, dtype=U8) for n in sizes]
    sm = [torch.zeros(kernels.nblocks(n)) for n in sizes]
    sv = [torch.zeros(kernels.nblocks(n)) for n in sizes]
    return p, g, m, v, sm, sv


def buckets(sizes: list[int], mib: int) -> list[list[int]]:
    cap, out, cur, total = mib * 2**20 // 2, [], [], 0
    for i, n in enumerate(sizes):
        if cur and total + n > cap:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    return out + [cur]


def call(mod, st, idx: list[int], step: float) -> None:
    pick = [[c[i] for i in idx] for c in st]
    mod.adam_step(*pick, [], [step] * len(idx), idx, [0] * len(idx), 1e-4, 0.9, 0.95, 0.1,
                  1e-8, False, True, None, 2, True, kernels.torch_vec_size(), True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=48, help="GPT-2 1.5B has 48")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = PRESETS["gpt2-xl"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(BF16)
        x = torch.randint(0, cfg.vocab_size, (4, 1024))
    shapes = [p.numel() for p in model.parameters()]
    per_block = len(shapes) // cfg.n_layer
    sizes = shapes[: 2 + per_block * args.blocks] if args.blocks < cfg.n_layer else shapes
    n = sum(sizes)
    mod = kernels.load()
    st = state_for(sizes, pinned=True)
    for s in range(args.warm_steps):  # real moments and scales
        for gr in st[1]:
            normal_(gr, 1e-3 * (s + 1))
        call(mod, st, list(range(len(sizes))), float(s + 1))
    plan = plan_cpus(None, None, training_thread_busy=True)
    worker = Worker(plan.threads, flush_denormal=True, cpus=plan.cpus)
    groups = buckets(sizes, args.bucket_mib)

    whole = [list(range(len(sizes)))]
    big = buckets(sizes, 4 * args.bucket_mib)
    unpinned = plan_cpus("any", torch.get_num_threads(), training_thread_busy=False)
    any_worker = Worker(unpinned.threads, flush_denormal=True, cpus=unpinned.cpus)

    def calls(calls: list[list[int]], state=st) -> tuple[float, float]:
        t, k = time.perf_counter(), kernels.kernel_ms()
        for idx in calls:
            call(mod, state, idx, 10.0)
        return (time.perf_counter() - t) * 1e3, kernels.kernel_ms() - k

    def on_worker(calls_: list[list[int]] = groups, on: Worker = worker) -> tuple[float, float]:
        box = {}

        def run() -> None:
            box["got"] = calls(calls_)

        on.submit(run, "probe").wait(600)
        return box["got"]

    def alone() -> tuple[float, float]:
        return calls(whole)

    pageable = None

    def alone_pageable() -> tuple[float, float]:
        nonlocal pageable
        if pageable is None:  # masters and grads copied to pageable memory, moments shared
            pageable = ([t.clone() for t in st[0]], [t.clone() for t in st[1]], *st[2:])
        return calls(whole, pageable)

    def with_background(body) -> tuple[float, float]:
        stop = threading.Event()
        bg = threading.Thread(target=body, args=(stop,), daemon=True)
        bg.start()
        time.sleep(0.5)
        try:
            return on_worker()
        finally:
            stop.set()
            bg.join()

    def dma(stop: threading.Event) -> None:
        nbytes = 256 * 2**20
        host_in = torch.empty(nbytes, dtype=U8, pin_memory=True)
        host_out = torch.empty(nbytes, dtype=U8, pin_memory=True)
        dev_a = torch.empty(nbytes, dtype=U8, device="cuda")
        dev_b = torch.empty(nbytes, dtype=U8, device="cuda")
        up, down = torch.cuda.Stream(), torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(up):
                dev_a.copy_(host_in, non_blocking=True)
            with torch.cuda.stream(down):
                host_out.copy_(dev_b, non_blocking=True)
            up.synchronize()
            down.synchronize()

    def fwd_bwd(stop: threading.Event) -> None:
        while not stop.is_set():
            model(x, x)[1].backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()

    def hog(stop: threading.Event) -> None:
        k = 0
        while not stop.is_set():
            k += 1

    rows = {"alone, one call": alone, "main, buckets": lambda: calls(groups),
            f"main, {4 * args.bucket_mib} MiB": lambda: calls(big),
            "alone, pageable": alone_pageable, "worker, one call": lambda: on_worker(whole),
            "worker, buckets": on_worker, f"worker, {4 * args.bucket_mib} MiB": lambda: on_worker(big),
            "worker any, buckets": lambda: on_worker(groups, any_worker),
            "+ DMA": lambda: with_background(dma), "+ fwd/bwd": lambda: with_background(fwd_bwd),
            "+ GIL hog": lambda: with_background(hog)}  # fmt: skip
    results = {}
    for name, fn in rows.items():
        fn()  # warm-up
        got = [fn() for _ in range(args.repeats)]
        results[name] = {"wall_ms": statistics.median(w for w, _ in got),
                         "kernel_ms": statistics.median(k for _, k in got)}  # fmt: skip
    worker.close()
    any_worker.close()
    base = results["alone, one call"]["wall_ms"]
    print(f"bf16-sr + int8, {n / 1e9:.3f}e9 params in {len(sizes)} tensors, {len(groups)} calls "
          f"of {args.bucket_mib} MiB on the worker ({plan.describe()}), "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    print(f"{'row':<22} {'wall ms':>8} {'kernel ms':>9} {'vs alone':>8}")
    for name, r in results.items():
        print(
            f"{name:<22} {r['wall_ms']:>8.1f} {r['kernel_ms']:>9.1f} {r['wall_ms'] / base:>7.2f}x"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"params": n, "calls": len(groups), "rows": results}, fh, indent=1)


if __name__ == "__main__":
    main()
