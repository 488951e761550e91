"""Does the CPU worker slow the thread that launches the GPU work? Forward+backward of a GPT
(default GPT-2 1.5B, bf16, batch 4 x 1024) timed alone and while an offloadopt worker runs the
CPU kernel over a whole model's worth of offloaded state (bf16-sr masters, int8 moments, one
call after another), with the worker's cores chosen three ways:

  idle          no update running (the baseline, measured before and after the others)
  chosen        worker_cpus=None: this process's CPUs less the training thread's core
  chosen+upd    the same CPUs, the kernel on the worker's update thread (threads - 1 in its
                pool, the worker's own thread idle beside it: a GPU's buckets run this way)
  last left     the worker pinned to all CPUs but the last one
  unpinned      worker_cpus="any", one thread fewer than the cores (the choice before)
  all cores     worker_cpus="any", one thread per core

Each row: the median forward+backward ms over --iters iterations after --warmup, the ratio to
idle, and the worker's kernel calls per second meanwhile (how much update work it got done).
Needs CUDA. Prints a table; --out writes JSON.

Answer (2026-12-06): see benchmarks/results/2026-12-06-cpu-kernel-bus/notes.md.
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
from offloadopt.link.worker import CpuPlan, Worker, plan_cpus, usable_cpus


def fwd_bwd_ms(model, x, y, iters: int, warmup: int) -> float:
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def update_state(n: int, tensors: int = 16):
    """A model's worth of offloaded state, bf16-sr masters and int8 moments, and its grads."""
    per = n // tensors
    mk = lambda dt: [torch.zeros(per, dtype=dt) for _ in range(tensors)]  # noqa: E731
    p, g = mk(torch.bfloat16), mk(torch.bfloat16)
    for a, b in zip(p, g, strict=True):  # values do not change the kernel's time (no subnormals)
        a.fill_(0.5)
        b.fill_(1e-3)
    m, v = mk(torch.uint8), mk(torch.uint8)
    sm = [torch.zeros(kernels.nblocks(per)) for _ in range(tensors)]
    sv = [torch.zeros(kernels.nblocks(per)) for _ in range(tensors)]
    return p, g, m, v, sm, sv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-xl")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))
        y = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))
    n = sum(p.numel() for p in model.parameters())
    state = update_state(n)
    mod = kernels.load()
    t = len(state[0])
    cores = torch.get_num_threads()
    rows = [("idle", None)]
    mine = usable_cpus() or list(range(cores))
    plans = {"chosen": plan_cpus(None, None, training_thread_busy=True),
             "chosen+upd": plan_cpus(None, None, training_thread_busy=True),
             "last left": CpuPlan(mine[:-1], len(mine) - 1, mine[-1:]),
             "unpinned": plan_cpus("any", cores - 1, training_thread_busy=True),
             "all cores": plan_cpus("any", cores, training_thread_busy=True)}  # fmt: skip
    rows += list(plans.items()) + [("idle again", None)]
    results = []
    for name, plan in rows:
        calls = 0
        worker = stop = None
        if plan is not None:
            worker = Worker(plan.threads, flush_denormal=True, cpus=plan.cpus,
                            overlap=name == "chosen+upd")  # fmt: skip
            stop = threading.Event()

            def loop(stop: threading.Event = stop) -> None:
                nonlocal calls
                while not stop.is_set():
                    mod.adam_step(*state, [], [10.0] * t, list(range(t)), [0] * t, 1e-4, 0.9,
                                  0.95, 0.1, 1e-8, False, True, None, 2, True,
                                  kernels.torch_vec_size(), True)  # fmt: skip
                    calls += 1

            if worker.overlap:  # on the update thread, as the step's updates run
                job = worker.submit(lambda w=worker, f=loop: w.run_update(f, "c").result(), "c")
            else:
                job = worker.submit(loop, "contention")
            time.sleep(1.0)  # the loop is running
        start = time.perf_counter()
        ms = fwd_bwd_ms(model, x, y, args.iters, args.warmup)
        elapsed = time.perf_counter() - start
        if worker is not None:
            stop.set()
            job.wait(600)
            worker.close()
        results.append({"row": name, "fwd_bwd_ms": ms, "worker": plan.describe() if plan else "",
                        "kernel_calls_per_s": calls / elapsed})  # fmt: skip
    base = statistics.mean(r["fwd_bwd_ms"] for r in results if r["row"].startswith("idle"))
    print(f"{args.preset}, batch {args.batch_size} x {args.seq_len}, {n / 1e9:.3f}e9 params, "
          f"{cores} cores, {torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    print(f"{'row':<12} {'fwd+bwd ms':>10} {'vs idle':>8} {'updates/s':>9}  worker")
    for r in results:
        r["vs_idle"] = r["fwd_bwd_ms"] / base
        print(f"{r['row']:<12} {r['fwd_bwd_ms']:>10.1f} {r['vs_idle']:>7.3f}x "
              f"{r['kernel_calls_per_s']:>9.2f}  {r['worker']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
