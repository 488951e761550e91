"""The benchmark's results for people: one fixed-width table row per configuration, a plot of
step time and peak GPU memory against the offload fraction, and Markdown for RESULTS.md
(``python -m offloadopt.harness.report bench-out/bench.json``)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["format_table", "plot", "markdown", "sweep_summary"]


def format_table(results: list[dict[str, Any]]) -> str:
    cols = f"{'configuration':<28} {'step ms':>8} {'fwd+bwd':>8} {'opt ms':>8} {'peak GB':>8} {'pinned GB':>9} {'pageable':>8}  status"
    lines = [cols]
    for r in results:
        if r.get("kind") == "kernel":
            lines.append(f"{r['name']:<28} kernel {r['kernel_ms']:.2f} ms a step ({r['kernel_ns_per_param']:.3f} "
                         f"ns/param over {r['params']:,} params, hot in cache), CPU casts "
                         f"{r['cpu_casts_ms']:.2f} ms")  # fmt: skip
            continue
        if "step_ms" not in r:
            lines.append(f"{r['name']:<28} {r.get('status', '')}")
            continue
        lines.append(
            f"{r['name']:<28} {r['step_ms']:>8.1f} {r['fwd_bwd_ms']:>8.1f} {r['opt_ms']:>8.1f} "
            f"{r['peak_gpu_gb']:>8.2f} {r['pinned_gb']:>9.2f} {r.get('pageable_copies', '-'):>8}  {r.get('status', '')}"
        )
    lines += kernel_note(results)
    return "\n".join(lines)


def kernel_note(results: list[dict[str, Any]]) -> list[str]:
    """Why the kernel row and the hybrid rows' ``opt ms`` differ, with the figure of each that
    compares: the kernel row is torch's fused AdamW alone (ms per step), an ``opt ms`` is the
    whole ``step()`` and ``zero_grad()``, of which the worker's CPU update
    (``opt_stats_cpu_update_ms``) is the kernel's part."""
    kernel = next((r for r in results if r.get("kind") == "kernel" and "kernel_ms" in r), None)
    inside = [r for r in results if r.get("opt_stats_cpu_update_ms") and "opt_ms" in r]
    if kernel is None or not inside:
        return []
    r = max(inside, key=lambda r: r.get("fraction") or 0.0)  # the most offloaded row
    alone = f"the kernel alone: {kernel['kernel_ms']:.2f}"
    if "compressed_kernel_ms" in kernel:  # compressed state: offloadopt's kernel is the update
        alone = (f"its kernel alone ({kernel['compressed_kernel']}): "
                 f"{kernel['compressed_kernel_ms']:.2f}; torch's fp32 one: {kernel['kernel_ms']:.2f}")  # fmt: skip
    return [
        f"kernel vs opt ms: {r['name']}'s CPU update took {r['opt_stats_cpu_update_ms']:.2f} ms a "
        f"step ({alone}) of its opt ms "
        f"{r['opt_ms']:.2f}; the rest of an opt ms is step()'s own work (grad D2H and weight H2D "
        "copies, casts, handing buckets to the worker, per-param Python, zero_grad: a fixed "
        "cost per step that a small model's step is mostly made of), and the update inside a "
        "step runs on state that forward and backward pushed out of the caches"
    ]


