"""Memcpy audit: every copy of a region, by direction and memory kind, with its Python call site.

A quietly pageable host buffer costs ~11x on H2D (4.9 against 54.5 GB/s on an H200) and makes a
``non_blocking=True`` copy synchronous (README, "The transfer audit"); this makes such copies visible.
``audit()`` records a region with ``torch.profiler`` (``with_stack=True``) and summarises it with
``summarize()``, a pure function over the exported Chrome-trace events that lives in
:mod:`offloadopt.trace_summary` with the report's types and the trace format's notes; they are
re-exported here, where they have always been imported from. ``check_pinned()`` lists the host
buffers of an optimizer that would cross the link unpinned; ``quiet_profiler()`` keeps the
profiler's own stderr lines out of the audit's output.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from offloadopt.callsite import CallSite

# the trace summary's names: imported from here too, where they were defined before
from offloadopt.trace_summary import (  # noqa: F401 - re-exported
    BACKWARD_RANGE,
    INTERNAL_FRAMES,
    MEMCPY_NAME,
    AuditReport,
    CopyRow,
    PageableCopyError,
    _what,
    load_trace_events,
    summarize,
)

__all__ = ["PageableCopyError", "CallSite", "CopyRow", "AuditReport", "summarize"]
__all__ += ["load_trace_events", "Audit", "audit", "check_pinned"]


@dataclass
class Audit:
    """What :func:`audit` yields: ``report`` once the block has ended, and ``trace_path``."""

    report: AuditReport | None = None
    trace_path: str | None = None  # the kept Chrome trace; None when it was a temporary file


@contextlib.contextmanager
def audit(trace_path: str | os.PathLike | None = None, **summarize_kwargs: Any) -> Iterator[Audit]:
    """Profile a region with ``torch.profiler`` (CPU + CUDA, ``with_stack=True``), summarise it.

    ``with audit() as a: <one or a few training steps>`` then ``a.report`` (:class:`AuditReport`).
    Without CUDA only CPU activity is recorded and the report has no copies. If the block
    raises, the profiler is stopped and nothing is exported.

    Args:
        trace_path: keep the Chrome trace there (``.json`` or ``.json.gz``), written whole at
            the end (a temporary name beside it, then a rename); default: a temporary file,
            deleted after loading.
        **summarize_kwargs: passed to :func:`summarize` (``depth``, ``resolve_lines``...).

    Raises (on entering, before the block runs):
        ValueError: ``trace_path`` is empty, a folder, in a folder that does not exist or that
            this process cannot write in.
        TypeError, ValueError: ``summarize_kwargs`` that :func:`summarize` refuses.
    """
    dest = None if trace_path is None else os.fspath(trace_path)
    if dest is not None:
        _check_trace_path(dest)
    summarize([], **summarize_kwargs)  # checks the arguments now, not after the region ran
    result = Audit(trace_path=dest)
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()  # earlier GPU work ends before recording: it is not counted
    prof = torch.profiler.profile(activities=activities, with_stack=True)
    with quiet_profiler():  # its start-up lines are not the audit's output
        prof.start()
    try:
        try:
            yield result
        finally:
            if cuda:
                torch.cuda.synchronize()  # every copy of the block has ended: the trace holds it
    finally:
        with quiet_profiler():
            prof.stop()
    if dest is None:
        fd, path = tempfile.mkstemp(prefix="offloadopt-audit-", suffix=".json")
        os.close(fd)
    else:  # beside dest, ending as dest does (.gz: torch compresses by the name)
        folder, name = os.path.split(dest)
        path = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        with quiet_profiler():
            prof.export_chrome_trace(path)
        events = load_trace_events(path)
        if dest is not None:
            os.replace(path, dest)
    finally:
        if os.path.exists(path):
            os.remove(path)
    result.report = summarize(events, **summarize_kwargs)


# What torch's profiler writes of its own on the process's stderr (fd 2, from C++) as it
# starts, stops and exports: kineto's log lines ("STAGE:... ActivityProfilerController.cpp:...]
# Completed Stage: Warm Up", "USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start",
# CUPTI's notes). Not the audit's output; any other line is written back.
PROFILER_NOISE = re.compile(
    r"^\s*(STAGE:|USDT:)"
    r"|(ActivityProfiler\w*|SyncActivityProfilerHandler|CuptiActivity\w*|CuptiCallbackApi"
    r"|output_json|ChromeTraceLogger|kineto\w*|Logger|DeviceProperties)\.cpp:\d+\]"
)
# Python warnings from these files, issued while the profiler starts, stops or exports
_PROFILER_FILES = re.compile(r"torch[/\\](profiler|autograd[/\\]profiler)")


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Run the block (the profiler's start, stop or export) with stderr's file descriptor
    captured: the profiler's own lines (:data:`PROFILER_NOISE`) and its Python warnings are
    dropped, every other line and warning is passed on afterwards (an error still shows)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to capture: nothing reaches a terminal anyway
        yield
        return
    captured = tempfile.TemporaryFile()
    try:
        os.dup2(captured.fileno(), 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
                os.dup2(saved, 2)
        captured.seek(0)
        lines = captured.read().decode("utf-8", errors="replace").splitlines(keepends=True)
        kept = "".join(line for line in lines if not PROFILER_NOISE.search(line))
        if kept:
            sys.stderr.write(kept if kept.endswith("\n") else kept + "\n")
            sys.stderr.flush()
        for w in caught:
            if not _PROFILER_FILES.search(str(w.filename)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        os.close(saved)
        captured.close()


def _check_trace_path(path: Any) -> None:
    if not isinstance(path, str) or not path:
        raise ValueError(f"trace_path: {path!r} is not a file name")
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"trace_path: {path!r} is a folder, not a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"trace_path: {path!r}: no folder {folder!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"trace_path: {path!r}: cannot write in {folder!r} (permission denied)")


def check_pinned(optimizer: Any) -> list[str]:
    """Every host buffer that crosses the link and is not pinned, as ``"label: shape dtype bytes"``.

    An optimizer that knows its copies exposes ``crossing_host_tensors()`` -> list of
    ``(label, tensor)``: the host side of every H2D/D2H copy (``HybridAdamW`` does). Those on
    the CPU with ``not tensor.is_pinned()`` are returned (empty tensors excepted: nothing of
    theirs crosses, and they never report pinned); an empty list means the invariant holds.

    Fallback for any other optimizer (torch's, Megatron's...): scan ``optimizer.state`` of the
    params that live on an accelerator for CPU tensors, and report each unpinned one as a host
    tensor that would cross. 0-dim tensors (torch keeps ``step`` on the host on purpose) are
    skipped. Labels read ``"param_groups[g].params[i] state['key']"``.

    Raises:
        TypeError: ``optimizer`` is neither kind (None, a tensor, a string: an empty answer
            would read as "all pinned"), or what it holds is not shaped so (a
            ``crossing_host_tensors()`` item that is not a ``(label, tensor)`` pair, a param
            group without a list of tensors); the message names what it got.
    """
    if callable(getattr(optimizer, "crossing_host_tensors", None)):
        items = list(optimizer.crossing_host_tensors())
        for item in items:
            pair = isinstance(item, (tuple, list)) and len(item) == 2
            if not (pair and hasattr(item[1], "is_pinned")):  # tensor-like: tests fake pinning
                raise TypeError(
                    f"check_pinned: crossing_host_tensors() gave {_what(item)}, "
                    "not a (label, tensor) pair"
                )
    elif hasattr(optimizer, "param_groups") and hasattr(optimizer, "state"):
        items = []
        for g, group in enumerate(optimizer.param_groups):
            params = group.get("params") if isinstance(group, dict) else None
            if not isinstance(params, (list, tuple)) or not all(
                isinstance(p, torch.Tensor) for p in params
            ):
                raise TypeError(
                    f"check_pinned: param_groups[{g}] is {_what(group)}, not a dict "
                    'with a list of tensors under "params"'
                )
            for i, p in enumerate(params):
                state = optimizer.state.get(p) if p.device.type != "cpu" else None
                for name, v in state.items() if isinstance(state, dict) else ():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        items.append((f"param_groups[{g}].params[{i}] state[{name!r}]", v))
    else:
        raise TypeError(
            f"check_pinned: got {_what(optimizer)}, not an optimizer (an object with "
            "crossing_host_tensors(), or param_groups and state as torch.optim's)"
        )
    return [
        f"{label}: shape {tuple(t.shape)} {t.dtype}, {t.numel() * t.element_size()} bytes, "
        "not pinned"
        for label, t in items
        if t.device.type == "cpu" and t.numel() and not t.is_pinned()  # empty: nothing crosses
    ]
