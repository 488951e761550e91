"""Stochastic rounding to bf16 and its counter-based random bits, in torch ops: the spec that
the CPU kernel (cpu/adam_body.h), the flat device pass (flat.py, flat_triton.py) and
:mod:`offloadopt.kernels.reference` follow.

Stochastic rounding to bf16: ``bits = (fp32 bits + r16) >> 16``, NaN -> 0x7FC0, +-inf
unchanged (a finite value above the largest bf16 may round up to inf, as round-to-nearest
would for most of that range), where r16 is 16 bits of a counter-based draw: element j of a
parameter (its ``counter``, ``offset + j``) under a 64-bit key per (salt, step, draw)::

    key  = mix64(salt + 0x9E3779B97F4A7C15 * (4*step + draw + 1))          (sr_key)
    bits = fmix32(lo32(counter) ^ lo32(key) ^ (hi32(counter) * 0x9E3779B9 + hi32(key)))

(32-bit arithmetic; mix64 is splitmix64's finalizer, fmix32 MurmurHash3's, a bijection on 32
bits.) Draw 1 rounds the moments: one hash per element, its low 16 bits for exp_avg, its high
16 for exp_avg_sq. Draw 0 rounds the master, one hash for two elements
(:func:`master_bits`): in each run of 8 elements of a parameter (j = 8k .. 8k + 7), element
8k + i (i < 4) takes the low 16 bits of the hash of its own counter and element 8k + 4 + i the
high 16 bits of the same hash (the CPU kernel holds the two in one lane of its two vectors,
simd.h's paired order). Keyed by position and not by thread or vector: the result does not
depend on the thread count, the ISA or where a parameter is cut (at multiples of 8).
"""

from __future__ import annotations

import torch

__all__ = [
    "DRAW_MASTER",
    "DRAW_MOMENTS",
    "M32",
    "M64",
    "master_bits",
    "round_bf16_sr",
    "sr_bits",
    "sr_key",
]

M64 = (1 << 64) - 1
M32 = 0xFFFFFFFF
DRAW_MASTER, DRAW_MOMENTS = 0, 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def sr_key(salt: int, step: float, draw: int) -> int:
    """The 64-bit key of one (salt, step, draw): splitmix64's finalizer of
    ``salt + 0x9E3779B97F4A7C15 * (4*step + draw + 1)`` (mod 2^64)."""
    s = int(step) & M64
    return _mix64((salt + 0x9E3779B97F4A7C15 * (4 * s + draw + 1)) & M64)


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
    ``fmix32(lo32(c) ^ lo32(key) ^ (hi32(c)*0x9E3779B9 + hi32(key)))`` (mod 2^32)."""
    return _sr_bits_halves(key & M32, key >> 32, counter)


def _sr_bits_halves(key_lo, key_hi, counter: torch.Tensor) -> torch.Tensor:
    """:func:`sr_bits` with the key given as its 32-bit halves: ints, or int64 tensors that
    broadcast against ``counter`` (the flat pass: one key per block, ``(nblocks, 1)``)."""
    hi = (_mul32(counter >> 32, 0x9E3779B9) + key_hi) & M32
    return _fmix32((counter & M32) ^ key_lo ^ hi)


def master_bits(key_lo, key_hi, counter: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The master's random bits (the low 16 used) of the elements at ``index`` within their
    parameter, whose counters are ``counter`` (int64, broadcasting; key halves as in
    :func:`_sr_bits_halves`): element j with ``j & 4`` set takes the high 16 bits of the hash
    of element ``j - 4``'s counter, the others the low 16 bits of their own."""
    half = index & 4
    return _sr_bits_halves(key_lo, key_hi, counter - half) >> (half * 4)


def round_bf16_sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding: ``(bits + (r & 0xFFFF)) >> 16``; NaN -> NaN
    (0x7FC0), +-inf unchanged (``r``: int64 random bits, the low 16 used)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    nonfinite = (u & 0x7F800000) == 0x7F800000
    nan = nonfinite & ((u & 0x7FFFFF) != 0)
    out = torch.where(nonfinite, u >> 16, (u + (r & 0xFFFF)) >> 16)
    out = torch.where(nan, 0x7FC0, out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.bfloat16)
