"""The fused CPU Adam/AdamW kernel of offloadopt.kernels against torch._fused_adamw_, per
optimizer-state mode: ns/param, GB/s and bytes moved per param.

Each mode steps N params (default 1.558e9, GPT-2 1.5B, split into --tensors equal tensors) in
one call, a median over --repeats calls after one warm-up call. Rows:
  torch fused fp32      torch._fused_adamw_ (fp32 param, grad, exp_avg, exp_avg_sq): 28 B/param
  ours fp32             the kernel in the all-fp32 mode (bitwise torch's result): 28 B/param
  fp32m bf16 state      fp32 master, bf16 grad, bf16 moments, bf16 weights out
  fp32m int8 state      fp32 master, bf16 grad, int8 moments, bf16 weights out
  bf16m bf16 state      bf16 master (stochastic rounding), bf16 grad, bf16 moments
  bf16m int8 state      bf16 master (stochastic rounding), bf16 grad, int8 moments
With --backup, the speculative update's pre-step backup (offloadopt/step/speculate.py) too:
  torch fp32 + copy     a copy of master, exp_avg, exp_avg_sq to a backup, then torch's kernel
  ours fp32 + backup    the kernel copying each cache-sized run out before updating it
                        (streaming stores): 40 B/param
  ours fp32 + backup, plain stores   the same with ordinary stores
Bytes per param count each operand read once and each written once (int8 scales included).
``passes``: the kernel's passes over each 256-element block (after the first they read L1).
Only one mode's tensors are alive at a time. ``--numel 2e7`` runs in seconds.

The bus: a STREAM triad (``a = b + s*c`` over three fp32 arrays of ``--triad-numel`` elements,
12 bytes counted per element as STREAM counts them) on the same threads in the same run; each
row's ``x bus`` is its time over (its bytes / the triad's GB/s): 1.00x runs at the triad's
bandwidth. ``x torch`` is the row's time over torch's fused fp32 kernel's in the same run
(lower is faster; before 2026-12-07 this column was "vs torch", torch's time over the row's).
``--isa`` runs the kernel on another instruction set than the best this CPU has
(``avx512``, ``avx2``, ``generic``); ``ATEN_CPU_CAPABILITY=avx2`` does the same for torch's row.

``--paired`` is for a shared or noisy host (a VM whose neighbours move torch's own time by 20%
between runs): each mode's calls alternate with torch's, call by call, with both sets of
tensors alive, and ``x torch`` is the median of the per-pair ratios (``ms`` stays the mode's
median). Its spread is printed: ``x torch lo-hi``, the ratios' quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from offloadopt import kernels

B16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
# name: (master dtype, grad dtype, moments, weights_out)
MODES = {
    "ours fp32": (F32, F32, 0, False),
    "fp32m bf16 state": (F32, B16, 1, True),
    "fp32m int8 state": (F32, B16, 2, True),
    "bf16m bf16 state": (B16, B16, 1, False),
    "bf16m int8 state": (B16, B16, 2, False),
}
STATE = {0: (F32, 4), 1: (B16, 2), 2: (U8, 1)}
HP = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def bytes_per_param(master: torch.dtype, grad: torch.dtype, moments: int, wout: bool) -> float:
    return kernels.element_nbytes(master == B16, grad == B16, moments, wout)


def triad_gbps(numel: int, repeats: int) -> float:
    """STREAM triad ``a = b + s*c`` on torch's threads: GB/s counting 12 bytes per element."""
    b = filled(numel, F32, -1, 1)
    c = filled(numel, F32, -1, 1)
    a = torch.empty_like(b)
    sec = timed(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return 12 * numel / sec / 1e9


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


_PATTERN = (
    1 << 20
)  # random values drawn once, then tiled (the kernel's time does not depend on them)


def filled(n: int, dtype: torch.dtype, lo: float, hi: float) -> torch.Tensor:
    """``(n,)`` values in [lo, hi): a block of ``_PATTERN`` uniform draws tiled over the tensor.
    torch's CPU ``uniform_`` draws from one generator serially: over 1.558e9 params per operand it
    took longer than the GPU host's 150 s budget for the whole benchmark (2026-12-03)."""
    block = torch.empty(min(n, _PATTERN), dtype=F32).uniform_(lo, hi).to(dtype)
    out = torch.empty(n, dtype=dtype)
    full = n // block.numel() * block.numel()
    if full:
        out[:full].view(-1, block.numel()).copy_(block.expand(full // block.numel(), -1))
    if n > full:
        out[full:].copy_(block[: n - full])
    return out


def run_torch(sizes: list[int], repeats: int, copy_backup: bool = False) -> float:
    """torch's kernel's median time; ``copy_backup``: after a copy of master, exp_avg and
    exp_avg_sq to a backup (speculation before the kernel's backups)."""
    return timed(torch_call(sizes, copy_backup), repeats)


def torch_call(sizes: list[int], copy_backup: bool = False):
    """One call of torch's kernel over fresh tensors of ``sizes`` (see ``run_torch``)."""
    ps = [filled(n, F32, -1, 1) for n in sizes]
    gs = [filled(n, F32, -1e-2, 1e-2) for n in sizes]
    ms = [filled(n, F32, -1e-3, 1e-3) for n in sizes]
    vs = [filled(n, F32, 1e-8, 1e-6) for n in sizes]
    bk = [torch.empty_like(t) for t in ps + ms + vs] if copy_backup else []
    step = [torch.tensor(10.0) for _ in sizes]

    def call() -> None:
        if bk:
            torch._foreach_copy_(bk, ps + ms + vs)
        torch._fused_adamw_(ps, gs, ms, vs, [], step, amsgrad=False, maximize=False, **HP)

    return call


def run_ours(mod, sizes: list[int], mode: tuple, repeats: int, backup: bool = False) -> float:
    """The kernel's median time in ``mode`` (a MODES value)."""
    return timed(ours_call(mod, sizes, mode, backup), repeats)


def ours_call(mod, sizes: list[int], mode: tuple, backup: bool = False):
    """One call of the kernel in ``mode`` over fresh tensors of ``sizes``."""
    master, grad, moments, wout = mode
    sdt = STATE[moments][0]
    ps = [filled(n, master, -1, 1) for n in sizes]
    gs = [filled(n, grad, -1e-2, 1e-2) for n in sizes]
    if moments == 2:
        ms = [torch.zeros(n, dtype=U8) for n in sizes]
        vs = [torch.zeros(n, dtype=U8) for n in sizes]
        sm = [torch.zeros(kernels.nblocks(n)) for n in sizes]
        sv = [torch.zeros(kernels.nblocks(n)) for n in sizes]
    else:
        ms = [filled(n, sdt, -1e-3, 1e-3) for n in sizes]
        vs = [filled(n, sdt, 1e-8, 1e-6) for n in sizes]
        sm, sv = [], []
    wo = [torch.empty(n, dtype=B16) for n in sizes] if wout else []
    t = len(sizes)
    bk = []
    if backup:
        for i in range(t):
            bk += [torch.empty_like(x) for x in (ps[i], ms[i], vs[i])]
            bk += [torch.empty_like(sm[i]), torch.empty_like(sv[i])] if moments == 2 else []
    vec = kernels.torch_vec_size()

    def call() -> None:
        mod.adam_step(ps, gs, ms, vs, sm, sv, wo, [10.0] * t, list(range(t)), [0] * t,
                      HP["lr"], HP["beta1"], HP["beta2"], HP["weight_decay"], HP["eps"], False,
                      True, None, moments, master == B16, vec, False, backups=bk)  # fmt: skip

    return call


def paired(first, second, repeats: int) -> tuple[float, list[float]]:
    """``second``'s median time and the sorted ratios second/first of ``repeats`` back-to-back
    pairs (one warm-up call each first): a neighbour's load moves both calls of a pair."""
    first()
    second()
    times, ratios = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        times.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(times), sorted(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=1.558e9, help="params in all (default 1.558e9)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: as is)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="*", default=None, help=f"subset of {list(MODES)}")
    ap.add_argument("--backup", action="store_true", help="add the backup rows (see above)")
    ap.add_argument("--isa", default=None, help="the kernel's ISA (default: the best here)")
    ap.add_argument("--paired", action="store_true",
                    help="alternate each mode's calls with torch's; x torch: the pairs' median")  # fmt: skip
    ap.add_argument("--triad-numel", type=float, default=2**28,
                    help="elements per triad array (default 2**28: 3 GiB in all)")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.numel)
    k = max(1, args.tensors)
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    t0 = time.perf_counter()
    mod = kernels.load()
    built = time.perf_counter() - t0
    if args.isa:
        mod.set_isa(args.isa)
    triad = triad_gbps(int(args.triad_numel), args.repeats)
    print(f"params {n:,} in {k} tensors, threads {torch.get_num_threads()}, "
          f"torch capability {torch.backends.cpu.get_cpu_capability()}, kernel ISA {mod.isa()} "
          f"x{mod.lanes()}, kernel threads {mod.num_threads_used()}, load {built:.1f} s, "
          f"repeats {args.repeats}, triad {triad:.1f} GB/s")  # fmt: skip
    print(f"{'mode':<34} {'B/param':>8} {'passes':>6} {'ms':>9} {'ns/param':>9} {'GB/s':>7} "
          f"{'x torch':>8} {'x bus':>6}" + (f" {'x torch lo-hi':>14}" if args.paired else ""))  # fmt: skip
    base_call = torch_call(sizes) if args.paired else None
    base = timed(base_call, args.repeats) if base_call else run_torch(sizes, args.repeats)

    def row(name: str, b: float, sec: float, passes: int = 1, ratios: list | None = None) -> None:
        # printed as measured: a timeout keeps the rows so far
        bus = sec / (b * n / (triad * 1e9))
        x = statistics.median(ratios) if ratios else sec / base
        spread = (
            f" {ratios[len(ratios) // 4]:>6.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
            if ratios
            else ""
        )
        print(f"{name:<34} {b:>8.2f} {passes:>6} {sec * 1e3:>9.2f} {sec / n * 1e9:>9.3f} "
              f"{b * n / sec / 1e9:>7.1f} {x:>7.2f}x {bus:>5.2f}x{spread}", flush=True)  # fmt: skip

    row("torch fused fp32", 28.0, base)
    for name, mode in MODES.items():
        if args.modes and name not in args.modes:
            continue
        passes = 1 if mode == MODES["ours fp32"] else 3 if mode[2] == 2 else 2  # over a block
        if base_call:
            sec, ratios = paired(base_call, ours_call(mod, sizes, mode), args.repeats)
            row(name, bytes_per_param(*mode), sec, passes, ratios)
        else:
            row(name, bytes_per_param(*mode), run_ours(mod, sizes, mode, args.repeats), passes)
    if args.backup:
        fp32 = MODES["ours fp32"]
        row("torch fp32 + copy", 64.0, run_torch(sizes, args.repeats, copy_backup=True))
        row("ours fp32 + backup", 40.0, run_ours(mod, sizes, fp32, args.repeats, backup=True))
        mod.set_backup_stream(False)
        try:
            row(
                "ours fp32 + backup, plain stores",
                52.0,
                run_ours(mod, sizes, fp32, args.repeats, backup=True),
            )
        finally:
            mod.set_backup_stream(True)


if __name__ == "__main__":
    main()
