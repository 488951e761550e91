"""What one bucket's copy launches cost the worker, piece by piece (GPU host).

The worker queues each bucket's D2H (upcast, copy to pinned staging) and H2D (copy of the
master, downcast into the params) between its CPU kernel calls, so every microsecond of
launching is a microsecond the CPU pass waits (``opt.stats["launch_ms"]``). This probe builds
HybridAdamW at fraction 1 over a preset's model, runs two steps, then times, on an otherwise
idle process, the whole ``Transfer.start_d2h`` / ``start_h2d`` of one bucket and each call
they are made of, the older forms beside the kept ones (``torch.cuda.stream`` against the
transfer's own stream switch, views made per call against views kept per bucket, views of
every param segment against whole params taken as they are).

Usage (GPU host, repo root): python benchmarks/launch_probe.py --out $OUT
Prints microseconds per call (median of rounds); writes launch_probe.json under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from offloadopt import HybridAdamW
from offloadopt.harness import checks, models
from offloadopt.link.transfer import _OnStream


def per_call_us(fn, reps: int, rounds: int, sync_every: int = 25) -> float:
    """Median over ``rounds`` of the mean host time of ``fn()`` over ``reps`` calls (µs); the
    device is synchronized every ``sync_every`` calls, outside the timed calls, so that queued
    copies never fill the launch queue."""
    out = []
    for _ in range(rounds):
        total = 0.0
        for i in range(reps):
            if i % sync_every == 0:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            total += time.perf_counter() - t
        out.append(total / reps * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", type=checks.preset, default="gpt2-xl", help="a model preset")
    ap.add_argument("--reps", type=checks.positive_int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=checks.positive_int, default=5, help="rounds, >= 1")
    ap.add_argument("--out", type=checks.out_dir, default="launch-probe-out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device; torch sees none here")
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = models.build_model(args.preset, device, torch.bfloat16)
    opt = HybridAdamW(model.parameters(), lr=1e-4, offload_fraction=1.0)
    x = torch.randint(0, model.cfg.vocab_size, (1, 256), device=device)
    loss_fn = models.loss_fn(args.preset)
    for _ in range(2):
        loss_fn(model, x, x).backward()
        opt.step()
    loss_fn(model, x, x).backward()  # grads to launch from
    b = opt.buckets[len(opt.buckets) // 2]
    tr = opt.debug.pipeline.transfers[b.arena.device]
    slot = tr.ring.slots[0]
    idx = list(range(len(b.segments)))
    grads = b.grad_views(idx)
    ready = torch.cuda.current_stream().record_event()
    n = b.nbytes

    def views_per_call():
        return [b.slot_views(slot.d2h)[i] for i in idx]

    plan = tr._plan(b, slot)

    def timed_event():
        return tr.d2h.record_event(torch.cuda.Event(enable_timing=True))

    def record_streams():
        for g in grads:
            g.record_stream(tr.d2h)

    def context_stream():
        with torch.cuda.stream(tr.d2h):
            pass

    def own_stream():
        with _OnStream(tr.d2h):
            pass

    def upcast():
        with _OnStream(tr.d2h):
            torch._foreach_copy_(plan.d2h_views, grads)

    def d2h_copy():
        with _OnStream(tr.d2h):
            plan.host_flat.copy_(plan.d2h_flat, non_blocking=True)

    def d2h_copy_sliced():
        with _OnStream(tr.d2h):
            slot.host[:n].copy_(slot.d2h[:n], non_blocking=True)

    def h2d_copy():
        with _OnStream(tr.h2d):
            plan.h2d_flat.copy_(plan.master_bytes, non_blocking=True)

    def downcast():
        with _OnStream(tr.h2d):
            torch._foreach_copy_(*tr._h2d_pairs(b, plan.h2d_views, plan.shaped, idx))

    def start_d2h():
        tr.start_d2h(b, idx, grads, slot, ready)

    def start_h2d():
        tr.start_h2d(b, idx, slot, ready)

    tr.collect_link()  # the copies' events, dropped once done
    probes = {
        "start_d2h (whole)": start_d2h,
        "start_h2d (whole)": start_h2d,
        "torch.cuda.stream(s) enter+exit": context_stream,
        "transfer's stream switch enter+exit": own_stream,
        "Event(enable_timing) + record": timed_event,
        "stream.wait_event": lambda: tr.d2h.wait_event(ready),
        f"record_stream x{len(grads)} grads": record_streams,
        "slot views made per call": views_per_call,
        "param_views made per call": b.param_views,
        "H2D operands, whole params taken as they are": lambda: tr._h2d_pairs(
            b, plan.h2d_views, plan.shaped, idx
        ),
        f"upcast _foreach_copy_ ({len(idx)} segments)": upcast,
        "D2H copy_ (kept slices)": d2h_copy,
        "D2H copy_ (slices per call)": d2h_copy_sliced,
        "H2D copy_": h2d_copy,
        f"downcast _foreach_copy_ ({len(idx)} segments)": downcast,
    }
    rows = {}
    with torch.no_grad():  # as on the worker: the H2D's downcast writes the params in place
        for name, fn in probes.items():
            rows[name] = per_call_us(fn, args.reps, args.rounds)
            tr.collect_link()  # the copies' events, dropped once done
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"preset": args.preset, "bucket": b.label, "segments": len(b.segments),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}  # fmt: skip
    (out / "launch_probe.json").write_text(
        json.dumps({"meta": meta, "us_per_call": rows}, indent=1)
    )
    print(f"{meta['bucket']}, {meta['device']}, torch {meta['torch']}; µs per call, host time")
    for name, us in rows.items():
        print(f"  {us:8.1f}  {name}")
    opt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
