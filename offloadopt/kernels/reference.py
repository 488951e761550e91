"""The kernel's math in plain torch ops (CPU and CUDA tensors): the tests' reference, and the
step for device-resident parameters with compressed state.

``adam_step`` takes the same arguments as the compiled kernel's ``adam_step`` (see
``offloadopt.kernels``) except ``vec_size`` and ``flush_denormal`` (accepted and ignored), and
the tensors may be on any one device. Per element, in fp32, with the scalars computed in double
and cast to float as torch does::

    g = grad / grad_scale; g = -g if maximize
    Adam: g = g + p*wd          AdamW: p = p*(1 - lr*wd)          (when wd != 0)
    m = lerp(m, g, 1 - beta1);  v = v*beta2 + (1 - beta2)*g*g
    all fp32 (torch's):  p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    compressed:          p = p + (-lr / bc1 * sqrt(bc2)) * m / (sqrt(v) + eps * sqrt(bc2))

The compressed form is the same quantity with ``sqrt(bc2)`` folded into the two scalars (in
double, then cast to float): one division per element instead of two, which bounded the
kernel on AVX2 hosts; it differs from torch's form by an fp32 rounding or two.

Stochastic rounding to bf16 and its random bits: :mod:`offloadopt.kernels.rounding`.

The kernel computes exactly these operations (correctly rounded fp32 add, mul, div, sqrt and
fma); this module's torch ops may fuse or order them differently (torch.lerp, addcmul), so
results equal the kernel's up to an fp32 rounding, which moves a rounded bf16 value or an int8
code by one step where the value sits that close to a threshold.
"""

from __future__ import annotations

import math
import struct

import torch

from offloadopt.kernels.arg_checks import check_flat_args, check_lists
from offloadopt.kernels.formats import BLOCK, _encode_y, decode_m, decode_v, encode_m, nblocks
from offloadopt.kernels.rounding import (  # noqa: F401 - re-exported: reference.sr_key, ...
    DRAW_MASTER,
    DRAW_MOMENTS,
    M32,
    M64,
    _sr_bits_halves,
    master_bits,
    round_bf16_sr,
    sr_bits,
    sr_key,
)

__all__ = ["adam_step", "adam_step_flat", "round_bf16_sr", "sr_bits", "sr_key"]


