"""How long does the compressed update of device-resident params take at offload fraction 0,
through the per-tensor path and through the flat buffers (offloadopt/step/device_flat.py) as
each of its passes (``OFFLOADOPT_DEVICE_STEP``: triton, compiled, eager), against torch's fused
fp32 AdamW? (issue 46: int8 took 41.5 ms over GPT-2 1.5B's 580 tensors against 13.2 ms on an
H100; the target is int8 within 1.05x of fp32's step.)

One process: a GPT preset's parameter shapes (default "gpt2-xl", GPT-2 1.5B; bf16 params; two
groups, weight decay on the 2-D ones), each with a fixed grad. Step rows, each from the same
initial weights: torch.optim.AdamW(fused=True) over fp32 copies (fp32 state: the floor);
HybridAdamW(offload_fraction=0) with fp32 state (torch's fused kernel on fp32 masters, then the
bf16 cast); per mode (``--modes``: int8 = int8 moments and fp32 masters, sr8 = int8 moments
and bf16-sr masters) the per-tensor path (``OFFLOADOPT_DEVICE_FLAT=0``) and the flat path per
pass (``--steps``). Each row: the median ms of ``--repeats`` ``step()`` calls after
``--warmup`` (the first builds the state and compiles the pass), each bracketed by
``torch.cuda.synchronize()``; its ratio to torch's row; the peak GPU memory; for a flat row,
whether its params and state after the same steps are bitwise those of its oracle (compiled:
the per-tensor row, compiled too; triton: the eager flat row; eager: the per-tensor row where
that runs eager, on the CPU).

Pass rows: one flat pass of ``--pass-numel`` elements (default 2**26, a pass of the flat
buffers) timed alone, per mode and pass: ``kernels.flat.core_into`` on buffers laid out as the
optimizer's, the median of ``--repeats`` after ``--warmup`` (CUDA events), and its GB/s from
the bytes it must move (each operand read once and each result written once:
``kernels/flat_triton.py``'s table, with the per-block scalars); beside a triad over fp32
(``a = b + s * c``, 12 bytes per element) as the bus's measure.

On the CPU (``--device cpu``, a smoke test: ``--preset tiny``) the paths run the torch-ops
pass the GPU runs (the CPU's default is the C++ kernel): the flat pass forced on, the
per-tensor path's calls sent to ``adam_update(use_kernel=False)``; the passes default to eager.

Usage (GPU host, repo root): PYTHONPATH=$PWD python benchmarks/probes/device_pass.py [--out DIR]

Answer (before the Triton pass): the probe itself did not finish in the 100 s it was given on
the GPU host (its compiles). overlap_bench on the same call (2026-12-06, 0b84c2d, H100): the
flat path cut the device update's host time from 51.1 to 13.5 ms, but int8's step at fraction 0
stayed at 136.3 ms against 137.2 per tensor and 124.7 for fp32: the compiled pass's GPU time
bounds it (benchmarks/results/2026-12-06-device-flat-h100/README.md).
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


def pass_buffers(mode: str, n: int, device: str, how: str) -> tuple[list, dict, int]:
    """One flat pass of ``n`` elements (a multiple of BLOCK) as the optimizer lays it out for
    ``mode``: ``(core_into's buffers, its keywords, the bytes it must move)``."""
    from offloadopt.kernels.formats import BLOCK, encode_m, encode_v
    from offloadopt.kernels.reference import _consts, _step_scalars

    g = torch.Generator(device=device).manual_seed(0)
    blocks, sr = n // BLOCK, mode == "sr8"
    p = torch.randn(n, generator=g, device=device) * 0.02
    p = p.to(torch.bfloat16) if sr else p
    grad = (torch.randn(n, generator=g, device=device) * 1e-3).to(torch.bfloat16)
    m, m_sc = encode_m(torch.randn(n, generator=g, device=device) * 1e-4)
    v, v_sc = encode_v(torch.rand(n, generator=g, device=device) * 1e-8)
    w_out = None if sr else torch.zeros(n, dtype=torch.bfloat16, device=device)
    cuda = device.startswith("cuda")
    fl = torch.tensor(_step_scalars(1e-4 / (1 - 0.9**10), 1 - 0.999**10, 1e-8, True, cuda=cuda))
    fl_b = fl.to(device).expand(blocks, 2).contiguous()  # (blocks, 2) fp32
    it_b = torch.randint(0, 2**32, (blocks, 5), generator=g, device=device)  # (blocks, 5) int64
    it_b[:, 0] = torch.arange(blocks, device=device) * BLOCK
    first_b = torch.arange(blocks, device=device)
    wd_factor, scale = 1 - 1e-4 * 0.1, None
    if how != "eager":  # as step/device_flat.py passes them: tensors, read by the pass
        wd_factor = torch.tensor(wd_factor, device=device)
    kw = dict(wd_factor=wd_factor, grad_scale=scale, k=_consts(0.9, 0.999, 0.1, 1e-8),
              maximize=False, decoupled=True, moments=2, bf16_master=sr, cuda_div=cuda,
              compressed=True)  # fmt: skip
    bufs = [p, grad, m, m_sc, v, v_sc, w_out, fl_b, it_b, first_b]
    read = [p, grad, m, v, m_sc, v_sc, fl_b] + ([it_b, first_b] if sr else [])
    written = [p, m, v, m_sc, v_sc] + ([] if sr else [w_out])
    return bufs, kw, sum(t.numel() * t.element_size() for t in read + written)


def timed_pass(fn, device: str, warmup: int, repeats: int) -> float:
    """Median ms of ``fn()`` after ``warmup`` calls: CUDA events on the GPU, else wall time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def pass_rows(modes: list[str], steps: list[str], n: int, device: str, warmup: int,
              repeats: int) -> list[dict]:  # fmt: skip
    """The pass timed alone per mode and pass, beside a triad over fp32 (module docstring)."""
    from functools import partial

    from offloadopt.kernels.flat import core_into

    b, c = torch.randn(n, device=device), torch.randn(n, device=device)
    triad = partial(torch.add, b, c, alpha=0.5, out=torch.empty_like(b))
    ms = timed_pass(triad, device, warmup, repeats)
    rows = [dict(row="triad a = b + s*c, fp32", ms=ms, bytes_per_elem=12.0,
                 gbps=12 * n / ms / 1e6)]  # fmt: skip
    triad = b = c = None
    for mode in modes:
        for how in steps:
            bufs, kw, nbytes = pass_buffers(mode, n, device, how)
            ms = timed_pass(partial(core_into, *bufs, how=how, **kw), device, warmup, repeats)
            rows.append(dict(row=f"{mode} pass, {how}", ms=ms, bytes_per_elem=nbytes / n,
                             gbps=nbytes / ms / 1e6))  # fmt: skip
            bufs = None
            gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-xl", choices=list(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="int8,sr8", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--steps", default=None,
                    help="flat passes, comma-separated: triton, compiled, eager (default: all "
                    "three on CUDA, eager on the CPU)")  # fmt: skip
    ap.add_argument("--pass-numel", type=int, default=None,
                    help="elements of the pass timed alone, a multiple of 256 (default 2**26 on "
                    "CUDA, 2**12 on the CPU)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--out", default=None, help="folder for device_pass.json")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    steps = (a.steps or ("triton,compiled,eager" if cuda else "eager")).split(",")
    pass_numel = a.pass_numel or (2**26 if cuda else 2**12)
    if not cuda:
        on_cpu_use_the_device_pass()
    sizes = shapes(a.preset)
    numel = sum(s.numel() for s in sizes)
    name = torch.cuda.get_device_name() if cuda else "cpu"
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
        if cuda:
            torch.cuda.empty_cache()
        return snap

    row("torch fused AdamW, fp32 state", lambda ps: torch.optim.AdamW(groups(ps), fused=True))
    row("HybridAdamW, fp32 state", lambda ps: HybridAdamW(groups(ps), offload_fraction=0.0))
    # whose bits each flat pass gives: the per-tensor row runs compiled on CUDA, eager here
    oracles = {"compiled": "per tensor" if cuda else None, "triton": "eager",
               "eager": None if cuda else "per tensor"}  # fmt: skip
    for mode in a.modes.split(","):
        kw = MODES[mode]

        def build(ps, kw=kw):
            return HybridAdamW(groups(ps), offload_fraction=0.0, **kw)

        os.environ["OFFLOADOPT_DEVICE_FLAT"] = "0"
        os.environ.pop("OFFLOADOPT_DEVICE_STEP", None)
        snaps = {"per tensor": row(f"{mode}: per tensor", build, bits=True)}
        os.environ["OFFLOADOPT_DEVICE_FLAT"] = "1"
        flat_rows = {}
        for how in steps:
            os.environ["OFFLOADOPT_DEVICE_STEP"] = how
            snaps[how] = row(f"{mode}: flat, {how}", build, bits=True)
            flat_rows[how] = rows[-1]
        os.environ.pop("OFFLOADOPT_DEVICE_STEP", None)
        for how, r in flat_rows.items():
            if oracles[how] in snaps:
                n = differ(snaps[oracles[how]], snaps[how])
                r.update(bitwise=n == 0, tensors_differ=n, against=f"{mode}: {oracles[how]}")
    floor = rows[0]["ms"]
    print(f"{'row':34s} {'ms/update':>10s} {'vs torch':>9s} {'peak GB':>8s}  bitwise")
    for r in rows:
        bits = "" if "bitwise" not in r else ("yes" if r["bitwise"] else
                                              f"no ({r['tensors_differ']} tensors differ)")  # fmt: skip
        bits += f" vs {r['against']}" if "against" in r else ""
        print(f"{r['row']:34s} {r['ms']:10.2f} {r['ms'] / floor:8.2f}x {r['peak_gb']:8.2f}  {bits}")
    passes = pass_rows(a.modes.split(","), steps, pass_numel, a.device, a.warmup, a.repeats)
    print(
        f"one pass of {pass_numel:,} elements: {'row':24s} {'ms':>8s} {'B/elem':>7s} {'GB/s':>7s}"
    )
    for r in passes:
        print(f"{'':34s}{r['row']:24s} {r['ms']:8.3f} {r['bytes_per_elem']:7.2f} {r['gbps']:7.1f}")
    command = " ".join(["python", "benchmarks/probes/device_pass.py", *sys.argv[1:]])
    print(f"reproduce: {command}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "device_pass.json").write_text(json.dumps(
            dict(device=name, torch=torch.__version__, preset=a.preset, params=numel,
                 tensors=len(sizes), warmup=a.warmup, repeats=a.repeats, rows=rows,
                 pass_numel=pass_numel, passes=passes, command=command), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
