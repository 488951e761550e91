"""What the main job logs and reports besides its loop: the ``offloadopt.train`` logger and
its handler to stdout (:class:`StdoutHandler`, set up for a run by ``_logging_to_stdout``),
the host's resident memory (:func:`host_rss_nbytes`), the line saying what chose the offload
fraction (:func:`describe_choice`) and the per-rank figures of a distributed run
(:func:`per_rank`). No torch import at load (``per_rank`` imports ``torch.distributed``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from offloadopt.harness.distributed import Dist

__all__ = ["log", "StdoutHandler", "host_rss_nbytes", "describe_choice", "per_rank"]


def host_rss_nbytes() -> int:
    """Resident set size of this process in bytes (psutil, else /proc/self/status; 0 if neither)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except OSError:
        pass
    return 0


# The main job's log: one line per logged step and a few lines before the loop. ``train()``
# writes it to stdout (through tqdm.write, so the progress bar on stderr stays below the lines)
# unless a handler of the caller's own is attached to this logger; records also propagate.
log = logging.getLogger("offloadopt.train")


class StdoutHandler(logging.Handler):
    """Each record's message as one line on the current ``sys.stdout``, flushed at once (a
    log redirected to a file keeps every line if the job is killed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


@contextlib.contextmanager
def _logging_to_stdout(main: bool) -> Iterator[None]:
    """On the main rank, ``log`` to stdout for the block, unless the caller attached a handler
    to it, at INFO unless the caller set its level (on it, or on the ``offloadopt`` logger, as
    the command line's ``--log-level`` does); other ranks log only warnings (rank 0 speaks for
    the job)."""
    previous = log.level
    own = [h for h in log.handlers if not isinstance(h, logging.NullHandler)]
    handler = StdoutHandler() if main and not own else None
    if handler is not None:
        log.addHandler(handler)
    if not main:
        log.setLevel(logging.WARNING)
    elif log.level == logging.NOTSET == logging.getLogger("offloadopt").level:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(previous)


def describe_choice(choice: dict) -> str:
    """One line of what chose the offload fraction (``HybridAdamW.placement_choice``)."""
    gb = 1e9
    line = f"placement: offload fraction {choice['fraction']:g}"
    if "max_gpu_memory" in choice:
        line += (f" | max_gpu_memory {choice['max_gpu_memory'] / gb:.2f} GB: device "
                 f"{choice['predicted_gpu_bytes'] / gb:.2f} GB predicted, host "
                 f"{choice['host_bytes'] / gb:.2f} GB")  # fmt: skip
    if "kept" in choice:
        line += f" | auto kept it: {choice['kept']}"
    elif choice.get("set_by") == "auto":
        measured = choice.get("measured_step_ms")
        line += (f" | auto: probe {choice['probe_fraction']:g} at "
                 f"{choice['probe_measured_step_ms']:.1f} ms/step; predicted "
                 f"{choice['predicted_step_ms']:.1f} ms/step (fraction 0: "
                 f"{choice['predicted_step_ms_at_0']:.1f})")  # fmt: skip
        line += f", measured {measured:.1f}" if measured is not None else ", measuring"
        if choice.get("steady_step_ms") is not None:
            line += f", steady {choice['steady_step_ms']:.1f}"
            line += " (the host moved)" if choice.get("host_moved") else ""
        moves = choice.get("corrections") or []
        if moves:
            line += " | corrected from " + ", ".join(
                f"{c['fraction']:g} ({c['measured_step_ms']:.1f} ms)" for c in moves
            )
    return line


def per_rank(opt, summary: dict, ranks: Dist, tokens_per_step: int) -> dict:
    """Each rank's figures (gathered on every rank) and the job's totals: host bytes add up
    over ranks, tokens/s too (each rank trains on its own batches)."""
    import torch.distributed as dist

    stats = getattr(opt, "stats", {})
    mine = {
        "rank": ranks.rank,
        "median_step_ms": summary["median_step_ms"],
        "peak_gpu_gb": summary["peak_gpu_gb"],
        "host_rss_gb": host_rss_nbytes() / 1e9,
        "host_state_nbytes": getattr(opt, "host_nbytes", 0),
        "pinned_nbytes": getattr(opt, "pinned_nbytes", 0),
        "cpu_threads": int(stats.get("cpu_threads", 0)),
        "local_ranks": int(stats.get("local_ranks", ranks.local_world)),
    }
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, mine)
    slowest = max(r["median_step_ms"] for r in everyone)  # the job steps at its slowest rank
    return {
        "ranks": everyone,
        "tokens_per_s": tokens_per_step * ranks.world / slowest * 1e3,
        "tokens_per_s_per_rank": tokens_per_step / slowest * 1e3,
        "optimizer_host_gb": sum(r["host_state_nbytes"] for r in everyone) / 1e9,
        "optimizer_pinned_gb": sum(r["pinned_nbytes"] for r in everyone) / 1e9,
    }
