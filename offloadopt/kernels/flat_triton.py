"""The flat pass (:func:`offloadopt.kernels.flat._core_into`) as one Triton kernel: each
program reads whole 256-element blocks once (decode, AdamW, absmax, encode, stochastic
rounding in registers) and writes the pass's buffers in place, with no temporaries.

Bytes per element (B/el) read + written, besides the per-block scalars (``fl_b`` 8 B a block;
with a draw ``it_b`` and ``first_b``, 48 B; int8: two fp32 scales read and written, 16 B):

==========================================  ===================  ==============  ======
master (grads)                              moments              read + write    B/el
==========================================  ===================  ==============  ======
fp32, bf16 weights out (bf16 grads)         int8 codes           8 + 8           16
fp32, bf16 weights out                      bf16 (stochastic)    10 + 10         20
fp32, bf16 weights out                      fp32                 14 + 14         28
fp32, its own master (fp32 grads)           int8 codes           10 + 6          16
bf16-sr, its own master (bf16 grads)        int8 codes           6 + 4           10
bf16-sr                                     bf16 (stochastic)    8 + 6           14
bf16-sr                                     fp32                 12 + 10         22
==========================================  ===================  ==============  ======

Bits: the eager pass's on the same device, every one (NaNs included: tests/test_flat_triton.py
under Triton's CPU interpreter, tests/cuda/test_device_flat_cuda.py on the GPU). The kernel does
the same correctly rounded fp32 operations in the same order (IEEE ``div_rn`` and ``sqrt_rn``),
compiled with ``enable_fp_fusion=False`` so that no multiply and add fuse unless torch fuses them
too; where torch's kernels fuse or take a reciprocal, the kernel computes the form that
:func:`offloadopt.kernels.torch_forms.torch_forms` found torch to compute on the device. The
hash and the int8 codes are integer ops (uint32 wraps as the reference's ``& 0xFFFFFFFF``).
One exception, on the CPU only: torch's fp32 ``sqrt`` there is one ulp off in about 1 element
in 6 (MKL's vectorized sqrt), the kernel's is exact (as torch's on CUDA), so the interpreter's
bits are those of the eager pass with an exact sqrt. GB/s on the GPU host:
benchmarks/probes/device_pass.py (not yet measured).
"""

from __future__ import annotations

import contextlib
import os

import torch

from offloadopt.kernels.formats import BLOCK
from offloadopt.kernels.torch_forms import torch_forms

__all__ = ["available", "triton_into"]

BLOCKS_PER_PROGRAM = 4  # blocks of BLOCK elements per program (a power of 2)
NUM_WARPS = 4
tl = None  # triton.language, imported with the kernel (_kernel): the body reads it at compile


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_AVAILABLE: dict = {}


def available(device: torch.device) -> bool:
    """Whether :func:`triton_into` can run on ``device``: triton is importable and the device
    is an NVIDIA GPU of compute capability 8.0 or more, or ``TRITON_INTERPRET=1`` (Triton's
    CPU interpreter: the tests). Found once per device (and interpreter setting)."""
    key = (str(device), _interpreting())
    if key not in _AVAILABLE:
        try:
            import triton  # noqa: F401

            _AVAILABLE[key] = key[1] or (
                device.type == "cuda"
                and torch.version.hip is None
                and torch.cuda.get_device_capability(device) >= (8, 0)
            )
        except ImportError:
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


# The kernel and its helpers, plain functions here: _kernel() gives them a namespace of their
# own per mode (compiled, or the interpreter's), so both can live in one process (the tests
# interpret on the CPU beside the GPU's compiled kernel).
def _as_f32(x, BF16: tl.constexpr):
    """fp32 of loaded fp32 values, or of bf16 loaded as int16 (exact: the bits shifted)."""
    if BF16:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def _sr_bits(counter, key_lo, key_hi):
    """rounding._sr_bits_halves in uint32 (which wraps mod 2^32)."""
    hi = (counter >> 32).to(tl.uint32) * 0x9E3779B9 + key_hi.to(tl.uint32)
    x = counter.to(tl.uint32) ^ key_lo.to(tl.uint32) ^ hi
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def _round_sr(x, r):
    """rounding.round_bf16_sr: the bf16 bits as int16 (no overflow: finite bits + 0xFFFF <
    2^32)."""
    u = x.to(tl.uint32, bitcast=True)
    nonfinite = (u & 0x7F800000) == 0x7F800000
    out = tl.where(nonfinite, u >> 16, (u + (r & 0xFFFF)) >> 16)
    out = tl.where(nonfinite & ((u & 0x7FFFFF) != 0), 0x7FC0, out)
    return out.to(tl.int16)


