"""What the main job's steps achieve: tokens per second, model TFLOPS and MFU against the
GPU's dense bf16 peak, with a measured matmul peak beside it, and the times of forward and
backward alone (``--measure-fwd-bwd``).

Model FLOPs per step = 6 x params x tokens (forward 2, backward 4 per param and token: Kaplan
et al. 2020, "Scaling laws for neural language models", section 2.1). Not counted: attention's
sequence-length term and the forward that activation checkpointing recomputes, so MFU is
model FLOPs utilization, not hardware FLOPs. The peak is the GPU's dense (no sparsity) bf16
tensor-core figure from its vendor's datasheet, looked up by the device's name
(:data:`PEAK_BF16_TFLOPS`); for an unknown GPU or the CPU, MFU is None and
:attr:`Peak.source` says why. The measured matmul (:func:`matmul_peak`: bf16 on CUDA, fp32 on
the CPU, labelled) is what this device reaches on a large square GEMM, a ceiling the table's
figure may not be.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offloadopt.harness.provenance import cpu_name

__all__ = ["PEAK_BF16_TFLOPS", "Peak", "peak_of", "MatmulPeak", "matmul_peak", "Throughput"]
__all__ += ["time_steps", "FLOPS_NOTE"]

# (all of these in the lower-cased device name, the GPU it names, dense bf16 TFLOPS): NVIDIA's
# datasheets, without sparsity; the first match wins, so the specific rows come first
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("h100", "pcie"), "H100 PCIe", 756.0),
    (("h100", "nvl"), "H100 NVL", 835.0),
    (("h100",), "H100 SXM", 989.0),
    (("gh200",), "GH200", 989.0),
    (("h200",), "H200", 989.0),
    (("a100",), "A100", 312.0),
    (("l40s",), "L40S", 362.0),
    (("b200",), "B200", 2250.0),
)
FLOPS_NOTE = ("model FLOPs = 6 x params x tokens; attention's sequence term and the forward "
              "that activation checkpointing recomputes are not counted")  # fmt: skip


@dataclass(frozen=True)
class Peak:
    """The peak MFU is taken against: ``tflops`` (None: no figure) and where it comes from."""

    device_name: str  # torch's name of the GPU, or the CPU's model name
    tflops: float | None  # dense bf16 TFLOPS, or None
    source: str  # "H100 SXM: 989 TFLOPS dense bf16 (datasheet)", or why there is none


def peak_of(device: torch.device) -> Peak:
    """The dense bf16 peak of ``device`` from :data:`PEAK_BF16_TFLOPS` (CUDA), or none (a GPU
    not in the table, the CPU), with the reason."""
    if device.type != "cuda":
        return Peak(cpu_name(), None, "no dense bf16 peak for a CPU: MFU is null (the measured "
                    "fp32 matmul stands beside the achieved TFLOPS)")  # fmt: skip
    name = torch.cuda.get_device_name(device)
    for needles, gpu, tflops in PEAK_BF16_TFLOPS:
        if all(n in name.lower() for n in needles):
            return Peak(name, tflops, f"{gpu}: {tflops:g} TFLOPS dense bf16 (datasheet)")
    return Peak(name, None, f"{name!r} is not in the table of dense bf16 peaks "
                "(offloadopt/harness/throughput.py): MFU is null")  # fmt: skip


@dataclass(frozen=True)
class MatmulPeak:
    """A measured matmul: ``n`` x ``n`` by ``n`` x ``n`` in ``dtype``, median of ``reps``."""

    tflops: float
    dtype: str  # "bf16" (CUDA) or "fp32" (CPU)
    n: int
    reps: int


def matmul_peak(device: torch.device, n: int | None = None, reps: int | None = None) -> MatmulPeak:
    """Time a square matmul on ``device``: bf16 with n = 8192 on CUDA (2 x 8192^3 = 1.1e12
    FLOPs a product: about 1.5 ms on an H100), fp32 with n = 512 on the CPU; a few untimed
    first, then the median of ``reps`` (CUDA: 10, each bracketed by ``synchronize``; CPU: 5).
    The operands are freed (and, on CUDA, their cached blocks returned) before it returns."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    reps = reps or (10 if cuda else 5)
    dtype = torch.bfloat16 if cuda else torch.float32
    times = _time_matmul(device, n, reps, dtype, warmup=3 if cuda else 1)  # operands freed
    if cuda:
        torch.cuda.empty_cache()  # their cached blocks: the model that comes next may need them
    ms = statistics.median(times)
    return MatmulPeak(2 * n**3 / (ms * 1e-3) / 1e12, "bf16" if cuda else "fp32", n, reps)


