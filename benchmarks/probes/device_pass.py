"""How long does the compressed update of device-resident params take at offload fraction 0,
through the per-tensor path and through the flat buffers (offloadopt/step/device_flat.py),
against torch's fused fp32 AdamW? (issue 46: int8 took 41.5 ms over GPT-2 1.5B's 580 tensors
against 13.2 ms on an H100; the target is int8 within 1.05x of fp32's step.)

One process: a GPT preset's parameter shapes (default "gpt2-xl", GPT-2 1.5B; bf16 params; two
groups, weight decay on the 2-D ones), each with a fixed grad. Rows, each from the same initial
weights: torch.optim.AdamW(fused=True) over fp32 copies (fp32 state: the floor);
HybridAdamW(offload_fraction=0) with fp32 state (torch's fused kernel on fp32 masters, then the
bf16 cast); per mode (``--modes``: int8 = int8 moments and fp32 masters, sr8 = int8 moments
and bf16-sr masters) the per-tensor path (``OFFLOADOPT_DEVICE_FLAT=0``) and the flat path.
Each row: the median ms of ``--repeats`` ``step()`` calls after ``--warmup`` (the first builds
the state and compiles the pass), each bracketed by ``torch.cuda.synchronize()``; its ratio to
torch's row; the peak GPU memory; for a flat row, whether its params and state after the same
steps are bitwise those of the per-tensor row.

On the CPU (``--device cpu``, a smoke test: ``--preset tiny``) both paths run the torch-ops
pass the GPU runs (the CPU's default is the C++ kernel): the flat pass forced on, the
per-tensor path's calls sent to ``adam_update(use_kernel=False)``.

Usage (GPU host, repo root): python benchmarks/probes/device_pass.py [--out DIR]

Answer: the probe itself did not finish in the 100 s it was given on the GPU host (its compiles).
overlap_bench on the same call (2026-12-06, 0b84c2d, H100): the flat path cut the device
update's host time from 51.1 to 13.5 ms, but int8's step at fraction 0 stayed at 136.3 ms
against 137.2 per tensor and 124.7 for fp32: the compiled pass's GPU time bounds it
(benchmarks/results/2026-12-06-device-flat-h100/README.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from offloadopt import HybridAdamW
from offloadopt.harness.gpt import GPT, PRESETS

MODES = {"int8": dict(state_dtype="int8"),
         "sr8": dict(state_dtype="int8", master_weights="bf16-sr")}  # fmt: skip


def shapes(preset: str) -> list[torch.Size]:
    """The preset's parameter shapes (the tied head once), built on the meta device."""
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    return [p.shape for p in model.parameters()]


def make(sizes: list[torch.Size], dtype: torch.dtype, device: str):
    """Params (N(0, 0.02)) and fixed grads (N(0, 1e-3)), the same for every row."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.02).to(dtype))
              for s in sizes]  # fmt: skip
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(dtype)
    return params


def groups(params) -> list[dict]:
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(opt, device: str, warmup: int, repeats: int) -> tuple[float, float]:
    """(median ms per step(), peak GPU GB or 0 on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t = time.perf_counter()
        opt.step()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else 0.0
    return statistics.median(times), peak


def snapshot(opt, params) -> list[torch.Tensor]:
    out = [p.detach().to("cpu", copy=True) for p in params]
    for p in params:
        out += [t.detach().to("cpu", copy=True) for _, t in sorted(opt.state[p].items())]
    return out


def differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """How many tensors differ in any bit."""
    return sum(
        not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def on_cpu_use_the_device_pass() -> None:
    """CPU tensors through the GPU's torch-ops pass on both paths (module docstring)."""
    import offloadopt.step.update as update
    from offloadopt.kernels import adam
    from offloadopt.step import device_flat

    device_flat.takes_flat = lambda device: os.environ.get("OFFLOADOPT_DEVICE_FLAT") != "0"
    update.adam_update = lambda *a, **k: adam.adam_update(*a, use_kernel=False, **k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-xl", choices=list(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="int8,sr8", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--out", default=None, help="folder for device_pass.json")
    a = ap.parse_args()
    if a.device == "cpu":
        on_cpu_use_the_device_pass()
    sizes = shapes(a.preset)
    numel = sum(s.numel() for s in sizes)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"{name} · torch {torch.__version__} · {a.preset}: {numel:,} params in {len(sizes)} "
          f"tensors (bf16) · warmup {a.warmup}, median of {a.repeats}")  # fmt: skip
    rows = []

    def row(label: str, build, bits=None):
        params = make(sizes, torch.float32 if label.startswith("torch") else torch.bfloat16,
                      a.device)  # fmt: skip
        opt = build(params)
        ms, peak = timed(opt, a.device, a.warmup, a.repeats)
        snap = snapshot(opt, params) if bits is not None else None
        rows.append(dict(row=label, ms=ms, peak_gb=peak))
        del opt, params
        gc.collect()
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return snap

    row("torch fused AdamW, fp32 state", lambda ps: torch.optim.AdamW(groups(ps), fused=True))
    row("HybridAdamW, fp32 state", lambda ps: HybridAdamW(groups(ps), offload_fraction=0.0))
    for mode in a.modes.split(","):
        kw = MODES[mode]
        os.environ["OFFLOADOPT_DEVICE_FLAT"] = "0"
        before = row(f"{mode}: per tensor", lambda ps, kw=kw: HybridAdamW(
            groups(ps), offload_fraction=0.0, **kw), bits=True)  # fmt: skip
        os.environ["OFFLOADOPT_DEVICE_FLAT"] = "1"
        after = row(f"{mode}: flat", lambda ps, kw=kw: HybridAdamW(
            groups(ps), offload_fraction=0.0, **kw), bits=True)  # fmt: skip
        n = differ(before, after)
        rows[-1]["bitwise"] = n == 0
        rows[-1]["tensors_differ"] = n
    floor = rows[0]["ms"]
    print(f"{'row':34s} {'ms/update':>10s} {'vs torch':>9s} {'peak GB':>8s}  bitwise per tensor")
    for r in rows:
        bits = "" if "bitwise" not in r else ("yes" if r["bitwise"] else
                                              f"no ({r['tensors_differ']} tensors differ)")  # fmt: skip
        print(f"{r['row']:34s} {r['ms']:10.2f} {r['ms'] / floor:8.2f}x {r['peak_gb']:8.2f}  {bits}")
    command = " ".join(["python", "benchmarks/probes/device_pass.py", *sys.argv[1:]])
    print(f"reproduce: {command}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "device_pass.json").write_text(json.dumps(
            dict(device=name, torch=torch.__version__, preset=a.preset, params=numel,
                 tensors=len(sizes), warmup=a.warmup, repeats=a.repeats, rows=rows,
                 command=command), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
