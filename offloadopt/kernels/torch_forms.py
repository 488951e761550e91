"""How torch computes the steps of the eager flat pass that a kernel could round differently,
on a given device and build: which multiply-adds its kernels fuse (its CPU build's vectorized
lerp, ``add(alpha=)`` and addcmul use fused multiply-adds on AVX2, AVX-512 and NEON, its scalar
kernels do not; nvcc fuses CUDA's lerp, and its addcmul calls ``fma``), whether it divides by
a host scalar through the scalar's reciprocal (CUDA), and the bf16 bits of a NaN cast. Found
by running the ops on a few hundred values and comparing with each candidate computed exactly
on the host; :mod:`offloadopt.kernels.flat_triton` computes the form found, so its bits are the
eager pass's on any build (torch's CUDA kernels: aten/src/ATen/native/cuda/Lerp.cu,
DeviceAddCmulCdiv.cuh, BinaryDivTrueKernel.cu; CPU: native/cpu/LerpKernel.cpp,
PointwiseOpsKernel.cpp).
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import torch

__all__ = ["torch_forms"]


def _fma32(a, b, c) -> torch.Tensor:
    """``a * b + c`` rounded once to fp32 (fp32 values, tensors or floats; exact, in fractions:
    the nearest of three neighbours, ties to even)."""
    a, b, c = torch.broadcast_tensors(*(torch.as_tensor(t, dtype=torch.float32) for t in (a, b, c)))
    out = []
    for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        f = np.float32(float(exact))
        near = (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf)))
        out.append(
            min(near, key=lambda u: (abs(Fraction(float(u)) - exact), int(u.view(np.int32)) & 1))
        )
    return torch.tensor(np.array(out, dtype=np.float32))


_FORMS: dict = {}


def torch_forms(device: torch.device, w: float, c: float) -> dict[str, int]:
    """How torch computes the eager pass's fusable steps on ``device`` (lerp weight ``w`` =
    1 - beta1, addcmul value ``c`` = 1 - beta2), found once per process by running them on 512
    values and comparing with each candidate computed exactly on the host: ``LERP`` (0:
    ``fma(e - s, w, s)``, 1: ``s + w * (e - s)``; 2, 3: those of a weight >= 0.5, ``e + (w - 1)
    * (e - s)``), ``L2_FMA`` (``g.add(p, alpha=wd)`` as ``fma(p, wd, g)``), ``V_FORM`` (addcmul
    ``b + c*g*g``: 0 ``b + (c*g)*g``, 1 ``fma(c*g, g, b)``, 2 ``fma(g*g, c, b)``, 3 ``b +
    c*(g*g)``, 4 ``fma(g, g, b)``), ``GS_RECIP`` (a tensor divided by a host scalar as a product
    with its fp32 reciprocal) and ``BF16_NAN`` (the bf16 bits of any NaN cast: one value per device
    and build, 0xFFFF from torch's vectorized CPU kernels, 0x7FC0 from its scalar ones). Where none
    matches, the nearest, with a RuntimeWarning."""
    key = (device.type, w, c)
    if key in _FORMS:
        return _FORMS[key]
    gen = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(512, generator=gen) for _ in range(3))
    w, c, a = (float(np.float32(u)) for u in (w, c, 0.1))  # the fp32 values torch computes with
    s, b, q = x * abs(w), z * c, y * a  # a sum's two terms of one size: its forms differ often

    def pick(fn, args: tuple, cands: list[torch.Tensor], what: str) -> int:
        got = fn(*(t.to(device) for t in args)).cpu().view(torch.int32)
        misses = [int((got != cand.view(torch.int32)).sum()) for cand in cands]
        best = misses.index(min(misses))
        if misses[best]:
            _unknown(f"{what} matches no known form ({misses[best]} of 512 values differ "
                     "from the nearest)")  # fmt: skip
        return best

    def _unknown(what: str) -> None:
        warnings.warn(f"torch_forms: torch's {what} on {device}: the Triton pass takes the "
                      "nearest, so its bits may differ from the eager pass's by a rounding",
                      RuntimeWarning, stacklevel=4)  # fmt: skip

    d, small = y - s, abs(w) < 0.5
    lerp = [_fma32(w, d, s), s + w * d] if small else [_fma32(w - 1, d, y), y + (w - 1) * d]
    l2 = [_fma32(x, a, q), q + x * a]
    vf = [b + c * y * y, _fma32(c * y, y, b), _fma32(c, y * y, b), b + c * (y * y), _fma32(y, y, b)]
    nan = torch.tensor([0x7FC00000, -0x400000, 0x7FA12345], dtype=torch.int32).view(torch.float32)
    nan = [int(u) & 0xFFFF for u in nan.to(device).to(torch.bfloat16).cpu().view(torch.int16)]
    if len(set(nan)) != 1:
        _unknown(f"cast of NaNs to bf16 keeps their payloads ({nan})")
    forms = _FORMS[key] = dict(
        LERP=pick(lambda s, e: torch.lerp(s, e, w), (s, y), lerp, "lerp") + (0 if small else 2),
        L2_FMA=pick(lambda g, p: g.add(p, alpha=a), (q, x), l2, "add(alpha=)") == 0,
        V_FORM=pick(lambda b, g: b.addcmul(g, g, value=c), (b, y), vf, "addcmul"),
        GS_RECIP=pick(lambda g: g / 3.0, (y,), [y / torch.tensor(3.0), y * (1 / 3.0)], "div"),
        BF16_NAN=nan[0],
    )
    return forms