def _time_matmul(device: torch.device, n: int, reps: int, dtype: torch.dtype,
                 warmup: int) -> list[float]:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)  # the caller's RNG streams stay as they are
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)  # (n, n) on device
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    return time_steps(reps, lambda: torch.matmul(a, b, out=out), device)


def time_steps(k: int, work: Callable[[], object], device: torch.device) -> list[float]:
    """``work()`` run ``k`` times, each bracketed by ``torch.cuda.synchronize()`` on CUDA (its
    GPU work is inside the window): the wall times in ms."""
    cuda = device.type == "cuda"
    times = []
    for _ in range(k):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


@dataclass(frozen=True)
class Throughput:
    """One optimizer step's tokens and model FLOPs, and the peaks they are read against.

    Args:
        params: the model's params (``GPT.num_params()``).
        tokens_per_step: tokens of one optimizer step on this rank (batch x seq_len x
            grad_accum).
        peak: :func:`peak_of` the device.
        matmul: :func:`matmul_peak` on the device.
    """

    params: int
    tokens_per_step: int
    peak: Peak
    matmul: MatmulPeak

    @property
    def flops_per_step(self) -> int:
        return 6 * self.params * self.tokens_per_step

    def tokens_per_s(self, step_ms: float) -> float:
        return self.tokens_per_step / step_ms * 1e3

    def tflops(self, step_ms: float) -> float:
        """Model TFLOPS achieved by a step of ``step_ms``."""
        return self.flops_per_step / (step_ms * 1e-3) / 1e12

    def mfu(self, step_ms: float) -> float | None:
        """Achieved over the table's peak (a share, 0..1), or None without a peak."""
        return None if self.peak.tflops is None else self.tflops(step_ms) / self.peak.tflops

    def columns(self, step_ms: float) -> str:
        """The step line's throughput columns: tokens/s, TFLOPS, MFU (fixed width)."""
        mfu = self.mfu(step_ms)
        shown = f"{mfu:6.1%}" if mfu is not None else f"{'-':>6}"
        return (f"{self.tokens_per_s(step_ms):10,.0f} tok/s | {self.tflops(step_ms):8.3f} "
                f"TFLOPS | MFU {shown}")  # fmt: skip

    def describe(self) -> str:
        """The line before the loop: the FLOPs of a step and the two peaks."""
        m = self.matmul
        return (f"throughput: 6 x {self.params:,} params x {self.tokens_per_step:,} tokens = "
                f"{self.flops_per_step / 1e12:.4g} TFLOP per step (recompute and attention not "
                f"counted) | peak: {self.peak.source} | measured matmul: {m.tflops:.2f} TFLOPS "
                f"{m.dtype} ({m.n} x {m.n}, median of {m.reps})")  # fmt: skip

    def summary(self, step_ms: float, fwd_bwd_ms: float | None = None) -> dict:
        """The JSON's throughput fields at a step of ``step_ms`` (and, when measured, forward
        and backward alone taking ``fwd_bwd_ms`` for the same tokens)."""
        achieved = self.tflops(step_ms)
        return {
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s(step_ms),
            "model_flops_per_step": self.flops_per_step,
            "flops_note": FLOPS_NOTE,
            "achieved_tflops": achieved,
            "mfu": self.mfu(step_ms),
            "peak_tflops": self.peak.tflops,
            "peak_source": self.peak.source,
            "device_name": self.peak.device_name,
            "matmul_tflops": self.matmul.tflops,
            "matmul_dtype": self.matmul.dtype,
            "achieved_over_matmul": achieved / self.matmul.tflops,
            "fwd_bwd_ms": fwd_bwd_ms,
            "step_over_fwd_bwd": step_ms / fwd_bwd_ms if fwd_bwd_ms else None,
        }
