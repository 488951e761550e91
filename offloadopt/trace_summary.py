"""Trace summary: every memcpy of a ``torch.profiler`` Chrome trace, by direction and memory
kind, with its Python call site; pure (no torch, no profiler: events in, report out).

:func:`summarize` turns the exported events into an :class:`AuditReport` (one :class:`CopyRow`
per direction and pair of memory kinds); :func:`load_trace_events` reads a trace file.
``offloadopt.audit`` records the trace and re-exports every public name here. The events are
read as kineto writes them (``libkineto/src/output_json.cpp``, ``CuptiActivity.cpp``). ``ts``
and ``dur`` are microseconds.

- ``cat "gpu_memcpy"``: ``"Memcpy <HtoD|DtoH|DtoD|HtoH|PtoP|..> (<src> -> <dst>)"``, kinds
  ``Pageable Pinned Device Managed Array Unknown..``; ``args["bytes"]``, ``args["correlation"]``,
  ``args["External id"]`` (the CPU op); ``pid`` is the device, ``tid`` the stream.
- ``cat "kernel"``: compute kernels, same layout. ``cat "cuda_runtime"``: the host call
  (``cudaMemcpyAsync``) with the same ``correlation``; ``ac2g`` flow events link the two too.
- ``cat "python_function"``: frames ``"file(line): function"`` (paths relative to ``sys.path``),
  nested by time on their thread. torch records a frame when it is entered, so ``line`` is the
  ``def`` line, or the current line of a frame already running when recording began (the
  ``with audit():`` line). ``CallSite.lines`` recovers the exact line from the source when it
  is readable: the lines of that block calling the callee (the ``.item(`` of an ``.item()``).
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import zlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from offloadopt import callsite
from offloadopt.callsite import FRAME, CallSite, Stacks, callee_name, key, num

__all__ = ["PageableCopyError", "CopyRow", "AuditReport", "summarize", "load_trace_events"]
__all__ += ["BACKWARD_RANGE", "INTERNAL_FRAMES", "MEMCPY_NAME"]

# "Memcpy HtoD (Pinned -> Device)"; kinds may hold spaces ("Device Static").
MEMCPY_NAME = re.compile(r"^\s*Memcpy\s+(\w+)\s*\(\s*([^()]*?)\s*->\s*([^()]*?)\s*\)\s*$")
# Frames that are not the user's: built-ins (<built-in ...>, <frozen ...>), torch's own Python,
# and stdlib plumbing between a call site and torch.
INTERNAL_FRAMES = (
    r"^<",
    r"(^|[/\\])(torch|torchgen|functorch)[/\\]",
    r"(^|[/\\])(contextlib|functools|threading|abc|typing|enum)\.py$",
)


class PageableCopyError(RuntimeError):
    """Raised by :meth:`AuditReport.check` when copies touched pageable host memory."""


@dataclass
class CopyRow:
    """All copies of one ``(direction, src_kind, dst_kind)``; times in microseconds (us).

    ``direction`` is ``"other"`` (kinds empty, raw ``names`` kept) for names that do not parse.
    """

    direction: str
    src_kind: str
    dst_kind: str
    count: int = 0
    nbytes: int = 0
    time_us: float = 0.0  # sum of copy durations
    overlap_us: float = 0.0  # part of time_us with a compute kernel running on the same device
    # part of time_us with a backward kernel running on the same device: one launched inside a
    # BACKWARD_RANGE annotation (torch.profiler.record_function), on any thread
    overlap_backward_us: float = 0.0
    names: list[str] = field(default_factory=list)
    call_sites: list[CallSite] = field(default_factory=list)

    @property
    def label(self) -> str:
        kinds = f" ({self.src_kind} -> {self.dst_kind})" if self.direction != "other" else ""
        return self.direction + kinds

    @property
    def is_pageable(self) -> bool:
        kinds = (self.src_kind, self.dst_kind, *self.names)
        return any("pageable" in k.lower() for k in kinds)

    @property
    def time_ms(self) -> float:
        return self.time_us / 1e3

    @property
    def avg_us(self) -> float:
        return self.time_us / self.count if self.count else 0.0

    @property
    def bandwidth_gbps(self) -> float | None:
        """Effective GB/s (1 GB = 1e9 bytes): total bytes over total copy time; None if no time."""
        return self.nbytes / (self.time_us * 1e3) if self.time_us > 0 else None

    @property
    def overlap_pct(self) -> float:
        return 100.0 * self.overlap_us / self.time_us if self.time_us > 0 else 0.0

    @property
    def overlap_backward_pct(self) -> float:
        return 100.0 * self.overlap_backward_us / self.time_us if self.time_us > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self) | {k: getattr(self, k) for k in _ROW_DERIVED}
        return d | {"call_sites": [asdict(c) | {"str": str(c)} for c in self.call_sites]}


_ROW_DERIVED = ("label", "is_pageable", "time_ms", "avg_us", "bandwidth_gbps", "overlap_pct",
                "overlap_backward_pct")  # fmt: skip
# The record_function name that marks backward on the host (offloadopt audit wraps each
# loss.backward() in it): kernels launched while one is open are backward's.
BACKWARD_RANGE = "offloadopt.step.backward"


@dataclass
class AuditReport:
    """Memcpy summary of a trace. ``kernel_time_us``: union of kernel time, summed over devices."""

    rows: list[CopyRow]
    kernel_count: int = 0
    kernel_time_us: float = 0.0

    @property
    def copy_count(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def pageable_rows(self) -> list[CopyRow]:
        return [r for r in self.rows if r.is_pageable]

    @property
    def pageable_count(self) -> int:
        """Number of copies from or to pageable host memory (each one staged and synchronous)."""
        return sum(r.count for r in self.pageable_rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: rows with derived fields, counts; units in the key names."""
        keys = ("copy_count", "pageable_count", "kernel_count", "kernel_time_us")
        return {"rows": [r.to_dict() for r in self.rows]} | {k: getattr(self, k) for k in keys}

    def table(self) -> str:
        """Fixed-width summary in the spirit of Nsight's ``cuda_gpu_mem_time_sum``.

        MB is 1e6 bytes, GB/s 1e9 bytes/s; overlap is the share of copy time during which a
        compute kernel ran on the same GPU, "w/ bwd" the share with a backward kernel (one
        launched inside a :data:`BACKWARD_RANGE` annotation). Pageable rows list their call
        sites beneath.
        """
        head = "  Count   Total MB   Total ms     Avg us     GB/s Overlap %  w/ bwd %  Operation"
        out = [head, "-" * len(head)]
        for r in sorted(self.rows, key=lambda r: -r.time_us):
            bw = f"{r.bandwidth_gbps:8.2f}" if r.bandwidth_gbps is not None else f"{'-':>8}"
            flag = ("  <- PAGEABLE" if r.is_pageable else "") + "".join(f"  {n!r}" for n in r.names)
            out.append(
                f"{r.count:>7} {r.nbytes / 1e6:>10.2f} {r.time_ms:>10.3f} {r.avg_us:>10.1f} "
                f"{bw} {r.overlap_pct:>9.1f} {r.overlap_backward_pct:>9.1f}  {r.label}{flag}"
            )
            for s in r.call_sites if r.is_pageable else []:
                out.append(f"{'':>7} {s.count:>6} x {s.nbytes / 1e6:.2f} MB  {s}")
        out.append(
            f"{self.copy_count} copies, {self.pageable_count} pageable; "
            f"{self.kernel_count} kernels, {self.kernel_time_us / 1e3:.3f} ms of kernel time"
        )
        return "\n".join(out)

    def check(self, allow_pageable: bool = False) -> AuditReport:
        """Raise :class:`PageableCopyError` listing every pageable copy (kind, count, bytes,
        call sites) unless ``allow_pageable``; returns ``self`` otherwise."""
        bad = self.pageable_rows
        if bad and not allow_pageable:
            lines = [
                f"{self.pageable_count} copies touched pageable host memory (staged and "
                "synchronous; pin the host buffer):"
            ]
            for r in bad:
                lines.append(f"  {r.label}: {r.count} copies, {r.nbytes} bytes")
                lines += [f"    {s.count} x {s.nbytes} bytes from {s}" for s in r.call_sites]
            raise PageableCopyError("\n".join(lines))
        return self


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _covered(merged: list[tuple[float, float]], starts: list[float], s: float, e: float) -> float:
    """Length of [s, e) covered by the disjoint sorted ``merged`` intervals (``starts`` theirs)."""
    total, i = 0.0, max(bisect.bisect_right(starts, s) - 1, 0)
    while i < len(merged) and merged[i][0] < e:
        total += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return total


