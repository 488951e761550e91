"""The kernel's math in plain torch ops (CPU and CUDA tensors): the tests' reference, and the
step for device-resident parameters with compressed state.

``adam_step`` takes the same arguments as the compiled kernel's ``adam_step`` (see
``offloadopt.kernels``) except ``vec_size`` and ``flush_denormal`` (accepted and ignored), and
the tensors may be on any one device. Per element, in fp32, with the scalars computed in double
and cast to float as torch does::

    g = grad / grad_scale; g = -g if maximize
    Adam: g = g + p*wd          AdamW: p = p*(1 - lr*wd)          (when wd != 0)
    m = lerp(m, g, 1 - beta1);  v = v*beta2 + (1 - beta2)*g*g
    p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

The stochastic rounding draws the same bits as the kernel (``sr_bits``: integer ops on int64
masked to 32 bits, no overflow). Results equal the kernel's up to the order of fp32 operations
(the kernel writes its FMAs out; torch's elementwise CPU kernels may or may not fuse).
"""

from __future__ import annotations

import math
import struct

import torch

from offloadopt.kernels.formats import BLOCK, _encode_y, decode_m, decode_v, encode_m

__all__ = ["adam_step", "round_bf16_sr", "sr_bits", "sr_key"]

M64 = (1 << 64) - 1
M32 = 0xFFFFFFFF
STREAM_MASTER, STREAM_EXP_AVG, STREAM_EXP_AVG_SQ = 0, 1, 2


def _f32(x: float) -> float:
    """x rounded to fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def sr_key(salt: int, step: float, stream: int) -> int:
    """The 64-bit key of one (salt, step, stream): splitmix64's finalizer of
    ``salt + 0x9E3779B97F4A7C15 * (4*step + stream + 1)`` (mod 2^64)."""
    s = int(step) & M64
    return _mix64((salt + 0x9E3779B97F4A7C15 * (4 * s + stream + 1)) & M64)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_bits(key: int, counter: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) per int64 counter under a 64-bit key:
    ``fmix32(fmix32(lo32(c) ^ lo32(key)) ^ hi32(key) ^ hi32(c)*0x9E3779B9)``."""
    x = _fmix32((counter & M32) ^ (key & M32))
    hi = _mul32(counter >> 32, 0x9E3779B9)
    return _fmix32(x ^ (key >> 32) ^ hi)


def round_bf16_sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding: ``(bits + (r & 0xFFFF)) >> 16``; NaN -> NaN
    (0x7FC0), +-inf unchanged."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    nonfinite = (u & 0x7F800000) == 0x7F800000
    nan = nonfinite & ((u & 0x7FFFFF) != 0)
    out = torch.where(nonfinite, u >> 16, (u + (r & 0xFFFF)) >> 16)
    out = torch.where(nan, 0x7FC0, out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.bfloat16)


def adam_step(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
              weights_out, steps, salts, offsets, lr, beta1, beta2, weight_decay, eps, maximize,
              decoupled, grad_scale, moments, master_sr, vec_size=None, flush_denormal=False):  # fmt: skip
    """The fused step in torch ops; updates the tensors in place like the kernel. Raises
    ValueError for mismatched lists or modes (the per-tensor checks are the kernel's)."""
    n_t = len(masters)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("steps", steps), ("salts", salts), ("offsets", offsets)):  # fmt: skip
        if len(lst) != n_t:
            raise ValueError(f"adam_step: {name} has {len(lst)} entries; masters has {n_t}")
    if moments not in (0, 1, 2):
        raise ValueError(f"adam_step: moments={moments}; expected 0, 1 or 2")
    for i in range(n_t):
        p_in = masters[i]
        bf16_master = p_in.dtype == torch.bfloat16
        if bf16_master != bool(master_sr):
            raise ValueError("adam_step: master_sr=True goes with bf16 masters and only with them")
        step = float(steps[i])
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        step_size = lr / bc1
        p = p_in.float()
        g = grads[i].float()
        if grad_scale is not None:
            g = g / _f32(float(grad_scale))
        if maximize:
            g = -g
        if weight_decay != 0:
            if decoupled:
                p = p * _f32(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=_f32(weight_decay))
        n = p.numel()
        if moments in (0, 1):
            m0, v0 = exp_avgs[i].float(), exp_avg_sqs[i].float()
        else:
            m0 = decode_m(exp_avgs[i], exp_avg_scales[i])
            v0 = decode_v(exp_avg_sqs[i], exp_avg_sq_scales[i])
        m = torch.lerp(m0, g, _f32(1 - beta1))
        v = (v0 * _f32(beta2)).addcmul_(g, g, value=_f32(1 - beta2))
        y = v.sqrt()
        denom = (y / _f32(math.sqrt(bc2))).add_(_f32(eps))
        p = p + (m * _f32(-step_size)) / denom
        counter = None
        if bf16_master or moments == 1:
            counter = offsets[i] + torch.arange(n, dtype=torch.int64, device=p.device)
        if bf16_master:
            r = sr_bits(sr_key(salts[i], step, STREAM_MASTER), counter)
            p_in.copy_(round_bf16_sr(p, r))
        else:
            p_in.copy_(p)
            if weights_out:
                weights_out[i].copy_(p.to(torch.bfloat16))
        if moments == 0:
            exp_avgs[i].copy_(m)
            exp_avg_sqs[i].copy_(v)
        elif moments == 1:
            exp_avgs[i].copy_(round_bf16_sr(m, sr_bits(sr_key(salts[i], step, 1), counter)))
            exp_avg_sqs[i].copy_(round_bf16_sr(v, sr_bits(sr_key(salts[i], step, 2), counter)))
        else:
            cm, sm = encode_m(m)
            cv, sv = _encode_y(y)
            bad = torch.isnan(sm) | torch.isnan(sv)
            if bool(bad.any()):
                rows = bad.repeat_interleave(BLOCK)[:n]
                cm = torch.where(rows, 0, cm).to(torch.uint8)
                cv = torch.where(rows, 0, cv).to(torch.uint8)
                nan = torch.full_like(sm, float("nan"))
                sm, sv = torch.where(bad, nan, sm), torch.where(bad, nan, sv)
            exp_avgs[i].copy_(cm)
            exp_avg_sqs[i].copy_(cv)
            exp_avg_scales[i].copy_(sm)
            exp_avg_sq_scales[i].copy_(sv)