def sweep_summary(results: list[dict[str, Any]], within: float = 1.10) -> list[str]:
    """Per overlap mode: each fraction's step over its baseline's and the largest fraction
    within ``within`` x it (every smaller one within too). The baseline is step mode's
    ``hybrid:0``, or the mode's own fraction 0 where its math differs (a clipped mode against
    fraction 0 clipped the same way: its status says "other numerics")."""
    steps: dict[str, dict[float, float | None]] = {}  # mode -> fraction -> ms (None: failed)
    own_math: dict[str, float] = {}  # mode -> its fraction 0's ms, where its math differs
    for r in results:
        named = re.fullmatch(r"hybrid(?:-([a-z-]+))?:([0-9.]+)", r["name"])
        if named is not None:
            mode, fraction = named.group(1) or "step", float(named.group(2))
            steps.setdefault(mode, {})[fraction] = r.get("step_ms")
            other = str(r.get("status", "")).startswith("other numerics")
            if fraction == 0.0 and other and r.get("step_ms") is not None:
                own_math[mode] = r["step_ms"]
    base = steps.get("step", {}).get(0.0)
    if base is None:
        return []
    lines = []
    for mode, by_fraction in steps.items():
        own = own_math.get(mode)
        ref, ref_name = (own, f"hybrid-{mode}:0") if own is not None else (base, "hybrid:0")
        sweep = sorted((f, None if ms is None else ms / ref) for f, ms in by_fraction.items())
        best = None
        for f, ratio in sweep:
            if ratio is None or ratio > within:
                break
            best = f
        shown = " ".join(
            f"{f:g}:{'failed' if ratio is None else f'{ratio:.2f}x'}" for f, ratio in sweep
        )
        # what the ratio is of, said on the line (a new user read "0:1.00x" as unexplained)
        lines.append(f"{mode}: step time over {ref_name}'s, by fraction: {shown}; largest "
                     f"fraction within {within:.2f}x: {'none' if best is None else f'{best:g}'}")  # fmt: skip
    return lines


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
    hybrid = sorted((r for r in ok if r["kind"] == "hybrid" and "(repeat)" not in r["name"]),
                    key=lambda r: r["fraction"])  # fmt: skip
    modes = list(dict.fromkeys(r.get("mode", "step") for r in hybrid))
    others = [r for r in ok if r["kind"] != "hybrid" and r.get("fraction") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "step_ms", "step time (ms, median)"),
        (axes[1], "peak_gpu_gb", "peak GPU memory (GB)"),
    ):
        for mode in modes:
            line = [r for r in hybrid if r.get("mode", "step") == mode]
            legend = "HybridAdamW" if mode == "step" else f"HybridAdamW, {mode}"
            ax.plot([r["fraction"] for r in line], [r[key] for r in line], "o-", label=legend)
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _f(x: Any, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def markdown(data: dict[str, Any]) -> str:
    """The header line, the configurations table and the kernel/link figures of a bench.json."""
    cfg = data["config"]
    out = [
        f"{cfg['preset']} ({data['params'] / 1e9:.2f}e9 params), {cfg['dtype']}, batch "
        f"{cfg['batch_size']} x {cfg['seq_len']}, {data['gpu']}, {data['cpu_threads']} CPU threads, "
        f"torch {data['torch']}; medians of {cfg['steps']} timed steps after {cfg['warmup']} "
        f"warm-up ({cfg['slow_steps']} for the slow anchors).",
        "",
        "| configuration | step ms (min-max) | fwd+bwd ms | optimizer ms | CPU update ms | peak GPU GB "
        "| optimizer host GB | pinned GB | link GB/step | pageable copies | weights vs baseline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    kernel = None
    for r in data["results"]:
        if r.get("kind") == "kernel":
            kernel = r
            continue
        if "step_ms" not in r:
            out.append(f"| {r['name']} | {r.get('status', '')} |" + " |" * 9)
            continue
        spread = f"{_f(r['step_ms'])} ({_f(r['step_ms_min'])}-{_f(r['step_ms_max'])})"
        rel = f" (RMS rel diff {r['rms_rel_diff']:.1e})" if "rms_rel_diff" in r else ""
        out.append(
            f"| {r['name']} | {spread} | {_f(r['fwd_bwd_ms'])} | {_f(r['opt_ms'])} "
            f"| {_f(r.get('opt_stats_cpu_update_ms'))} | {_f(r['peak_gpu_gb'], 2)} "
            f"| {_f(r.get('opt_host_gb') or None, 2)} | {_f(r['pinned_gb'], 2)} "
            f"| {_f(r.get('link_nbytes', 0) / 1e9, 2)} | {r.get('pageable_copies', '-')} | {r.get('status', '')}{rel} |"
        )
    if kernel:
        out += [
            "",
            f"torch's fused AdamW kernel alone on the host, fp32, {kernel['params'] / 1e9:.2f}e9 params: "
            f"{_f(kernel['kernel_ms'])} ms ({kernel['kernel_ns_per_param']:.3f} ns/param); the two CPU casts "
            f"(bf16 grad -> fp32, fp32 master -> bf16) would add {_f(kernel['cpu_casts_ms'])} ms "
            f"({kernel['cpu_casts_ns_per_param']:.3f} ns/param).",
        ]
        if "compressed_kernel_ms" in kernel:
            out.append(
                f"offloadopt's kernel alone ({kernel['compressed_kernel']}, the update of these "
                f"configurations): {_f(kernel['compressed_kernel_ms'])} ms "
                f"({kernel['compressed_kernel_ns_per_param']:.3f} ns/param)."
            )
        if "h2d_float32_gbps" in kernel:
            out.append(
                f"Pinned copies of 1 GiB: H2D {_f(kernel['h2d_float32_gbps'])} GB/s fp32, "
                f"{_f(kernel['h2d_bfloat16_gbps'])} bf16; D2H {_f(kernel['d2h_float32_gbps'])} fp32, "
                f"{_f(kernel['d2h_bfloat16_gbps'])} bf16."
            )
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m offloadopt.harness.report BENCH_JSON")
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))
