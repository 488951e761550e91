"""Two readings of a Chrome trace from torch.profiler (``prof.export_chrome_trace``), as
benchmarks/profile_modes.py's ``--gaps`` and ``--launches`` print them: the compute stream's
idle time in a window, split by its cause (:func:`compute_gaps`), and where the worker's copy
launches spend their time (:func:`launch_breakdown`). Plain dicts in, plain dicts out: no
torch import (the audit's own reading of a trace is offloadopt/trace_summary.py)."""

from __future__ import annotations


def compute_gaps(trace: dict, window: str = "## forward+backward", min_us: float = 20.0):
    """The compute stream's idle time inside ``window`` (a record_function range, on the GPU
    timeline) of a Chrome trace from torch.profiler: gaps longer than ``min_us`` between its
    kernels, split into launch-bound ones (the next kernel was launched after the gap began:
    the launching thread was busy) and waits (launched earlier: the stream waited for an event
    or a copy); for launch-bound gaps, the Python functions and ops the launching thread ran
    between the two launches (their own time, µs, summed over every gap)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {}
    streams: dict = {}
    for k in kernels:
        streams[k["args"].get("stream")] = streams.get(k["args"].get("stream"), 0) + 1
    compute = max(streams, key=streams.get)
    kernels = sorted(
        (k for k in kernels if k["args"].get("stream") == compute), key=lambda k: k["ts"]
    )
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "gpu_user_annotation" and e.get("name") == window]  # fmt: skip
    cpu = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    by_tid: dict = {}
    for e in cpu:
        by_tid.setdefault(e["tid"], []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: e["ts"])
    busy = launch_bound = waits = 0.0
    blame: dict[str, float] = {}
    for lo, hi in windows:
        inside = [k for k in kernels if lo <= k["ts"] < hi]
        busy += sum(k["dur"] for k in inside)
        for a, b in zip(inside, inside[1:], strict=False):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap < min_us:
                continue
            la, lb = (
                launches.get(a["args"].get("correlation")),
                launches.get(b["args"].get("correlation")),
            )
            if lb is None or la is None or lb["ts"] < a["ts"] + a["dur"]:
                waits += gap
                continue
            launch_bound += gap
            # what the launching thread ran between the two launches: each event's own time
            span = [
                e
                for e in by_tid.get(lb["tid"], ())
                if la["ts"] <= e["ts"] and e["ts"] + e["dur"] <= lb["ts"]
            ]
            for e in span:
                own = e["dur"] - sum(c["dur"] for c in span if c is not e and e["ts"] <= c["ts"]
                                     and c["ts"] + c["dur"] <= e["ts"] + e["dur"] and c["dur"] < e["dur"])  # fmt: skip
                blame[e["name"][:90]] = blame.get(e["name"][:90], 0.0) + max(own, 0.0)
    n = max(len(windows), 1)
    top = sorted(blame.items(), key=lambda kv: -kv[1])[:15]
    return {"iterations": len(windows), "compute_busy_ms": busy / 1e3 / n,
            "launch_bound_gap_ms": launch_bound / 1e3 / n, "wait_gap_ms": waits / 1e3 / n,
            "launching_thread_ms": [(name, us / 1e3 / n) for name, us in top]}  # fmt: skip


def launch_breakdown(trace: dict, prefix: str = "offloadopt.launch") -> dict:
    """Where the worker's copy launches spend their time, from a Chrome trace of torch.profiler:
    for each range named ``prefix*`` (pipeline.py wraps each bucket's D2H and H2D launches),
    its wall time split into the ops it ran directly (aten ops, CUDA runtime calls; own names)
    and the rest (Python and waits for the GIL: the trace has no Python frames without
    with_stack). Returns per range name: count, total ms, ms per op name, uncovered ms, and the
    CUDA runtime calls inside (ms per name, nested in the ops)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = [e for e in events
              if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)]  # fmt: skip
    inner = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    by_tid: dict = {}
    for e in inner:
        by_tid.setdefault(e["tid"], []).append(e)
    report: dict = {}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        inside = sorted((e for e in by_tid.get(r["tid"], ()) if lo <= e["ts"] and e["ts"] + e["dur"] <= hi),
                        key=lambda e: (e["ts"], -e["dur"]))  # fmt: skip
        top, end = [], -1.0
        for e in inside:  # the ops not nested in another op of the range
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e["dur"]
        row = report.setdefault(r["name"], {"count": 0, "ms": 0.0, "ops_ms": {}, "runtime_ms": {},
                                            "uncovered_ms": 0.0})  # fmt: skip
        row["count"] += 1
        row["ms"] += r["dur"] / 1e3
        row["uncovered_ms"] += (r["dur"] - sum(e["dur"] for e in top)) / 1e3
        for e in top:
            row["ops_ms"][e["name"]] = row["ops_ms"].get(e["name"], 0.0) + e["dur"] / 1e3
        for e in inside:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                row["runtime_ms"][e["name"]] = (
                    row["runtime_ms"].get(e["name"], 0.0) + e["dur"] / 1e3
                )
    return report