def _encode(u, SHIFT: tl.constexpr):
    """formats._encode on fp32 bits ``u`` (uint32): e << (23 - SHIFT) | f, below 0 where t
    rounds below 2^-15 (int32). The rounding add is split so it cannot carry out of 32 bits."""
    r = (u >> SHIFT) + (((u & ((1 << SHIFT) - 1)) + (1 << (SHIFT - 1))) >> SHIFT)
    return r.to(tl.int32) - (112 << (23 - SHIFT))


def _flat_kernel(p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr, w_ptr, fl_ptr, it_ptr, first_ptr,
                 wdf, gs, n_blocks, fl_s0, fl_s1, it_s0, it_s1, w_lerp, beta2, c_v, eps, wd,
                 P_BF16: tl.constexpr, G_BF16: tl.constexpr, MOMENTS: tl.constexpr,
                 W_OUT: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
                 WDF: tl.constexpr, GS: tl.constexpr, COMPRESSED: tl.constexpr,
                 CUDA_DIV: tl.constexpr, LERP: tl.constexpr, L2_FMA: tl.constexpr,
                 V_FORM: tl.constexpr, GS_RECIP: tl.constexpr, BF16_NAN: tl.constexpr,
                 BPP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP)  # (BPP,) blocks
    live = rows < n_blocks
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + cols[None, :]
    mask = live[:, None]
    p = _as_f32(tl.load(p_ptr + offs, mask=mask, other=0), P_BF16)
    g = _as_f32(tl.load(g_ptr + offs, mask=mask, other=0), G_BF16)
    ss = tl.load(fl_ptr + rows * fl_s0, mask=live, other=0)[:, None]
    d = tl.load(fl_ptr + rows * fl_s0 + fl_s1, mask=live, other=1)[:, None]
    # _adam_math, op for op
    if GS == 2:
        gs = tl.load(gs)
    if GS != 0:
        if GS_RECIP:
            g = g * tl.div_rn(1.0, gs)
        else:
            g = tl.div_rn(g, gs)
    if MAXIMIZE:
        g = -g
    if WD == 1:  # decoupled
        if WDF == 2:
            wdf = tl.load(wdf)
        p = p * wdf
    elif WD == 2:  # L2
        if L2_FMA:
            g = tl.fma(p, wd, g)
        else:
            g = g + p * wd
    if MOMENTS == 2:
        ms = tl.load(ms_ptr + rows, mask=live, other=0)[:, None]
        vs = tl.load(vs_ptr + rows, mask=live, other=0)[:, None]
        cm = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
        mag = cm & 0x7F
        m0 = ms * tl.where(mag != 0, (mag + (112 << 3)) << 20, 0).to(tl.float32, bitcast=True)
        m0 = tl.where(cm >= 0x80, -m0, m0)
        cv = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
        s = vs * tl.where(cv != 0, (cv + (112 << 4)) << 19, 0).to(tl.float32, bitcast=True)
        v0 = s * s
    else:
        m0 = _as_f32(tl.load(m_ptr + offs, mask=mask, other=0), MOMENTS == 1)
        v0 = _as_f32(tl.load(v_ptr + offs, mask=mask, other=0), MOMENTS == 1)
    diff = g - m0
    if LERP == 0:
        m = tl.fma(diff, w_lerp, m0)
    elif LERP == 1:
        m = m0 + w_lerp * diff
    elif LERP == 2:
        m = tl.fma(diff, w_lerp - 1.0, g)
    else:
        m = g + (w_lerp - 1.0) * diff
    vb = v0 * beta2
    if V_FORM == 0:
        v = vb + (c_v * g) * g
    elif V_FORM == 1:
        v = tl.fma(c_v * g, g, vb)
    elif V_FORM == 2:
        v = tl.fma(g * g, c_v, vb)
    elif V_FORM == 3:
        v = vb + c_v * (g * g)
    else:
        v = tl.fma(g, g, vb)
    y = tl.sqrt_rn(v)
    if COMPRESSED:
        den = y + d
    elif CUDA_DIV:
        den = y * d + eps
    else:
        den = tl.div_rn(y, d) + eps
    p = p + tl.div_rn(m * ss, den)
    # the outputs: _flat_core's, in place
    if P_BF16 or MOMENTS == 1:
        first = tl.load(first_ptr + rows, mask=live, other=0)
        it = it_ptr + rows * it_s0
        base = tl.load(it, mask=live, other=0) + (rows - first) * BLOCK
        counter = base[:, None] + cols[None, :]
    if P_BF16:
        lo = tl.load(it + it_s1, mask=live, other=0)[:, None]
        hi = tl.load(it + 2 * it_s1, mask=live, other=0)[:, None]
        half = (cols & 4)[None, :]  # rounding.master_bits: one hash for elements j, j + 4
        r = _sr_bits(counter - half, lo, hi) >> (half * 4)
        tl.store(p_ptr + offs, _round_sr(p, r), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
        if W_OUT:  # round to nearest even; a NaN as torch casts it on this device
            u = p.to(tl.uint32, bitcast=True)
            w = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            w = tl.where((u & 0x7FFFFFFF) > 0x7F800000, BF16_NAN, w)
            tl.store(w_ptr + offs, w.to(tl.int16), mask=mask)
    if MOMENTS == 0:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    elif MOMENTS == 1:
        lo = tl.load(it + 3 * it_s1, mask=live, other=0)[:, None]
        hi = tl.load(it + 4 * it_s1, mask=live, other=0)[:, None]
        r = _sr_bits(counter, lo, hi)
        tl.store(m_ptr + offs, _round_sr(m, r), mask=mask)
        tl.store(v_ptr + offs, _round_sr(v, r >> 16), mask=mask)
    else:  # formats.encode_m / _encode_y and _flat_core's non-finite blocks
        um = m.to(tl.uint32, bitcast=True)
        uy = y.to(tl.uint32, bitcast=True)
        # tl.reduce with Triton's own max: tl.max is jitted once, at triton's import, compiled
        # or interpreted (TRITON_INTERPRET then), so it cannot serve both; the interpreter
        # knows _elementwise_max (numpy's max) and the compiler takes it as any combine
        bad_m = ((um & 0x7F800000) == 0x7F800000).to(tl.int32)
        bad_y = ((uy & 0x7F800000) == 0x7F800000).to(tl.int32)
        bad = tl.reduce(bad_m | bad_y, 1, tl.standard._elementwise_max) != 0
        am = tl.abs(m)
        sm = tl.reduce(am, 1, tl.standard._elementwise_max)  # a NaN's block: NaN scales below
        sm = tl.where(sm < 1.1754943508222875e-38, 0.0, sm)  # subnormal: flushed (formats.py)
        sv = tl.reduce(y, 1, tl.standard._elementwise_max)
        sv = tl.where(sv < 1.1754943508222875e-38, 0.0, sv)
        inv_m = tl.div_rn(1.0, tl.where(sm > 0, sm, 1.0))  # 1 / scale, 1 where not > 0
        inv_v = tl.div_rn(1.0, tl.where(sv > 0, sv, 1.0))
        t = (am * inv_m[:, None]).to(tl.uint32, bitcast=True)
        mag = _encode(t, 20)
        code = tl.where(mag >= 0, mag | tl.where(um >= 0x80000000, 0x80, 0), 0)
        code = tl.where(((sm > 0) & ~bad)[:, None], code, 0)
        tl.store(m_ptr + offs, code.to(tl.uint8), mask=mask)
        t = (y * inv_v[:, None]).to(tl.uint32, bitcast=True)
        code = tl.maximum(_encode(t, 19), 1)
        code = tl.where(y != 0, code, 0)
        code = tl.where(((sv > 0) & ~bad)[:, None], code, 0)
        tl.store(v_ptr + offs, code.to(tl.uint8), mask=mask)
        nan = tl.full([BPP], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)  # torch's NaN
        tl.store(ms_ptr + rows, tl.where(bad, nan, sm), mask=live)
        tl.store(vs_ptr + rows, tl.where(bad, nan, sv), mask=live)


_KERNELS: dict = {}


def _kernel(interpret: bool):
    """The jitted kernel (``interpret``: Triton's interpreter's), made once per mode."""
    global tl
    kern = _KERNELS.get(interpret)
    if kern is None:
        import types

        import triton.language
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        tl = triton.language
        wrap = InterpretedFunction if interpret else JITFunction
        ns = dict(globals())
        for name in ("_as_f32", "_sr_bits", "_round_sr", "_encode", "_flat_kernel"):
            fn = globals()[name]
            new = types.FunctionType(fn.__code__, ns, name, fn.__defaults__)
            new.__annotations__, new.__module__ = fn.__annotations__, fn.__module__
            new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
            ns[name] = wrap(new)
        kern = _KERNELS[interpret] = ns["_flat_kernel"]
    return kern


def _scalar(x) -> tuple[int, object]:
    """A scalar argument as the kernel takes it: (0, unused), (1, a float), (2, a tensor read
    through its pointer, so a new value does not recompile)."""
    if x is None:
        return 0, 1.0
    if isinstance(x, torch.Tensor):
        return 2, x
    return 1, float(x)


def triton_into(p, g, m, m_sc, v, v_sc, w_out, fl_b, it_b, first_b, *, wd_factor, grad_scale,
                k, maximize, decoupled, moments, bf16_master, cuda_div, compressed,
                weights_out=None) -> None:  # fmt: skip
    """:func:`offloadopt.kernels.flat._core_into` (the same arguments and results) in one
    launch: ``p``, ``g``, ``m``, ``v`` (and ``w_out``) contiguous 1-D of ``BLOCK`` x the blocks
    of ``fl_b`` elements; ``wd_factor`` / ``grad_scale`` floats, 0-dim fp32 tensors on the
    device (read by the kernel) or None; ``weights_out``, if given, must say whether ``w_out``
    is. The results are those of the eager pass given the scalars' values (module docstring).
    Raises ValueError for buffers of other sizes or dtypes."""
    blocks = fl_b.shape[0]
    n = blocks * BLOCK
    if (weights_out is not None and bool(weights_out) != (w_out is not None)) or (
        p.dtype == torch.bfloat16) != bool(bf16_master) or moments not in (0, 1, 2):  # fmt: skip
        raise ValueError(f"triton_into: a {p.dtype} master with bf16_master={bf16_master}, "
                         f"moments={moments}, weights_out={weights_out} and w_out "
                         f"{'given' if w_out is not None else 'None'}")  # fmt: skip
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v), ("w_out", w_out)):
        if t is not None and (t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"triton_into: {name} has {t.numel()} elements (contiguous: "
                             f"{t.is_contiguous()}); expected {n}, contiguous")  # fmt: skip
    if not blocks:
        return
    w_lerp, beta2, c_v, eps, wd = k
    forms = torch_forms(p.device, w_lerp, c_v)
    wd_mode = 0 if wd == 0 else 1 if decoupled else 2
    wdf_mode, wdf = _scalar(wd_factor if wd_mode == 1 else None)
    gs_mode, gs = _scalar(grad_scale)
    draws = bf16_master or moments == 1
    interpret = _interpreting()
    grid = ((blocks + BLOCKS_PER_PROGRAM - 1) // BLOCKS_PER_PROGRAM,)
    launch = {} if interpret else dict(num_warps=NUM_WARPS, enable_fp_fusion=False)
    on = torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext()
    w = p if w_out is None else w_out
    p, g, m, v, w = (
        t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in (p, g, m, v, w)
    )
    with on:  # triton launches on the current device
        _kernel(interpret)[grid](
            p, g, m, m_sc if moments == 2 else m, v, v_sc if moments == 2 else v, w, fl_b, it_b,
            first_b if draws else fl_b, wdf, gs, blocks, fl_b.stride(0), fl_b.stride(1),
            it_b.stride(0), it_b.stride(1), w_lerp, beta2, c_v, eps, wd,
            P_BF16=bool(bf16_master), G_BF16=g.dtype == torch.int16, MOMENTS=moments,
            W_OUT=w_out is not None, MAXIMIZE=bool(maximize), WD=wd_mode, WDF=wdf_mode,
            GS=gs_mode, COMPRESSED=bool(compressed), CUDA_DIV=bool(cuda_div), **forms,
            BPP=BLOCKS_PER_PROGRAM, BLOCK=BLOCK, **launch,
        )  # fmt: skip
