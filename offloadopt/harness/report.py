"""The benchmark's results for people: one fixed-width table row per configuration, and a plot
of step time and peak GPU memory against the offload fraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["format_table", "plot"]


def format_table(results: list[dict[str, Any]]) -> str:
    cols = f"{'configuration':<28} {'step ms':>8} {'fwd+bwd':>8} {'opt ms':>8} {'peak GB':>8} {'pinned GB':>9} {'pageable':>8}  status"
    lines = [cols]
    for r in results:
        if r.get("kind") == "kernel":
            lines.append(f"{r['name']:<28} kernel {r['kernel_ms']:.1f} ms ({r['kernel_ns_per_param']:.3f} ns/param), "
                         f"CPU casts {r['cpu_casts_ms']:.1f} ms")  # fmt: skip
            continue
        if "step_ms" not in r:
            lines.append(f"{r['name']:<28} {r.get('status', '')}")
            continue
        lines.append(
            f"{r['name']:<28} {r['step_ms']:>8.1f} {r['fwd_bwd_ms']:>8.1f} {r['opt_ms']:>8.1f} "
            f"{r['peak_gpu_gb']:>8.2f} {r['pinned_gb']:>9.2f} {r.get('pageable_copies', '-'):>8}  {r.get('status', '')}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Step time and peak GPU memory against offload fraction; anchors as marked points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install offloadopt[bench])")
        return
    ok = [r for r in results if "step_ms" in r]
    hybrid = sorted((r for r in ok if r["kind"] == "hybrid"), key=lambda r: r["fraction"])
    others = [r for r in ok if r["kind"] != "hybrid" and r.get("fraction") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "step_ms", "step time (ms, median)"),
        (axes[1], "peak_gpu_gb", "peak GPU memory (GB)"),
    ):
        ax.plot(
            [r["fraction"] for r in hybrid], [r[key] for r in hybrid], "o-", label="HybridAdamW"
        )
        for r in others:
            ax.scatter([r["fraction"]], [r[key]], marker="x", s=60)
            ax.annotate(
                r["name"],
                (r["fraction"], r[key]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_xlabel("offload fraction")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
