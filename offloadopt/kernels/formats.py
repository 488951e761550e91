"""The int8 block-wise formats of compressed Adam moments, in torch ops (CPU and CUDA).

A design in the spirit of Dettmers et al., "8-bit Optimizers via Block-wise Quantization"
(ICLR 2022): each tensor is cut into blocks of ``BLOCK = 256`` elements (the last one may be
shorter), each block keeps one fp32 absmax scale, and the codes are small non-linear floats
relative to that scale. The update always uses the fresh fp32 moments; they are quantized after.

exp_avg (m), a signed code: ``scale_m[b] = max |m|`` over the block;
``code = 0x80 (sign of m) | mag``, ``mag = e << 3 | f`` encodes ``t = |m| / scale_m`` (in
[0, 1], computed as ``|m| * (1 / scale_m)`` in fp32: one division a block; t may exceed 1 by
two ulps, which rounds to 1) as ``value(e, f) = 2^(e-15) * (1 + f/8)``, e in 0..15, f in 0..7;
``mag = 0`` is zero (its sign bit kept: ``0x80`` decodes to -0.0). Rounding: to nearest, ties
up, on the fp32 bit pattern of t (add 0x80000, shift right by 20, less the bias ``112 << 3``);
a t that rounds below the smallest value (t < 2^-15 * 17/16) becomes 0. Decode:
``m = +-scale_m * value(mag)``. Worst-case relative error for t in [2^-15 * 17/16, 1]: 1/16
(half of the 1/8 spacing, relative to the smaller end).

exp_avg_sq (v), stored as ``y = sqrt(v)``: ``scale_v[b] = max y``; ``code = e << 4 | f``
encodes ``t = y * (1 / scale_v)`` as ``value(e, f) = 2^(e-15) * (1 + f/16)``, e in 0..15, f in
0..15, rounded as above (add 0x40000, shift by 19, less ``112 << 4``). Code 0 is zero only for
``v == 0``: a nonzero y that rounds below the smallest nonzero value 2^-15 * 17/16 takes the
code 0x01 (never 0: a zero second moment under a nonzero first moment would blow the update
up to m/eps). Decode: ``v = (scale_v * value(code))^2``. Worst-case relative error of y for t
in [2^-15 * 17/16, 1]: 1/32 (so about 1/16 on v).

Each rule is a few integer operations on t's bits, chosen for the CPU kernel
(``cpu/int8_codes.h``): a signed code below zero is packed to a byte as 0 by saturation, so the
range needs no compare. Codes written by the earlier rule (round half to even, smallest codes
``0x08`` and ``0x10``) are codes of this one: decoding did not change.

Blocks: a block whose absmax is 0 has scale 0 and all codes 0; so has a block whose absmax is
subnormal (below 2^-126, where ``1 / scale`` overflows to inf), its values flushed to zero as
the CPU worker's flush-to-zero flushes them. A block holding a non-finite m
or v (inf or NaN; also sqrt of a negative v) gets the scale NaN for both moments and all codes
0, so the problem shows (every decoded value is NaN) instead of hiding. The element of largest
magnitude decodes to exactly its block's scale (t = 1 is a code value). Encoding uses bit
manipulation only (no table search) and vectorizes.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "decode_m", "decode_v", "encode_m", "encode_v", "nblocks"]

BLOCK = 256
_M_EXP_BIAS = 112  # fp32 exponent 127 - 15
_FLT_MIN = 2.0**-126  # the smallest normal fp32: a smaller block absmax flushes the block


def nblocks(n: int) -> int:
    """Blocks of BLOCK elements for n elements (the last may be partial)."""
    return (int(n) + BLOCK - 1) // BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(n,) -> (nblocks, BLOCK), zero padded."""
    n = x.numel()
    pad = nblocks(n) * BLOCK - n
    return torch.nn.functional.pad(x.reshape(-1), (0, pad)).view(-1, BLOCK)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> its bit pattern as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _check(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if x.dtype != dtype or x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D {dtype} tensor, got {x.dtype} {tuple(x.shape)}")


def _encode(t: torch.Tensor, shift: int) -> torch.Tensor:
    """t in [0, 1] -> e << (23 - shift) | f, rounded to nearest, ties up, on t's bits; below 0
    where t rounds below 2^-15 (int64, signed: the kernel packs a negative code as 0)."""
    return ((_bits(t) + (1 << (shift - 1))) >> shift) - (_M_EXP_BIAS << (23 - shift))


def encode_m(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg fp32 (n,) -> (codes uint8 (n,), scales fp32 (nblocks(n),)), same device.
    Non-finite blocks: scale NaN, codes 0. Raises ValueError for a non-1-D or non-fp32 m."""
    _check(m, "encode_m", torch.float32)
    mb = _blocks(m)
    t, scale, bad = _scaled(mb, mb.abs())
    mag = _encode(t, 20)
    sign = torch.where(mb.view(torch.int32) < 0, 0x80, 0)
    code = torch.where(mag >= 0, mag | sign, 0)
    return _packed(code, scale, bad, m.numel())


def _scaled(blocks: torch.Tensor, magnitude: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(magnitude / its block's absmax, the absmax (the scale), whether the block holds a
    non-finite value)`` for ``blocks`` (nblocks, BLOCK) and their magnitudes, fp32."""
    scale = magnitude.amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    scale = torch.where(scale < _FLT_MIN, 0.0, scale)  # subnormal: flushed (1 / scale is inf)
    bad = ~torch.isfinite(blocks).all(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.ones_like(scale))
    return magnitude * inv[:, None], scale, bad


def _packed(code: torch.Tensor, scale: torch.Tensor, bad: torch.Tensor, n: int):
    """The codes (uint8 (n,)) and scales of :func:`_scaled`'s blocks: a block of zeros or with a
    non-finite value has codes 0, and the latter a NaN scale."""
    code = torch.where((scale > 0)[:, None] & ~bad[:, None], code, 0)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return code.reshape(-1)[:n].to(torch.uint8), scale


def decode_m(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes (n,) and fp32 scales (nblocks(n),) -> exp_avg fp32 (n,)."""
    _check(codes, "decode_m codes", torch.uint8)
    _check(scales, "decode_m scales", torch.float32)
    if scales.numel() != nblocks(codes.numel()):
        raise ValueError(f"decode_m: {scales.numel()} scales for {codes.numel()} codes")
    c = _blocks(codes.to(torch.int64))
    mag = c & 0x7F
    bits = torch.where(mag != 0, (mag + (_M_EXP_BIAS << 3)) << 20, 0).to(torch.int32)
    val = scales[:, None] * bits.view(torch.float32)
    val = torch.where(c >= 0x80, -val, val)
    return val.reshape(-1)[: codes.numel()]


def encode_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg_sq fp32 (n,) -> (codes uint8 (n,), scales of sqrt(v) fp32 (nblocks(n),)).
    Non-finite (or negative) blocks: scale NaN, codes 0."""
    _check(v, "encode_v", torch.float32)
    return _encode_y(v.sqrt())


def _encode_y(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    yb = _blocks(y)
    t, scale, bad = _scaled(yb, yb)
    code = _encode(t, 19).clamp(min=1)
    code = torch.where(yb != 0, code, 0)
    return _packed(code, scale, bad, y.numel())


def decode_v(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes (n,) and fp32 scales (nblocks(n),) -> exp_avg_sq fp32 (n,)."""
    _check(codes, "decode_v codes", torch.uint8)
    _check(scales, "decode_v scales", torch.float32)
    if scales.numel() != nblocks(codes.numel()):
        raise ValueError(f"decode_v: {scales.numel()} scales for {codes.numel()} codes")
    c = _blocks(codes.to(torch.int64))
    bits = torch.where(c != 0, (c + (_M_EXP_BIAS << 4)) << 19, 0).to(torch.int32)
    s = scales[:, None] * bits.view(torch.float32)
    return (s * s).reshape(-1)[: codes.numel()]
