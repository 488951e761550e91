"""What bounds a step of an offloaded optimizer, measured alone: torch's fused AdamW kernel on
the host, the two casts a bf16 model adds, and the pinned link's bandwidth each way. The
benchmark prints these beside the configurations it times."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch


def time_kernel(shapes: list[torch.Size], reps: int = 5) -> dict[str, float]:
    """torch's fused AdamW kernel alone over fp32 host tensors shaped like the model's params,
    and the two CPU casts it would need with bf16 grads and weights: medians in ms per call
    (one optimizer step), and the same per param in ns.

    The kernel is hot in cache here. A model under 2**24 params takes at least 25
    repetitions: on a shared 2-core host a repetition can stall for hundreds of ms (an
    OpenMP worker descheduled), which a median of 5 once reported as ~500 ns/param for a
    kernel of about 0.5. ``kernel_max_ms`` keeps the slowest repetition.
    """
    n = sum(math.prod(s) for s in shapes)
    reps = max(reps, 25) if n < 2**24 else reps
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
        if i:  # the first call pays for first touches
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
            "kernel_max_ms": max(kernel), "reps": reps,
            "cpu_casts_ms": casts_ms, "cpu_casts_ns_per_param": casts_ms * 1e6 / n, "params": n}  # fmt: skip


def time_compressed_kernel(
    shapes: list[torch.Size], state_dtype: str, bf16_master: bool, reps: int = 5
) -> dict[str, Any]:
    """offloadopt's own kernel (the compressed representations' CPU update,
    docs/compressed-state.md) alone over host tensors shaped like the model's params, in the
    representation a run with these options updates offloaded params in: fp32 masters and
    grads, or (``bf16_master``: ``master_weights="bf16-sr"`` on a bf16 model) bf16 weights and
    grads; moments per ``state_dtype``. Median ms per call (one optimizer step) and ns per
    param, as :func:`time_kernel` reports torch's. Raises KernelBuildError without a compiler."""
    from offloadopt import kernels
    from offloadopt.kernels.adam import MOMENT_CODES

    mod = kernels.load()
    n = sum(math.prod(s) for s in shapes)
    reps = max(reps, 25) if n < 2**24 else reps
    moments = MOMENT_CODES[state_dtype]
    wdt = torch.bfloat16 if bf16_master else torch.float32
    sizes = [math.prod(s) for s in shapes]
    masters = [torch.randn(k).to(wdt) for k in sizes]
    grads = [torch.randn(k).to(wdt) * 1e-2 for k in sizes]
    sdt = {0: torch.float32, 1: torch.bfloat16, 2: torch.uint8}[moments]
    m = [torch.zeros(k, dtype=sdt) for k in sizes]
    v = [torch.zeros(k, dtype=sdt) for k in sizes]
    scales = [[torch.zeros(kernels.nblocks(k)) for k in sizes] if moments == 2 else []
              for _ in range(2)]  # fmt: skip
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        mod.adam_step(masters=masters, grads=grads, exp_avgs=m, exp_avg_sqs=v,
                      exp_avg_scales=scales[0], exp_avg_sq_scales=scales[1], weights_out=[],
                      steps=[float(i + 1)] * len(sizes), salts=list(range(len(sizes))),
                      offsets=[0] * len(sizes), lr=1e-4, beta1=0.9, beta2=0.95,
                      weight_decay=0.1, eps=1e-8, maximize=False, decoupled=True,
                      grad_scale=None, moments=moments, master_sr=bf16_master,
                      vec_size=kernels.torch_vec_size(), flush_denormal=True)  # fmt: skip
        if i:
            times.append((time.perf_counter() - t) * 1e3)
    ms = statistics.median(times)
    what = f"{'bf16-sr' if bf16_master else 'fp32'} masters, {state_dtype} moments"
    return {"compressed_kernel_ms": ms, "compressed_kernel_ns_per_param": ms * 1e6 / n,
            "compressed_kernel": what}  # fmt: skip


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


def time_kernel_under_link(
    device: torch.device,
    n_params: int,
    link_nbytes: int,
    reps: int = 3,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """torch's fused AdamW over ``n_params`` host elements of ``dtype`` (params, grads and
    both moments; fp32 is the fp32-master layout, bf16 the layout without masters), run on the
    training thread and on an offloadopt worker (flush-to-zero), alone and while
    ``link_nbytes`` cross the link each way (pinned, 64 MiB copies on two side streams): the
    CPU pass as the offloaded step sees it. Medians in ms, and ns per param."""
    from offloadopt.link.worker import Worker, usable_cores

    tensors = [torch.randn(n_params).to(dtype), torch.randn(n_params).to(dtype),
               torch.zeros(n_params, dtype=dtype), torch.zeros(n_params, dtype=dtype)]  # fmt: skip
    step = torch.zeros(())
    chunk = 64 * 2**20
    count = max(1, link_nbytes // chunk)
    host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def kernel() -> None:
        step.add_(1)
        w, g, m, v = tensors
        torch._fused_adamw_([w], [g], [m], [v], [], [step], amsgrad=False, lr=1e-4, beta1=0.9,
                            beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip

    def traffic() -> None:
        for _ in range(count):
            with torch.cuda.stream(streams[0]):
                host[0].copy_(dev[0], non_blocking=True)  # D2H, pinned: async
            with torch.cuda.stream(streams[1]):
                dev[1].copy_(host[1], non_blocking=True)  # H2D, pinned: async

    def timed(run_kernel, with_link: bool) -> float:
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            if with_link:
                traffic()
            t = time.perf_counter()
            run_kernel()
            times.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize(device)
        return statistics.median(times[1:])

    worker = Worker(usable_cores(), flush_denormal=True)

    def on_worker() -> None:
        worker.submit(kernel, "probe").wait(600)

    out = {"params": n_params, "dtype": str(dtype), "link_nbytes_each_way": count * chunk}
    for name, fn in (("main", kernel), ("worker", on_worker)):
        for link in (False, True):
            ms = timed(fn, link)
            key = f"{name}_{'link' if link else 'alone'}"
            out[f"{key}_ms"], out[f"{key}_ns_per_param"] = ms, ms * 1e6 / n_params
    worker.close()
    return out