def _f32(x: float) -> float:
    """x rounded to fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _consts(beta1: float, beta2: float, weight_decay: float, eps: float) -> tuple[float, ...]:
    """The update's fp32 constants, rounded from double on the host as torch rounds them:
    ``(1 - beta1, beta2, 1 - beta2, eps, weight_decay)``."""
    return _f32(1 - beta1), _f32(beta2), _f32(1 - beta2), _f32(eps), _f32(weight_decay)


def _adam_math(p, g, m0, v0, *, k, maximize, decoupled, grad_scale, neg_step_size,
               denominator, wd_factor):  # fmt: skip
    """The update itself, elementwise in fp32 (the module docstring's formula): ``p``, ``g``,
    ``m0``, ``v0`` fp32 of one shape; ``k``: :func:`_consts`; ``neg_step_size``: the step's
    scalar as fp32 (``-lr / bc1``; compressed: times ``sqrt(bc2)``; a float, or a tensor that
    broadcasts); ``denominator(y)``: of ``y = sqrt(v)``, ``y / sqrt(bc2) + eps`` (all fp32) or
    ``y + eps * sqrt(bc2)`` (compressed), as the caller's device computes it; ``wd_factor``:
    AdamW's ``1 - lr * wd`` as fp32 (a float or a 0-dim tensor; unused unless decoupled with wd
    != 0); ``grad_scale``: an fp32 value as a float, a 0-dim fp32 tensor, or None. Python
    floats only (no struct calls): the compiled pass traces this function. Returns ``(p, m, v,
    sqrt(v))``, new tensors."""
    one_minus_beta1, beta2, one_minus_beta2, _, weight_decay = k
    if grad_scale is not None:
        g = g / grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p = p * wd_factor
        else:
            g = g.add(p, alpha=weight_decay)
    m = torch.lerp(m0, g, one_minus_beta1)
    v = (v0 * beta2).addcmul_(g, g, value=one_minus_beta2)
    y = v.sqrt()
    return p + (m * neg_step_size) / denominator(y), m, v, y


def _step_scalars(step_size: float, bc2: float, eps: float, compressed: bool, *,
                  cuda: bool) -> tuple[float, float]:  # fmt: skip
    """``(neg_step, d)``, one tensor's two scalars of the module docstring's forms, rounded from
    double to fp32 as the kernel rounds them: the step's (``-lr / bc1``; compressed: times
    ``sqrt(bc2)``) and the denominator's (:func:`_denominator`): ``sqrt(bc2)``, compressed
    ``eps * sqrt(bc2)``. ``cuda``: a tensor divided by a host scalar on CUDA is a
    multiplication by its fp32 reciprocal (torch's div_true_kernel_cuda), so ``d`` is that
    reciprocal: 1/s rounded once from double equals it (double rounding is innocuous for
    division, 53 >= 2*24 + 2)."""
    s = math.sqrt(bc2)
    if compressed:
        return _f32(-step_size * s), _f32(eps * s)
    s32 = _f32(s)
    return _f32(-step_size), _f32(1.0 / s32) if cuda else s32


def _denominator(d, eps: float, compressed: bool, cuda: bool):
    """``y -> `` the update's denominator of ``y = sqrt(v)`` from :func:`_step_scalars`'s ``d``
    (a float, or a tensor that broadcasts): ``y + d`` compressed, else ``y / d + eps``
    (``y * d + eps`` on CUDA)."""
    if compressed:
        return lambda y: y + d
    if cuda:
        return lambda y: (y * d).add_(eps)
    return lambda y: (y / d).add_(eps)


def adam_step(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
              weights_out, steps, salts, offsets, lr, beta1, beta2, weight_decay, eps, maximize,
              decoupled, grad_scale, moments, master_sr, vec_size=None, flush_denormal=False):  # fmt: skip
    """The fused step in torch ops; updates the tensors in place like the kernel. Raises
    ValueError for mismatched lists or modes (the per-tensor checks are the kernel's)."""
    n_t = check_lists("adam_step", masters, grads=grads, exp_avgs=exp_avgs,
                       exp_avg_sqs=exp_avg_sqs, steps=steps, salts=salts, offsets=offsets,
                       moments=moments)  # fmt: skip
    for i in range(n_t):
        p_in = masters[i]
        bf16_master = p_in.dtype == torch.bfloat16
        if bf16_master != bool(master_sr):
            raise ValueError("adam_step: master_sr=True goes with bf16 masters and only with them")
        step = float(steps[i])
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        step_size = lr / bc1
        n = p_in.numel()
        compressed = bf16_master or moments != 0
        if moments in (0, 1):
            m0, v0 = exp_avgs[i].float(), exp_avg_sqs[i].float()
        else:
            m0 = decode_m(exp_avgs[i], exp_avg_scales[i])
            v0 = decode_v(exp_avg_sqs[i], exp_avg_sq_scales[i])
        neg_step, d = _step_scalars(step_size, bc2, eps, compressed, cuda=False)
        denominator = _denominator(d, _f32(eps), compressed, cuda=False)
        p, m, v, y = _adam_math(
            p_in.float(), grads[i].float(), m0, v0, k=_consts(beta1, beta2, weight_decay, eps),
            wd_factor=_f32(1 - lr * weight_decay), maximize=maximize, decoupled=decoupled,
            grad_scale=None if grad_scale is None else _f32(float(grad_scale)),
            neg_step_size=neg_step, denominator=denominator,
        )  # fmt: skip
        counter = index = None
        if bf16_master or moments == 1:
            index = torch.arange(n, dtype=torch.int64, device=p.device)
            counter = offsets[i] + index
        if bf16_master:
            key = sr_key(salts[i], step, DRAW_MASTER)
            p_in.copy_(round_bf16_sr(p, master_bits(key & M32, key >> 32, counter, index)))
        else:
            p_in.copy_(p)
            if weights_out:
                weights_out[i].copy_(p.to(torch.bfloat16))
        if moments == 0:
            exp_avgs[i].copy_(m)
            exp_avg_sqs[i].copy_(v)
        elif moments == 1:
            r = sr_bits(sr_key(salts[i], step, DRAW_MOMENTS), counter)
            exp_avgs[i].copy_(round_bf16_sr(m, r))
            exp_avg_sqs[i].copy_(round_bf16_sr(v, r >> 16))
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


def _gather(ts: list[torch.Tensor], pads: list[int]) -> torch.Tensor:
    """1-D tensors -> one flat tensor, tensor i followed by pads[i] zeros (torch.cat's dtype
    promotion where the dtypes differ)."""
    zeros = ts[0].new_zeros(max(pads) if pads else 0)
    runs: dict[int, torch.Tensor] = {}  # one view per distinct pad (the device path is
    pieces = []  # bound by its per-op overhead on the host: GPU-host profile, 2026-12-03)
    for t, pad in zip(ts, pads, strict=True):
        pieces.append(t)
        if pad:
            run = runs.get(pad)
            if run is None:
                run = runs[pad] = zeros[:pad]
            pieces.append(run)
    return torch.cat(pieces)


def _scatter(dst: list[torch.Tensor], flat: torch.Tensor, lengths: list[int]) -> None:
    """The inverse of _gather: the first numel of each padded range copied into dst."""
    # one split into the data and pad ranges (a slice per padded tensor cost a dispatcher call
    # each from Python: the device path is bound by those on the host)
    sizes, keep = [], []
    for d, n in zip(dst, lengths, strict=True):
        keep.append(len(sizes))
        sizes.append(d.numel())
        if n > d.numel():
            sizes.append(n - d.numel())
    parts = torch.split(flat.reshape(-1), sizes)
    torch._foreach_copy_(dst, [parts[k] for k in keep])


def adam_step_flat(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
                   weights_out, steps, salts, offsets, lr, beta1, beta2, weight_decay, eps,
                   maximize, decoupled, grad_scale, moments, master_sr, vec_size=None,
                   flush_denormal=False, compiled=False):  # fmt: skip
    """:func:`adam_step` in one pass over all tensors of the call; the same arguments and
    bitwise the same results, in about 60 launches whatever the number of tensors and without
    a host sync.

    The tensors (1-D, one master dtype, one device) are packed into flat buffers, each
    tensor's range padded with zeros up to a multiple of ``BLOCK`` so an int8 block never
    mixes two tensors (a zero pad does not raise a block's absmax). The per-tensor scalars
    (the bias corrections of its step, its rounding keys, its counter offset) are computed on
    the host as :func:`adam_step` computes them and broadcast per block. Temporaries: about
    a dozen fp32 and int64 copies of the call's padded element count (callers chunk big
    calls: :func:`offloadopt.kernels.adam.adam_update`). Raises ValueError for mismatched
    lists, shapes, dtypes, devices or modes.

    ``compiled=True`` runs the elementwise part (:func:`_flat_core`) under ``torch.compile``
    (one graph for any element count): a few fused kernels instead of about 60 launches over
    int64 temporaries. Its results may differ from the eager pass's in the last bit of the
    fp32 update (the compiler fuses multiply-adds), which can move a rounded bf16 value or an
    int8 code by one step; the formats and the rounding bits are the same
    (tests/cuda/test_device_path_cuda.py)."""
    check_flat_args(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
                     weights_out, steps, salts, offsets, moments, master_sr)  # fmt: skip
    if not masters:
        return
    device = masters[0].device
    bf16_master = masters[0].dtype == torch.bfloat16
    sizes = [p.numel() for p in masters]
    counts = [nblocks(n) for n in sizes]
    lengths = [c * BLOCK for c in counts]
    pads = [ln - n for ln, n in zip(lengths, sizes, strict=True)]
    total_blocks = sum(counts)
    # per-tensor scalars, exactly as adam_step computes them (_step_scalars)
    neg_step_size, second, ints = [], [], []
    cuda_div = device.type == "cuda"
    compressed = bf16_master or moments != 0
    for i in range(len(masters)):
        step = float(steps[i])
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        neg, d = _step_scalars(lr / bc1, bc2, eps, compressed, cuda=cuda_div)
        neg_step_size.append(neg)
        second.append(d)
        keys = [sr_key(salts[i], step, draw) for draw in (DRAW_MASTER, DRAW_MOMENTS)]
        row = [int(offsets[i])]
        for k in keys:
            row += [k & M32, k >> 32]
        ints.append(row)
    counts_t = torch.tensor(counts, dtype=torch.int64)
    fl = torch.tensor([neg_step_size, second], dtype=torch.float32).t()  # (n_t, 2)
    it = torch.tensor(ints, dtype=torch.int64)  # (n_t, 5)
    # block b of tensor i: its counter base = offset_i + BLOCK * (b - first block of i)
    first = torch.cumsum(counts_t, 0) - counts_t
    if device.type == "cuda":  # pinned: the copies do not wait for the host
        fl, it, counts_t, first = (x.pin_memory().to(device, non_blocking=True)
                                   for x in (fl, it, counts_t, first))  # fmt: skip
    elif device.type != "cpu":
        fl, it, counts_t, first = (x.to(device) for x in (fl, it, counts_t, first))
    fl_b = fl.repeat_interleave(counts_t, dim=0, output_size=total_blocks)  # (blocks, 2)
    it_b = it.repeat_interleave(counts_t, dim=0, output_size=total_blocks)  # (blocks, 5)
    first_b = first.repeat_interleave(counts_t, output_size=total_blocks)
    if moments in (0, 1):
        m_in, v_in = _gather(exp_avgs, pads), _gather(exp_avg_sqs, pads)
        m_sc = v_sc = None
    else:
        m_in, m_sc = _gather(exp_avgs, pads), torch.cat(exp_avg_scales)
        v_in, v_sc = _gather(exp_avg_sqs, pads), torch.cat(exp_avg_sq_scales)
    wd_factor = _f32(1 - lr * weight_decay) if weight_decay != 0 and decoupled else None
    gs = None if grad_scale is None else _f32(float(grad_scale))
    core = _flat_core
    if compiled:
        # the per-call scalars as tensors: a new lr (a scheduler) or loss scale must not
        # recompile the pass
        sc = torch.tensor([1.0 if wd_factor is None else wd_factor, 1.0 if gs is None else gs],
                          dtype=torch.float32)  # fmt: skip
        sc = (
            sc.pin_memory().to(device, non_blocking=True)
            if device.type == "cuda"
            else sc.to(device)
        )
        wd_factor = None if wd_factor is None else sc[0]
        gs = None if gs is None else sc[1]
        core = _compiled_core
    p_out, w_out, m_out, v_out, sm, sv = core(
        _gather(masters, pads), _gather(grads, pads), m_in, m_sc, v_in, v_sc, fl_b, it_b,
        first_b, wd_factor=wd_factor, grad_scale=gs, k=_consts(beta1, beta2, weight_decay, eps),
        maximize=maximize, decoupled=decoupled,
        moments=moments, bf16_master=bf16_master, weights_out=bool(weights_out),
        cuda_div=cuda_div, compressed=compressed,
    )  # fmt: skip
    _scatter(masters, p_out, lengths)
    if weights_out:
        _scatter(weights_out, w_out, lengths)
    _scatter(exp_avgs, m_out, lengths)
    _scatter(exp_avg_sqs, v_out, lengths)
    if moments == 2:
        torch._foreach_copy_(exp_avg_scales, list(torch.split(sm, counts)))
        torch._foreach_copy_(exp_avg_sq_scales, list(torch.split(sv, counts)))


def _flat_core(p_in, g_in, m_in, m_sc, v_in, v_sc, fl_b, it_b, first_b, *, wd_factor,
               grad_scale, k, maximize, decoupled, moments, bf16_master, weights_out,
               cuda_div, compressed):  # fmt: skip
    """The elementwise part of :func:`adam_step_flat` over the gathered (padded) flat buffers,
    a pure function of tensors: returns ``(master, bf16 weights or None, exp_avg or its codes,
    exp_avg_sq or its codes, exp_avg scales or None, exp_avg_sq scales or None)``, new tensors
    in the stored dtypes. ``fl_b`` (blocks, 2) fp32: per block the step's scalar and the
    denominator's (:func:`_step_scalars`: ``-lr / bc1`` and ``sqrt(bc2)``, its reciprocal when
    ``cuda_div``; ``compressed``: both times ``sqrt(bc2)``, the second ``eps * sqrt(bc2)``);
    ``it_b`` (blocks, 5) int64: the counter offset and the two draws' keys' 32-bit halves;
    ``first_b`` (blocks,) the first block of each block's tensor. ``k``: :func:`_consts`.
    ``wd_factor`` / ``grad_scale``: fp32 values as floats or 0-dim fp32 tensors (a compiled
    pass takes tensors), or None."""
    ss = fl_b[:, 0:1]
    denominator = _denominator(fl_b[:, 1:2], k[3], compressed, cuda_div)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, BLOCK)

    if moments in (0, 1):
        m0, v0 = blocks(m_in.float()), blocks(v_in.float())
    else:
        m0, v0 = blocks(decode_m(m_in, m_sc)), blocks(decode_v(v_in, v_sc))
    p, m, v, y = _adam_math(
        blocks(p_in.float()), blocks(g_in.float()), m0, v0, k=k, maximize=maximize,
        decoupled=decoupled,
        grad_scale=grad_scale, neg_step_size=ss, wd_factor=wd_factor, denominator=denominator,
    )  # fmt: skip
    counter = None
    if bf16_master or moments == 1:
        total_blocks = fl_b.shape[0]
        idx = torch.arange(total_blocks, dtype=torch.int64, device=p.device)
        base = it_b[:, 0] + (idx - first_b) * BLOCK
        index = torch.arange(BLOCK, dtype=torch.int64, device=p.device)  # within the block (a
        counter = base[:, None] + index  # multiple of BLOCK within the param): j & 4 the same

    def keys(draw: int) -> tuple[torch.Tensor, torch.Tensor]:
        return it_b[:, 1 + 2 * draw : 2 + 2 * draw], it_b[:, 2 + 2 * draw : 3 + 2 * draw]

    w_out = sm = sv = None
    if bf16_master:
        p_out = round_bf16_sr(p, master_bits(*keys(DRAW_MASTER), counter, index))
    else:
        p_out = p
        if weights_out:
            w_out = p.to(torch.bfloat16)
    if moments == 0:
        m_out, v_out = m, v
    elif moments == 1:
        r = _sr_bits_halves(*keys(DRAW_MOMENTS), counter)
        m_out, v_out = round_bf16_sr(m, r), round_bf16_sr(v, r >> 16)
    else:
        cm, sm = encode_m(m.reshape(-1))
        cv, sv = _encode_y(y.reshape(-1))
        bad = torch.isnan(sm) | torch.isnan(sv)
        rows = bad[:, None]
        m_out = torch.where(rows, 0, blocks(cm)).to(torch.uint8)
        v_out = torch.where(rows, 0, blocks(cv)).to(torch.uint8)
        nan = torch.full_like(sm, float("nan"))
        sm, sv = torch.where(bad, nan, sm), torch.where(bad, nan, sv)
    return p_out, w_out, m_out, v_out, sm, sv


_COMPILED: dict = {}
# One graph per mode (moments, master dtype, weight decay on/off, maximize, a loss scale, the
# group's betas and eps): more than torch's default of 8 for one code object when a process
# runs several optimizers or modes (the tests do).
RECOMPILE_LIMIT = 64


def compiled_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``torch.compile`` (dynamic shapes: one graph for any
    numel; fullgraph), compiled once per process and function on first use, with the recompile
    limit raised to :data:`RECOMPILE_LIMIT`."""
    import torch._dynamo  # noqa: F401 - torch.compile's config

    compiled = _COMPILED.get(fn)
    if compiled is None:
        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    name = (
        "recompile_limit"
        if hasattr(torch._dynamo.config, "recompile_limit")
        else "cache_size_limit"
    )
    limit = max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT)
    with torch._dynamo.config.patch({name: limit}):
        return compiled(*args, **kwargs)


def _compiled_core(*args, **kwargs):
    """:func:`_flat_core` under :func:`compiled_call`."""
    return compiled_call(_flat_core, *args, **kwargs)
