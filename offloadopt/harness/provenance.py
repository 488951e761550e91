"""Where a measurement was made: the commit of the code, the CPU, the versions of the packages
compared, and what a run on the CPU alone measures. ``bench`` writes these into its JSON, so a
results folder names its own commit and hardware (``benchmarks/headline.py`` reads them), and
``bench`` and ``audit`` print :data:`CPU_BENCH_NOTE` / :data:`CPU_AUDIT_NOTE` on a CPU. No torch
import.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["commit", "cpu_name", "versions", "CPU_BENCH_NOTE", "CPU_AUDIT_NOTE"]

# The packages the anchors come from (offloadopt/harness/anchors.py), by distribution name.
ANCHOR_PACKAGES = ("torch", "megatron-core", "deepspeed", "torchao", "transformers")

CPU_BENCH_NOTE = (
    "on the CPU: no GPU and no link; every configuration runs the same host path (the CPU "
    "stands in for the device: plain copies, no streams, nothing pinned), so step and opt ms "
    "measure the optimizer's CPU work and Python overhead on this machine, not offloading, and "
    "the GPU-only anchors are skipped; the ratios between fractions say nothing of a GPU host "
    "(run there: --device cuda)"
)
CPU_AUDIT_NOTE = (
    "on the CPU: no GPU and no link, so no host-device copy exists to be audited (the table "
    "counts CUDA memcpys: 0 here is not a finding); this run checks that the iterations train "
    "under the profiler; audit the copies on a GPU host (--device cuda)"
)


def commit(path: Path | None = None) -> str | None:
    """The short hash of the git checkout holding ``path`` (default: this package), with
    ``-dirty`` when tracked files differ from it; None outside a checkout or without git."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    """The CPU's model name and the cores this process may use: ``"Intel(R) Xeon(R) ... (16
    cores)"`` (``/proc/cpuinfo``, else ``platform.processor()``)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({cores} cores)"


def versions(packages: tuple[str, ...] = ANCHOR_PACKAGES) -> dict[str, str]:
    """The installed versions of ``packages`` (distribution names), those installed only."""
    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found
