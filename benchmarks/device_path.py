"""The device path of the compressed-state update (HybridAdamW's device-resident params with
``state_dtype=`` / ``master_weights="bf16-sr"``): the flat pass over all tensors
(``kernels.adam.device_step``), eager (about 60 launches over int64 temporaries) and compiled
(``torch.compile`` of its elementwise part, CUDA's default), and with ``--per-tensor`` the
per-tensor torch-ops reference (``kernels.reference.adam_step``: ~60 launches and a host sync
per tensor); ms per step, with torch's fused AdamW (fp32 state) as the floor.

The tensors: GPT-2 124M's 148 parameter shapes, each numel divided by ``--scale`` (default 20
on the CPU, 1 on CUDA). Runs on CUDA when available, else the CPU (``--device`` to choose).
Each row: the median of ``--repeats`` steps after one warm-up step. ``--scale 2000
--repeats 1`` runs in seconds on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from offloadopt.kernels import adam, formats, reference

B16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
# name: (master dtype, moments code, weights_out)
MODES = {
    "fp32m bf16 state": (F32, 1, True),
    "fp32m int8 state": (F32, 2, True),
    "bf16m bf16 state": (B16, 1, False),
    "bf16m int8 state": (B16, 2, False),
}


def gpt2_124m_numels(d: int = 768, layers: int = 12) -> list[int]:
    """The numel of each of GPT-2 124M's 148 parameters (tied embedding counted once); with
    ``d=1600, layers=48`` GPT-2 1.5B's 580."""
    vocab, ctx = 50257, 1024
    block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return [vocab * d, ctx * d] + block * layers + [d, d]


def make_args(sizes: list[int], mode: tuple, device: str) -> dict:
    master, moments, wout = mode
    gen = torch.Generator().manual_seed(0)

    def rnd(n: int, scale: float) -> torch.Tensor:
        return (torch.randn(n, generator=gen) * scale).to(device)

    args = dict(masters=[], grads=[], exp_avgs=[], exp_avg_sqs=[], exp_avg_scales=[],
                exp_avg_sq_scales=[], weights_out=[])  # fmt: skip
    for n in sizes:
        args["masters"].append(rnd(n, 1.0).to(master))
        args["grads"].append(rnd(n, 1e-2).to(B16))
        m, v = rnd(n, 1e-3), rnd(n, 1e-3).square()
        if moments == 2:
            (cm, sm), (cv, sv) = formats.encode_m(m), formats.encode_v(v)
            args["exp_avgs"].append(cm)
            args["exp_avg_sqs"].append(cv)
            args["exp_avg_scales"].append(sm)
            args["exp_avg_sq_scales"].append(sv)
        else:
            args["exp_avgs"].append(m.to(B16))
            args["exp_avg_sqs"].append(v.to(B16))
        if wout:
            args["weights_out"].append(torch.empty(n, dtype=B16, device=device))
    t = len(sizes)
    args.update(steps=[10.0] * t, salts=list(range(t)), offsets=[0] * t, lr=1e-4, beta1=0.9,
                beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False, decoupled=True,
                grad_scale=None, moments=moments, master_sr=master == B16)  # fmt: skip
    return args


def timed(fn, repeats: int, device: str) -> float:
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=None, help="divide every numel by this")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated rows of MODES")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--per-tensor", action="store_true", help="also the per-tensor reference")
    ap.add_argument("--xl", action="store_true", help="GPT-2 1.5B's shapes (1.56e9 elements)")
    ap.add_argument("--profile", action="store_true",
                    help="after each compiled row, one step under torch.profiler: top kernels")  # fmt: skip
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    scale = a.scale or (1 if a.device.startswith("cuda") else 20)
    shapes = gpt2_124m_numels(1600, 48) if a.xl else gpt2_124m_numels()
    sizes = [max(1, n // scale) for n in shapes]
    print(f"device {a.device}  {len(sizes)} tensors  {sum(sizes):,} elements (GPT-2 "
          f"{'1.5B' if a.xl else '124M'} / {scale})  torch {torch.__version__}  threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'torch fused AdamW fp32':44s} {time_fused(sizes, a.repeats, a.device):10.2f} ms")
    for name in a.modes.split(","):
        args = make_args(sizes, MODES[name], a.device)
        rows = [("flat, eager", functools.partial(adam.device_step, compiled=False))]
        if a.device.startswith("cuda"):  # the compiled pass is the device path on CUDA only
            rows.append(("flat, compiled", functools.partial(adam.device_step, compiled=True)))
        if a.per_tensor:
            rows.insert(0, ("per tensor", reference.adam_step))
        for label, fn in rows:
            ms = timed(functools.partial(fn, **args), a.repeats, a.device)
            print(f"{name + ': ' + label:44s} {ms:10.2f} ms")
            if a.profile and label == "flat, compiled":
                profile(functools.partial(fn, **args))
        del args


def profile(fn) -> None:
    """One call of ``fn`` under torch.profiler: the kernels by GPU time, and the wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    print(f"  profiled step: {wall:.2f} ms wall")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def time_fused(sizes: list[int], repeats: int, device: str) -> float:
    ps = [torch.randn(n, device=device) for n in sizes]
    gs, ms, vs = ([torch.rand(n, device=device) * 1e-3 for n in sizes] for _ in range(3))
    steps = [torch.tensor(10.0, device=device) for _ in sizes]
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False)
    return timed(lambda: torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, **hp),
                 repeats, device)  # fmt: skip


if __name__ == "__main__":
    main()
