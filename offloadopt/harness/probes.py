"""What bounds a step of an offloaded optimizer, measured alone: torch's fused AdamW kernel on
the host, the two casts a bf16 model adds, and the pinned link's bandwidth each way. The
benchmark prints these beside the configurations it times."""

from __future__ import annotations

import math
import statistics
import time

import torch


def time_kernel(shapes: list[torch.Size], reps: int = 5) -> dict[str, float]:
    """torch's fused AdamW kernel alone over fp32 host tensors shaped like the model's params,
    and the two CPU casts it would need with bf16 grads and weights; medians in ms."""
    n = sum(math.prod(s) for s in shapes)
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    steps = [torch.zeros(()) for _ in shapes]
    kernel = []
    for i in range(reps + 1):
        t = time.perf_counter()
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, m, v, [], steps, amsgrad=False, lr=1e-4, beta1=0.9,
                            beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip
        if i:
            kernel.append((time.perf_counter() - t) * 1e3)
    del m, v
    low = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    casts = []
    for i in range(reps + 1):
        t = time.perf_counter()
        torch._foreach_copy_(grads, low)  # bf16 grad -> fp32
        torch._foreach_copy_(low, params)  # fp32 master -> bf16 weight
        if i:
            casts.append((time.perf_counter() - t) * 1e3)
    kernel_ms, casts_ms = statistics.median(kernel), statistics.median(casts)
    return {"kernel_ms": kernel_ms, "kernel_ns_per_param": kernel_ms * 1e6 / n,
            "cpu_casts_ms": casts_ms, "cpu_casts_ns_per_param": casts_ms * 1e6 / n, "params": n}  # fmt: skip


def time_link(device: torch.device, nbytes: int = 2**30, reps: int = 5) -> dict[str, float]:
    """GB/s of one pinned copy each way, for fp32 and bf16 (the cast-placement question)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = nbytes // dtype.itemsize
        host = torch.empty(n, dtype=dtype, pin_memory=True)
        dev = torch.empty(n, dtype=dtype, device=device)
        for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
            times = []
            for _ in range(reps):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                dst.copy_(src, non_blocking=True)  # pinned host side: a true async DMA
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            out[f"{name}_{str(dtype).split('.')[-1]}_gbps"] = (
                nbytes / statistics.median(times) / 1e6
            )
        del host, dev  # the caller empties the caching allocators
    return out
