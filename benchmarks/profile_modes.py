"""Where the time of one training iteration goes, per overlap mode: torch.profiler over a few
steps of the bench's model and batches (offloadopt/harness/bench.py), printed as the phases'
wall times (forward+backward, step) and the top CUDA kernels and CPU ops of each mode.

    python benchmarks/profile_modes.py --configs step:0 backward:0 backward-clip:0 \
        backward-torch-clip:0 --out prof-out

Each config is ``MODE:FRACTION`` (a key of offloadopt.harness.anchors.MODES). Writes
``profile.json`` (the tables' numbers) under ``--out``; prints the tables.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from offloadopt import HybridAdamW
from offloadopt.harness import anchors, checks
from offloadopt.harness.bench import Bench, BenchConfig
from offloadopt.harness.trace_gaps import compute_gaps, launch_breakdown
from offloadopt.options import Options


def _config(text: str) -> tuple[str, float, dict]:
    """``MODE[:FRACTION[:key=value,...]]`` (fraction 0 when left out): HybridAdamW options,
    Python literals, after the second colon; checked on one CPU param before anything else."""
    mode, _, rest = text.partition(":")
    fraction, _, extra = rest.partition(":")
    if mode not in anchors.MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: mode {mode!r} is not one of {list(anchors.MODES)}"
        )
    try:
        value = checks.fraction(fraction or "0")
    except checks.UsageError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: fraction {e}") from None
    try:
        options = {
            k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in extra.split(",") if kv)
        }
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected MODE:FRACTION[:key=value,...], each value a Python literal "
            "(True, 8, 'module')"
        ) from None
    known = {
        *inspect.signature(HybridAdamW).parameters,
        *(f.name for f in dataclasses.fields(Options)),
    }
    unknown = [k for k in options if k not in known or k in ("params", "offload_fraction")]
    if unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: {unknown[0]!r} is not a HybridAdamW option")
    try:  # the values, on one CPU param, before the model is built
        HybridAdamW([torch.nn.Parameter(torch.zeros(1))], offload_fraction=value,
                    **{**anchors.MODES[mode][0], **options}).close()  # fmt: skip
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return mode, value, options


def _top(events, key: str, n: int) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key[:150], "count": e.count, "ms": getattr(e, key) / 1e3} for e in rows]


def _all_threads():
    """A profiler config that records every thread's ops (the worker's launches and updates:
    by default only the thread that starts the profiler is recorded), where this torch has it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def profile_one(bench: Bench, mode: str, fraction: float, warmup: int, steps: int, top: int,
                gaps: bool = False, launches: bool = False, **options):  # fmt: skip
    model = bench.reset_model()
    built = anchors.hybrid(fraction, mode, **options)(model, bench.cfg.lr)
    opt = built["opt"]
    backward = built.get("backward", lambda loss: loss.backward())
    batches = bench.batches

    def iteration(i: int) -> tuple[float, float]:
        x, y = batches[i % len(batches)]
        bench.sync()
        t0 = time.perf_counter()
        with torch.profiler.record_function("## forward+backward"):
            backward(bench.loss(model, x, y))
        bench.sync()
        t1 = time.perf_counter()
        with torch.profiler.record_function("## step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        bench.sync()
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    for i in range(warmup):
        iteration(i)
    plain = [iteration(warmup + i) for i in range(steps)]
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(
        activities=activities, with_stack=gaps, experimental_config=_all_threads()
    ) as prof:
        timed = [iteration(warmup + steps + i) for i in range(steps)]
    gap_report, launch_report = {}, {}
    if gaps or launches:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = json.loads(Path(f"{tmp}/trace.json").read_text())
        gap_report = compute_gaps(trace) if gaps else {}
        if launches:
            launch_report = launch_breakdown(trace)
            for row in launch_report.values():  # per iteration
                for key in ("ms", "uncovered_ms"):
                    row[key] /= steps
                for key in ("ops_ms", "runtime_ms"):
                    row[key] = {
                        k: v / steps for k, v in sorted(row[key].items(), key=lambda kv: -kv[1])
                    }
                row["count"] /= steps
    avg = prof.key_averages()
    kernels = [e for e in avg if e.device_type == torch.autograd.DeviceType.CUDA]
    cuda_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    result = {
        "config": f"{mode}:{fraction}",
        "fwd_bwd_ms": statistics.median(a for a, _ in plain),
        "step_ms": statistics.median(b for _, b in plain),
        "profiled_fwd_bwd_ms": statistics.median(a for a, _ in timed),
        "profiled_step_ms": statistics.median(b for _, b in timed),
        "cuda_busy_ms_per_iter": cuda_ms,
        "gaps": gap_report,
        "launches": launch_report,
        "kernels": [{**r, "ms": r["ms"] / steps} for r in _top(kernels, "self_device_time_total", top)],
        "cpu_ops": [{**r, "ms": r["ms"] / steps} for r in _top(
            [e for e in avg if e.device_type == torch.autograd.DeviceType.CPU], "self_cpu_time_total", top)],
        "ranges": [{**r, "ms": r["ms"] / steps} for r in _top(
            [e for e in avg if e.key.startswith(("offloadopt", "##"))], "cpu_time_total", 2 * top)],
    }  # fmt: skip
    if built.get("close"):
        built["close"]()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before the bench builds anything: a bad value is argparse's usage
    error (status 2) naming the flag and the value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", type=_config, default=[("step", 0.0, {})],
                   metavar="MODE:FRACTION", help="each MODE[:FRACTION[:key=value,...]]: fraction 0 when "
                   "left out; values are Python literals (release_grads=True, wait='module')")  # fmt: skip
    p.add_argument("--preset", type=checks.preset, default="gpt2-xl", help="a model preset")
    p.add_argument("--batch-size", type=checks.positive_int, default=4, help="sequences, >= 1")
    p.add_argument("--warmup", type=checks.nonneg_int, default=3, help="untimed steps, >= 0")
    p.add_argument("--steps", type=checks.positive_int, default=3,
                   help="plain timed steps, then as many profiled, >= 1")  # fmt: skip
    p.add_argument("--top", type=checks.positive_int, default=12, help="rows per table, >= 1")
    p.add_argument(
        "--gaps",
        action="store_true",
        help="the compute stream's idle time in forward+backward, and who caused it (with_stack)",
    )
    p.add_argument(
        "--launches",
        action="store_true",
        help="the worker's copy launches per iteration: ops, CUDA runtime calls, the rest",
    )
    p.add_argument("--out", type=checks.out_dir, default="prof-out")
    p.add_argument("--device", type=checks.device, default="cuda", help="cuda; cpu: a smoke test")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n = args.warmup + 2 * args.steps
    bench = Bench(BenchConfig(preset=args.preset, batch_size=args.batch_size, warmup=n, steps=1,
                              mock_data=True, progress=False, audit=False, device=args.device))  # fmt: skip
    bench.sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    results = []
    for mode, fraction, options in args.configs:
        r = profile_one(
            bench,
            mode,
            fraction,
            args.warmup,
            args.steps,
            args.top,
            args.gaps,
            args.launches,
            **options,
        )
        r["config"] += "".join(f":{k}={v}" for k, v in options.items())
        results.append(r)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(results, indent=1))
        print(f"\n== {r['config']}: fwd+bwd {r['fwd_bwd_ms']:.1f} ms, step {r['step_ms']:.1f} ms "
              f"(profiled {r['profiled_fwd_bwd_ms']:.1f} / {r['profiled_step_ms']:.1f}); "
              f"CUDA busy {r['cuda_busy_ms_per_iter']:.1f} ms/iter")  # fmt: skip
        if g := r["gaps"]:
            print(f"  compute stream in fwd+bwd: busy {g['compute_busy_ms']:.1f} ms, launch-bound gaps "
                  f"{g['launch_bound_gap_ms']:.1f} ms, waits {g['wait_gap_ms']:.1f} ms; launching thread:")  # fmt: skip
            for name, ms in g["launching_thread_ms"]:
                print(f"    {ms:8.2f}  {name}")
        for name, row in r["launches"].items():
            print(f"  {name}: {row['count']:.0f} per iteration, {row['ms']:.2f} ms, of which "
                  f"{row['uncovered_ms']:.2f} ms outside any op (Python, the GIL); ops:")  # fmt: skip
            for op, ms in list(row["ops_ms"].items())[:8]:
                print(f"    {ms:8.2f}  {op}")
            print("   CUDA runtime calls inside:")
            for op, ms in list(row["runtime_ms"].items())[:8]:
                print(f"    {ms:8.2f}  {op}")
        for title, rows in (("kernels (self CUDA ms/iter)", r["kernels"]),
                            ("CPU ops (self CPU ms/iter, every thread)", r["cpu_ops"]),
                            ("ranges (CPU ms/iter, every thread)", r["ranges"])):  # fmt: skip
            print(f"  {title}")
            for row in rows:
                print(f"    {row['ms']:8.2f}  x{row['count']:<6d} {row['name']}")


if __name__ == "__main__":
    main()
