"""The compressed update over flat buffers laid out once (their owner:
offloadopt/step/device_flat.py): :func:`reference._flat_core` written into the buffers
themselves, and the per-param rounding keys computed on the device.

``reference.adam_step_flat`` packs every tensor of a call into padded flat buffers, runs
``_flat_core`` and unpacks the results: per tensor and step, slices, a cat and a split issued
from Python (GPT-2 1.5B's 580 tensors: about 22 of the int8 update's 41.5 ms on an H100, its
host time above the GPU's). Where the state already lives in such buffers (each param's
segment padded to ``BLOCK``, so a block never mixes two params), one :func:`core_into` per pass
computes the same values and writes them in place: the same function of the same inputs, so
the eager pass gives the bits of ``adam_step_flat``'s eager pass.

Bytes per element of one pass, fp32 master, int8 moments, bf16 grads and weights out: read
4 + 2 + 1 + 1, write 4 + 1 + 1 + 2 (16, plus two fp32 scales per 256 elements); bf16-sr
master, int8 moments: read 2 + 2 + 1 + 1, write 2 + 1 + 1 (10). GB/s on the GPU host:
benchmarks/probes/device_pass.py (not yet measured). On CUDA a pass runs as one Triton kernel
(``kernels/flat_triton.py``) by default, the eager pass's bits.
"""

from __future__ import annotations

import torch

from offloadopt.kernels.reference import _flat_core, compiled_call
from offloadopt.kernels.rounding import DRAW_MASTER, DRAW_MOMENTS, M32, M64

__all__ = ["core_into", "key_table", "signed64"]

_GOLDEN = 0x9E3779B97F4A7C15  # rounding.sr_key's constants: splitmix64's increment,
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # and its finalizer's multipliers


def signed64(x: int) -> int:
    """``x`` mod 2^64 as a two's complement int64 (what an int64 tensor holds of it)."""
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` read as unsigned (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def key_table(salts: torch.Tensor, step: float | list[float]) -> torch.Tensor:
    """``(n, 4)`` int64 on ``salts``' device: per salt (``(n,)`` int64, :func:`signed64` of
    each param's salt) the 32-bit halves ``lo, hi`` of ``rounding.sr_key(salt, step, draw)``
    for the master's draw, then the moments'; ``step``: one for all, or one per salt. Integer
    ops only (int64 adds and multiplies wrap mod 2^64), so the keys are those of the host's
    ``sr_key`` bit for bit; about 20 launches over ``n`` elements, no host sync (a list of
    steps crosses from pinned memory; tests/test_device_flat.py)."""
    cols = []
    for draw in (DRAW_MASTER, DRAW_MOMENTS):
        if isinstance(step, list):
            add = torch.tensor([signed64(_GOLDEN * (4 * (int(s) & M64) + draw + 1)) for s in step],
                               dtype=torch.int64)  # fmt: skip
            on_cuda = salts.device.type == "cuda"
            add = add.pin_memory().to(salts.device, non_blocking=True) if on_cuda else add
        else:
            add = signed64(_GOLDEN * (4 * (int(step) & M64) + draw + 1))
        z = salts + add
        z = z ^ _shr(z, 30)
        z = z * signed64(_MIX1)
        z = z ^ _shr(z, 27)
        z = z * signed64(_MIX2)
        z = z ^ _shr(z, 31)
        cols += [z & M32, _shr(z, 32)]
    return torch.stack(cols, 1)


def _core_into(p, g, m, m_sc, v, v_sc, w_out, fl_b, it_b, first_b, **kw) -> None:
    """``_flat_core`` over the flat (padded) pass ``p`` (master), ``g`` (grads), ``m``, ``v``
    (moments or codes) and ``m_sc``, ``v_sc`` (block scales or None), its results copied into
    ``p``, ``m``, ``v``, the scales and ``w_out`` (bf16 weights, or None). Every result is a new
    tensor computed before the first copy, so reading and writing the same buffers is safe."""
    p_new, w_new, m_new, v_new, sm, sv = _flat_core(p, g, m, m_sc, v, v_sc, fl_b, it_b, first_b,
                                                    weights_out=w_out is not None, **kw)  # fmt: skip
    p.copy_(p_new.reshape(-1))
    m.copy_(m_new.reshape(-1))
    v.copy_(v_new.reshape(-1))
    if w_out is not None:
        w_out.copy_(w_new.reshape(-1))
    if m_sc is not None:
        m_sc.copy_(sm)
        v_sc.copy_(sv)


def core_into(*args, how: str = "eager", **kwargs) -> None:
    """:func:`_core_into` (its arguments) as ``how`` says (``kernels.adam.device_step_mode``):
    ``"eager"``, torch ops; ``"compiled"``, under ``torch.compile``
    (:func:`~offloadopt.kernels.reference.compiled_call`: one graph for any pass length; the
    writes fused into the pass's kernels instead of copies of its results); ``"triton"``, one
    hand-written kernel (:func:`offloadopt.kernels.flat_triton.triton_into`: the eager pass's
    bits). Raises ValueError for another ``how``."""
    if how == "eager":
        _core_into(*args, **kwargs)
    elif how == "compiled":
        compiled_call(_core_into, *args, **kwargs)
    elif how == "triton":
        from offloadopt.kernels.flat_triton import triton_into

        triton_into(*args, **kwargs)
    else:
        raise ValueError(f"core_into: how={how!r}; expected 'eager', 'compiled' or 'triton'")
