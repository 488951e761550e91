"""The compressed representations' Adam/AdamW update, as :class:`offloadopt.rules.AdamWRule`
calls it: CPU tensors go to the fused C++ kernel (:func:`offloadopt.kernels.load`), device
tensors to the same math in torch ops, one flat pass over all tensors of a call
(:func:`offloadopt.kernels.reference.adam_step_flat`, bitwise the per-tensor ``adam_step``; big
calls in passes of :data:`FLAT_NUMEL` elements: :func:`device_step`).

The representations (``state_dtype=``, ``master_weights="bf16-sr"``; docs/compressed-state.md):
moments in fp32, in bf16 rounded stochastically, or as int8 block-wise codes with one fp32 scale
per :data:`offloadopt.rules.BLOCK` elements (:mod:`offloadopt.kernels.formats`); the master in
fp32, or the bf16 weight itself rounded stochastically. The update itself is torch's AdamW/Adam
(``torch.optim.AdamW``'s algorithm, Loshchilov & Hutter, arXiv 1711.05101), computed in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "adam_update",
    "device_step",
    "device_step_mode",
    "device_work_nbytes",
    "hyper_floats",
    "MOMENT_CODES",
]

MOMENT_CODES = {"fp32": 0, "bf16": 1, "int8": 2}  # the kernel's ``moments`` argument
# Elements per flat pass of the device path (reference.adam_step_flat): its temporaries are
# about a dozen fp32/int64 copies of a pass. On CUDA big passes amortize the launches (2**27
# elements: a few GiB of temporaries); on the CPU a pass that stays in cache runs faster than
# a big one (fresh big temporaries cost page faults and memory bandwidth).
FLAT_NUMEL = {"cpu": 2**16}
FLAT_NUMEL_DEFAULT = 2**27
# Device bytes per element of one CUDA pass's temporaries, at most FLAT_NUMEL_DEFAULT elements
# at once: the largest-model runs peaked 1.6 GB (int8, fp32 masters) and 2.1 GB (bf16-sr
# masters) above a budget that left them out (benchmarks/results/2026-12-03-largest-compressed-h200),
# 12 and 16 bytes per element of a 2**27-element pass.
PASS_WORK_BYTES = 16


def device_work_nbytes(numel: int, device_type: str) -> int:
    """Peak bytes of :func:`device_step`'s temporaries over ``numel`` device-resident
    elements on a ``device_type`` device: one pass's worth (``PASS_WORK_BYTES`` per element,
    at most ``FLAT_NUMEL`` elements); 0 for no elements. Used by the ``max_gpu_memory`` budget
    (``offloadopt.place.budget.choose``)."""
    if numel <= 0:
        return 0
    return PASS_WORK_BYTES * min(numel, FLAT_NUMEL.get(device_type, FLAT_NUMEL_DEFAULT))


# The device path on CUDA runs the flat pass's elementwise part under torch.compile
# (reference.adam_step_flat(compiled=True)): the eager pass took about 60 ms of H200 time per
# step for GPT-2 124M's int8 state, memory-bound on int64 temporaries
# (benchmarks/results/2026-12-03-compressed-h200/notes.md). The flat buffers' pass
# (step/device_flat.py) runs one Triton kernel instead where triton can run
# (kernels/flat_triton.py: the compiled pass cost about 20 ms more GPU time per step than
# torch's fused fp32 AdamW for GPT-2 1.5B on an H100, moving fewer bytes).
# OFFLOADOPT_DEVICE_STEP=eager keeps the eager pass (bitwise the per-tensor reference).
COMPILE_ON = ("cuda",)
DEVICE_STEPS = ("triton", "compiled", "eager")


def device_step_env() -> str | None:
    """``OFFLOADOPT_DEVICE_STEP``: None where unset, else one of :data:`DEVICE_STEPS`. Raises
    ValueError for another value (HybridAdamW's constructor asks, so a bad one fails there on
    any device, not at a CUDA step or never)."""
    import os

    mode = os.environ.get("OFFLOADOPT_DEVICE_STEP")
    if mode is not None and mode not in DEVICE_STEPS:
        raise ValueError(
            f"OFFLOADOPT_DEVICE_STEP={mode!r}; expected 'triton', 'compiled' or 'eager'"
        )
    return mode


def device_step_mode(device: torch.device) -> str:
    """How the flat buffers' pass runs on ``device`` (``kernels.flat.core_into``'s ``how``):
    ``OFFLOADOPT_DEVICE_STEP`` if set, one of :data:`DEVICE_STEPS`; by default on CUDA
    ``"triton"`` where :func:`offloadopt.kernels.flat_triton.available`, else ``"compiled"``.
    Off CUDA ``"eager"``, unless ``"triton"`` is asked for and can run there (Triton's
    interpreter: the tests). Raises ValueError for another value, RuntimeError for
    ``"triton"`` on a CUDA device where triton cannot run."""
    from offloadopt.kernels import flat_triton

    mode = device_step_env()
    on_cuda = device.type in COMPILE_ON
    if mode is None:
        return ("triton" if flat_triton.available(device) else "compiled") if on_cuda else "eager"
    if mode == "triton" and not flat_triton.available(device):
        if on_cuda:
            raise RuntimeError(
                f"OFFLOADOPT_DEVICE_STEP='triton', but triton cannot run on {device} (not "
                "installed, or a GPU below compute capability 8.0)"
            )
        return "eager"
    return mode if on_cuda or mode == "triton" else "eager"


def compile_device_step(device: torch.device) -> bool:
    """Whether :func:`device_step` (the per-tensor path) compiles its pass on ``device``: on
    CUDA unless ``OFFLOADOPT_DEVICE_STEP=eager`` (``"triton"`` is the flat buffers' pass
    only). Raises ValueError for a value not in :data:`DEVICE_STEPS`."""
    return device_step_env() != "eager" and device.type in COMPILE_ON


def _flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # a 1-D tensor as it is: a view per tensor and list was about 2 us each on the worker
    # (5 lists of every tensor of a bucket, each call)
    return [t if t.dim() == 1 else t.view(-1) for t in tensors]


def _pieces(n: int, max_numel: int) -> list[tuple[int, int]]:
    """[0, n) cut into [a, b) of at most max_numel elements (a multiple of BLOCK)."""
    if n <= max_numel:
        return [(0, n)]
    return [(a, min(a + max_numel, n)) for a in range(0, n, max_numel)]


def device_step(*, max_numel: int | None = None, compiled: bool | None = None, **args: Any) -> None:
    """:func:`offloadopt.kernels.reference.adam_step_flat` (keyword arguments: those of
    ``adam_step``) over passes of at most ``max_numel`` padded elements (default by device:
    :data:`FLAT_NUMEL`); a tensor longer than that is cut at multiples of BLOCK (its offset
    and scales follow, so the bits are those of one pass). ``compiled``: the pass under
    ``torch.compile`` (default :func:`compile_device_step`). Raises ValueError for a
    ``max_numel`` that is not a positive multiple of BLOCK."""
    from offloadopt.kernels.formats import BLOCK, nblocks
    from offloadopt.kernels.reference import adam_step_flat

    masters = args["masters"]
    if not masters:
        adam_step_flat(**args)
        return
    if compiled is None:
        compiled = compile_device_step(masters[0].device)
    args["compiled"] = compiled
    if max_numel is None:
        max_numel = FLAT_NUMEL.get(masters[0].device.type, FLAT_NUMEL_DEFAULT)
    if max_numel <= 0 or max_numel % BLOCK:
        raise ValueError(
            f"device_step: max_numel={max_numel}; expected a positive multiple of {BLOCK}"
        )
    per_tensor = ("masters", "grads", "exp_avgs", "exp_avg_sqs")
    scales = ("exp_avg_scales", "exp_avg_sq_scales")
    chunks: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for i, p in enumerate(masters):
        for a, b in _pieces(p.numel(), max_numel):
            padded = nblocks(b - a) * BLOCK
            if chunks[-1] and used + padded > max_numel:
                chunks.append([])
                used = 0
            chunks[-1].append((i, a, b))
            used += padded
    if len(chunks) == 1 and all(a == 0 and b == masters[i].numel() for i, a, b in chunks[0]):
        adam_step_flat(**args)
        return
    for chunk in chunks:
        part = dict(args)
        # a tensor that is not cut goes as it is: a slice per tensor and key was a third of
        # the device path's host time (about 8,000 dispatcher calls a step for GPT-2 1.5B)
        whole = [a == 0 and b == masters[i].numel() for i, a, b in chunk]
        for key in per_tensor + (("weights_out",) if args["weights_out"] else ()):
            ts = args[key]
            part[key] = [ts[i] if w else ts[i][a:b]
                         for (i, a, b), w in zip(chunk, whole, strict=True)]  # fmt: skip
        if args["moments"] == 2:
            for key in scales:
                ts = args[key]
                part[key] = [ts[i] if w else ts[i][a // BLOCK : nblocks(b)]
                             for (i, a, b), w in zip(chunk, whole, strict=True)]  # fmt: skip
        for key in ("steps", "salts"):
            part[key] = [args[key][i] for i, _, _ in chunk]
        part["offsets"] = [args["offsets"][i] + a for i, a, _ in chunk]
        adam_step_flat(**part)


def hyper_floats(hyper: Any, host: bool) -> tuple[float, float, float, float, float, bool]:
    """``(lr, beta1, beta2, weight_decay, eps, maximize)`` of a frozen group
    (:class:`offloadopt.rules.Hyper`) as the update takes them: ``host``, the learning rate as
    the host kernel takes it; a tensor lr is read with ``.item()``."""
    lr = hyper.lr_host if host else hyper["lr"]
    lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
    beta1, beta2 = (float(b) for b in hyper["betas"])
    wd, eps = float(hyper["weight_decay"]), float(hyper["eps"])
    return lr, beta1, beta2, wd, eps, bool(hyper["maximize"])


def adam_update(
    rule: Any,
    hyper: Any,
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[list[torch.Tensor]],
    steps: list[torch.Tensor],
    *,
    host: bool,
    amp: dict[str, torch.Tensor] | None,
    where: list[tuple[int, int]] | None,
    use_kernel: bool | None = None,
    weights_out: list[torch.Tensor] | None = None,
    backups: list[list[torch.Tensor]] | None = None,
) -> None:
    """One update over same-device lists (contiguous tensors, pairwise the same numel).

    Args:
        rule: the :class:`offloadopt.rules.AdamWRule` (``moments``, ``master_sr``,
            ``decoupled``, ``flush_denormal``).
        hyper: the group's frozen :class:`offloadopt.rules.Hyper`.
        weights: the masters: fp32, or bf16 weights (then rounded stochastically when
            ``rule.master_sr``), updated in place.
        grads: fp32 or bf16, read only.
        states: in ``rule.state_keys_for`` order: ``[exp_avg, exp_avg_sq]`` (fp32 or bf16), or
            ``[exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale]`` (uint8 codes and
            fp32 block scales).
        steps: 0-dim fp32 step tensors, already advanced.
        host: the learning rate as the host kernel takes it (:attr:`Hyper.lr_host`).
        amp: a GradScaler's ``grad_scale`` and ``found_inf`` (on the tensors' device), or None.
        where: per tensor ``(salt, offset)``: its param's rounding seed and the index of its
            first element within the param (a multiple of ``BLOCK``).
        use_kernel: None: CPU tensors to the C++ kernel, others to :func:`device_step`
            (``reference.adam_step_flat`` in passes); False: :func:`device_step` on any device
            (the tests compare the two on the CPU); True on CUDA tensors raises ValueError.
        weights_out: None, or per tensor a bf16 tensor of its numel (it may be the grad's own
            memory: each element's grad is read before its weight is written) that receives
            the new weights rounded to nearest even; fp32 masters only. On a skipped step it
            receives the unchanged masters, rounded the same way.
        backups: None, or ``[per weight, *per state list]`` (the shape of ``[weights,
            *states]``): tensors of the same dtype and numel that receive the pre-step values
            (the CPU kernel's ``backups``: it copies them out as it reads them). CPU only.

    A non-compressed rule (fp32 masters and moments) runs the kernel's all-fp32 mode, bitwise
    ``torch._fused_adamw_`` / ``torch._fused_adam_`` (tests/test_kernels.py) and, as torch's
    kernel, runs in the calling threads' floating-point mode (the worker's, which sets
    flush-to-zero per the optimizer's ``flush_denormal``); a compressed rule sets
    flush-to-zero for the call when ``rule.flush_denormal``.
    """
    if not weights:
        return
    grad_scale = None
    if amp is not None:
        found_inf = amp.get("found_inf")
        if found_inf is not None and bool(found_inf.item()):
            # an inf/NaN step is skipped, as torch's fused kernels skip it
            if backups:  # nothing changes: the backup is the state as it stands
                srcs = [weights, *states]
                torch._foreach_copy_(_flat([t for c in backups for t in c]),
                                     _flat([t for c in srcs for t in c]))  # fmt: skip
            if weights_out:
                torch._foreach_copy_(_flat(weights_out), _flat(weights))
            return
        scale = amp.get("grad_scale")
        grad_scale = None if scale is None else float(scale.item())
    lr, beta1, beta2, weight_decay, eps, maximize = hyper_floats(hyper, host)
    if rule.moments == "int8":
        m, m_scale, v, v_scale = states
    else:
        (m, v), m_scale, v_scale = states, [], []
    bk: list[list[torch.Tensor]] = []  # the kernel's order: master, m, v (, m_scale, v_scale)
    if backups:
        bw, *bs = backups
        if rule.moments == "int8":
            bm, bms, bv, bvs = bs
            bk = [bw, bm, bv, bms, bvs]
        else:
            bk = [bw, *bs]
    if steps[0].device.type == "cpu":  # read where they are: no stack of detached views
        step_values = [s.item() for s in steps]
    else:  # one copy to the host, not one per tensor
        step_values = torch.stack([s.detach().reshape(()) for s in steps]).tolist()
    where = where or [(0, 0)] * len(weights)
    # One call per master dtype (a device group may mix fp32 and bf16 params).
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(weights):
        by_dtype.setdefault(w.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        every = len(idx) == len(weights)  # one dtype (the usual case): the lists as they are

        def pick(ts: list, idx=idx, every=every) -> list:
            return ts if every or not ts else [ts[i] for i in idx]

        args = dict(
            masters=_flat(pick(weights)),
            grads=_flat(pick(grads)),
            exp_avgs=_flat(pick(m)),
            exp_avg_sqs=_flat(pick(v)),
            exp_avg_scales=pick(m_scale),
            exp_avg_sq_scales=pick(v_scale),
            weights_out=_flat(pick(weights_out or [])),
            steps=[float(step_values[i]) for i in idx],
            salts=[int(where[i][0]) for i in idx],
            offsets=[int(where[i][1]) for i in idx],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
            decoupled=rule.decoupled,
            grad_scale=grad_scale,
            moments=MOMENT_CODES[rule.moments],
            master_sr=rule.master_sr and dtype == torch.bfloat16,
        )
        if bk:
            cols = [_flat(pick(c)) for c in bk]
            args["backups"] = [c[j] for j in range(len(idx)) for c in cols]  # per tensor
        on_cpu = weights[idx[0]].device.type == "cpu"
        if use_kernel and not on_cpu:
            raise ValueError(
                f"adam_update: use_kernel=True for tensors on {weights[idx[0]].device}; the "
                "kernel runs on the CPU only"
            )
        if on_cpu and use_kernel is not False:
            from offloadopt.kernels import load, torch_vec_size

            # torch's kernel runs in the calling threads' floating-point mode (the worker sets
            # flush-to-zero per the optimizer's option): the all-fp32 mode leaves it as it is
            flush = rule.flush_denormal and rule.compressed
            load().adam_step(**args, vec_size=torch_vec_size(), flush_denormal=flush)
        else:
            if args.pop("backups", None):
                raise ValueError("adam_update: backups= needs the CPU kernel (CPU tensors)")
            device_step(**args)
