"""The kernel's time over 2**25 bf16-sr + int8 params cut into 4, 32 or 128 calls, back to back
or with 1 or 5 ms of sleep between them (the threads fall asleep): a fixed cost per call, if any.

Usage (repo root): python benchmarks/results/2026-12-07-small-buckets-h100/percall.py THREADS
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from offloadopt import kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_kernel as ck  # noqa: E402

N = 2**25
B16, U8 = torch.bfloat16, torch.uint8


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    mod = kernels.load()
    p, g = ck.filled(N, B16, -1, 1), ck.filled(N, B16, -1e-2, 1e-2)
    m, v = torch.zeros(N, dtype=U8), torch.zeros(N, dtype=U8)
    sm, sv = torch.zeros(kernels.nblocks(N)), torch.zeros(kernels.nblocks(N))
    vec = kernels.torch_vec_size()

    def calls(k: int, gap: float) -> float:
        """Kernel ms (the parallel regions' wall time) over k calls."""
        n = N // k
        t0 = mod.kernel_ns()
        for c in range(k):
            s, bs = slice(c * n, (c + 1) * n), slice(c * n // 256, (c + 1) * n // 256)
            mod.adam_step([p[s]], [g[s]], [m[s]], [v[s]], [sm[bs]], [sv[bs]], [], [10.0], [0], [0],
                          1e-4, 0.9, 0.95, 0.1, 1e-8, False, True, None, 2, True, vec, False,
                          backups=[])  # fmt: skip
            if gap:
                time.sleep(gap)
        return (mod.kernel_ns() - t0) / 1e6

    calls(4, 0)  # warm-up: the zeroed moments' pages
    print(f"threads {torch.get_num_threads()}, {N:,} params, bf16-sr master, int8 moments")
    for _ in range(2):
        for k in (4, 32, 128):
            for gap in (0, 0.001, 0.005):
                ms = calls(k, gap)
                print(
                    f"calls {k:4d} gap {gap * 1e3:3.0f} ms: kernel {ms:7.1f} ms ({ms / k:6.3f} a call)"
                )


if __name__ == "__main__":
    main()