def _summarize_args(trace_events: Any, depth: Any, internal: Any) -> tuple[list, list]:
    """summarize()'s arguments, checked: the events as a list, the compiled regexes."""
    events = trace_events.get("traceEvents", []) if isinstance(trace_events, dict) else trace_events
    if isinstance(events, (str, bytes, os.PathLike)) or not isinstance(events, Iterable):
        raise TypeError(
            f"trace_events: got {_what(events)}, not a list of events "
            "(for a file: load_trace_events(path))"
        )
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"depth: got {_what(depth)}, not an int")
    if depth < 1:
        raise ValueError(f"depth: {depth} is not >= 1")
    bad = isinstance(internal, str) or not isinstance(internal, Iterable)
    patterns = () if bad else tuple(internal)
    if bad or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"internal: got {_what(internal)}, not a tuple of regex strings")
    try:
        return list(events), [re.compile(p) for p in patterns]
    except re.error as e:
        raise ValueError(f"internal: {e.pattern!r} is not a regex ({e})") from None


def _what(x: Any) -> str:
    """``x`` for an error message: its type and a short repr."""
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:56] + ' ...'}"


def summarize(
    trace_events: list[dict] | dict,
    *,
    depth: int = 3,
    resolve_lines: bool = True,
    internal: tuple[str, ...] = INTERNAL_FRAMES,
) -> AuditReport:
    """Summarise every memcpy of a Chrome trace exported by ``torch.profiler``.

    Args:
        trace_events: ``json.load(f)["traceEvents"]`` (or the whole dict). Malformed events and
            unknown names never raise: unparsed memcpy names go to one ``"other"`` row, fields
            that are not finite numbers (``"soon"``, NaN, ``Infinity``) count as 0, events that
            are not dicts are skipped, and unhashable ids (a list-valued ``pid``) are compared by
            their repr.
        depth: user frames kept per call site (innermost first), an int >= 1.
        resolve_lines: read the source files (found through ``sys.path``) to give the exact
            lines that call the callee; ``False`` keeps this function free of file reads.
        internal: regexes on a frame's file name (or ``<built-in ...>`` name) marking frames that
            are not the user's; the call site is the innermost frame matching none.

    Returns:
        :class:`AuditReport`, one :class:`CopyRow` per ``(direction, src, dst)``, with call sites
        attributed through the host runtime call (``args["correlation"]``), the ``ac2g`` flow, or
        the CPU op (``args["External id"]``), and the Python frames enclosing it on its thread.

    Raises:
        TypeError, ValueError: a bad argument (not events: a str, a number; ``depth`` not an
            int >= 1; ``internal`` not a tuple of regexes), before any event is read.
    """
    trace_events, internal_re = _summarize_args(trace_events, depth, internal)
    copies, kernels = [], defaultdict(list)  # device -> (start, end, correlation) per kernel
    backward_ranges: list[tuple[float, float]] = []
    runtime, cpu_ops, flow_src, flow_dst = {}, {}, {}, {}
    py: dict[tuple, list[dict]] = defaultdict(list)
    # Every id below goes through key(): a dict key must be hashable, and a trace may hold a
    # list where an int belongs.
    for e in trace_events:
        if not isinstance(e, dict):
            continue
        ph, cat = key(e.get("ph")), str(e.get("cat", "")).lower()
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        where = (key(e.get("pid")), key(e.get("tid")))
        if ph == "X" and cat in ("gpu_memcpy", "memcpy"):
            copies.append(e)
        elif ph == "X" and cat == "kernel":
            s = num(e.get("ts"))
            kernels[where[0]].append((s, s + max(num(e.get("dur")), 0.0), key(args.get("correlation"))))  # fmt: skip
        elif ph == "X" and cat == "user_annotation" and e.get("name") == BACKWARD_RANGE:
            s = num(e.get("ts"))
            backward_ranges.append((s, s + max(num(e.get("dur")), 0.0)))
        elif ph == "X" and cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            runtime[key(args["correlation"])] = e
        elif ph == "X" and cat == "cpu_op" and "External id" in args:
            cpu_ops.setdefault(key(args["External id"]), e)
        elif ph == "X" and cat == "python_function":
            py[where].append(e)
        elif ph == "s" and cat == "ac2g":
            flow_src[key(e.get("id"))] = e
        elif ph == "f" and cat == "ac2g":
            flow_dst[(*where, key(e.get("ts")))] = key(e.get("id"))

    merged = {dev: _merge([(s, e) for s, e, _ in iv]) for dev, iv in kernels.items()}
    starts = {dev: [s for s, _ in iv] for dev, iv in merged.items()}
    # backward's kernels: launched (their runtime call) inside a backward range
    ranges = _merge(backward_ranges)
    range_starts = [s for s, _ in ranges]

    def in_backward(correlation) -> bool:
        launch = runtime.get(correlation)
        if launch is None or not ranges:
            return False
        t = num(launch.get("ts"))
        i = bisect.bisect_right(range_starts, t) - 1
        return i >= 0 and t < ranges[i][1]

    bwd = {dev: _merge([(s, e) for s, e, c in iv if in_backward(c)]) for dev, iv in kernels.items()}
    bwd_starts = {dev: [s for s, _ in iv] for dev, iv in bwd.items()}
    stacks = {k: Stacks(v) for k, v in py.items()}
    rows: dict[tuple[str, str, str], CopyRow] = {}
    sites: dict[tuple, CallSite] = {}
    src_cache: dict[str, str | None] = {}

    def is_user(frame: str) -> bool:
        m = FRAME.match(frame)
        return m is not None and not any(r.search(m["file"]) for r in internal_re)

    def call_site(e: dict, args: dict) -> tuple[tuple[str, ...], str, list[str]]:
        op = cpu_ops.get(key(args.get("External id")))
        flow = flow_src.get(flow_dst.get((key(e.get("pid")), key(e.get("tid")), key(e.get("ts")))))
        for a in (runtime.get(key(args.get("correlation"))), flow, op):  # the host side first
            st = stacks.get((key(a.get("pid")), key(a.get("tid")))) if a else None
            chain = st.at(num(a.get("ts")) + num(a.get("dur")) / 2) if st else []
            if chain:
                k = next((i for i, f in enumerate(chain) if is_user(f)), None)
                if k is None:  # no user frame (a torch thread): show torch's innermost frames
                    return tuple(chain[:depth]), "", []
                below = [callee_name(f) for f in reversed(chain[:k])]  # outermost first
                user = tuple(f for f in chain[k:] if is_user(f))[:depth]
                shown = below[:1] + below[-1:] if len(below) > 1 else below
                return user, " > ".join(d for d, _ in shown), [tok for _, tok in below]
        return (), (str(op.get("name", "")) if op else ""), []

    for e in copies:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        name = str(e.get("name", ""))
        m = MEMCPY_NAME.match(name)
        row_key = (m[1], m[2], m[3]) if m else ("other", "", "")
        row = rows.setdefault(row_key, CopyRow(*row_key))
        if not m and name not in row.names:
            row.names.append(name)
        s, dur = num(e.get("ts")), max(num(e.get("dur")), 0.0)
        nbytes = int(max(num(args.get("bytes")), 0.0))
        row.count, row.nbytes, row.time_us = row.count + 1, row.nbytes + nbytes, row.time_us + dur
        dev = key(e.get("pid"))
        if dev in merged:
            row.overlap_us += _covered(merged[dev], starts[dev], s, s + dur)
            row.overlap_backward_us += _covered(bwd[dev], bwd_starts[dev], s, s + dur)
        frames, callee, tokens = call_site(e, args)
        site = sites.get((row_key, frames, callee))
        if site is None:
            lines = (
                callsite.resolve_lines(frames[0], tokens, src_cache)
                if resolve_lines and frames
                else ()
            )
            site = sites[(row_key, frames, callee)] = CallSite(frames, callee, lines)
            row.call_sites.append(site)
        site.count, site.nbytes = site.count + 1, site.nbytes + nbytes
    for row in rows.values():
        row.call_sites.sort(key=lambda c: (-c.count, -c.nbytes))
    busy = sum(e - s for iv in merged.values() for s, e in iv)
    return AuditReport(list(rows.values()), sum(map(len, kernels.values())), busy)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}  # fmt: skip


def load_trace_events(path: str | os.PathLike) -> list[dict]:
    """``traceEvents`` of a Chrome trace file written by ``export_chrome_trace``, gzipped or
    not (told by the first bytes, not the name). A file holding a bare list of events gives it.

    Raises:
        OSError: the file cannot be read (missing, a folder, no permission).
        ValueError: naming the file, when it is not a Chrome trace: not JSON (binary, cut
            short, a corrupt gzip), or JSON of another shape (``42``, an object without a
            ``traceEvents`` list).
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if raw[:2] == b"\x1f\x8b":  # gzip's magic number
            raw = gzip.decompress(raw)
        data = json.loads(raw)  # UTF-8 (or -16/-32) decoded here: a binary file is a ValueError
    except (ValueError, EOFError, OSError, zlib.error, RecursionError) as e:
        raise ValueError(f"{os.fspath(path)}: not a Chrome trace (JSON): {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        what = "an object without a traceEvents list" if isinstance(data, dict) else (
            f"{_JSON_TYPES.get(type(data), type(data).__name__)}, not an object with a "
            "traceEvents list or a list of events")  # fmt: skip
        raise ValueError(f"{os.fspath(path)}: not a Chrome trace: {what}")
    return events
