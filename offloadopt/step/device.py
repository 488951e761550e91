"""The rule on the device-resident params, on the compute stream, owned by :class:`DeviceUpdate`:
compressed state in flat buffers takes one pass per set (:class:`offloadopt.step.device_flat.
DeviceFlat`); the rest (torch's representation, a set that cannot run this step, a strided or
fp16 param) the per-tensor path, in calls chunked by ``bucket_nbytes`` where grads are upcast."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offloadopt.place.records import ParamRecord
from offloadopt.rules import Hyper
from offloadopt.shards import local
from offloadopt.step.device_flat import DeviceFlat

if TYPE_CHECKING:
    from offloadopt.rules import Rule
    from offloadopt.state.store import OptimizerState

__all__ = ["DeviceUpdate"]


def _matching(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``like``'s dtype and strides. torch's fused kernels walk param, grad and
    state as flat memory, so a grad with other strides (a transposed grad set by hand) would
    be paired with the wrong elements; autograd's grads already match and pass through."""
    if grad.dtype == like.dtype and grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s elements fill its memory without gaps or overlap (flat kernels are safe)."""
    if p.is_contiguous():
        return True
    expected = 1  # sorted by stride, a dense tensor's strides are running products of its sizes
    for stride, size in sorted(
        (st, n) for st, n in zip(p.stride(), p.shape, strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


class DeviceUpdate:
    """Applies the rule to the device-resident params.

    Args:
        rule: the optimizer's :class:`offloadopt.rules.Rule`.
        records: param -> :class:`offloadopt.place.records.ParamRecord` (read, never replaced).
        state: ``opt.state`` (the same object for the optimizer's lifetime).
        flat: the :class:`~offloadopt.step.device_flat.DeviceFlat` that owns the flat buffers.
        apply: ``Updater.apply``: the rule over lists of same-device tensors.
        bucket_nbytes: bytes; the per-tensor path's fp32 temporaries stay under it per chunk.
    """

    def __init__(self, rule: Rule, records: dict[torch.Tensor, ParamRecord],
                 state: OptimizerState, flat: DeviceFlat, apply: Callable[..., None], *,
                 bucket_nbytes: int):  # fmt: skip
        self.rule, self.records, self.state, self.flat = rule, records, state, flat
        self.apply = apply
        self.bucket_nbytes = bucket_nbytes

    def update(
        self, hyper: Hyper, params: list[torch.Tensor], scale, first=False, amp=None
    ) -> None:
        """The rule on the device, on the compute stream: compressed state in flat buffers in
        one pass per set (``self.flat``); the rest per tensor, with fp32 masters where they
        exist, fed grads upcast (and multiplied by the clip factors ``scale``) chunk by chunk
        so the fp32 temporaries stay under ``bucket_nbytes``; ``amp``: a GradScaler's inputs
        or None. The same bits either way."""
        if self.rule.compressed and not first:
            done, params = self.flat.update(hyper, params, scale, amp)
            for q in done:
                self.records[q].mark_written(q)
        # torch's fused kernels walk a tensor's memory flat: a strided view (Parameter(base[..., 0]))
        # is updated through a contiguous copy (tests/test_state_contract.py); the compressed
        # kernels pair elements with contiguous state, so they need a contiguous param.
        flat = (lambda t: t.is_contiguous()) if self.rule.compressed else _dense
        plain = [p for p in params if "master" not in self.state[p] and flat(local(p))]
        strided = [p for p in params if "master" not in self.state[p] and not flat(local(p))]
        mastered = [p for p in params if "master" in self.state[p]]
        if scale is None:
            weights = [local(p) for p in plain]
            grads = [_matching(local(p.grad), w) for p, w in zip(plain, weights, strict=True)]
            self.run_rule(hyper, plain, weights, grads, first, amp)
            plain = []
            if self.rule.compressed and mastered:
                # offloadopt's kernels read bf16 grads and write the bf16 weights themselves
                # (rounded to nearest even, the bits of the master's downcast): one call over
                # every contiguous mastered param, no fp32 copies of the grads, no chunks (the
                # device pass makes its own, kernels.adam.FLAT_NUMEL_DEFAULT). Chunked by
                # bucket_nbytes with fp32 grads, GPT-2 1.5B's device update took about 115 ms
                # more than torch's fused kernel (48 passes, each with its host-side setup).
                # bf16 only: the kernels read fp32 or bf16 grads (fp16 ones are upcast below)
                whole = [p for p in mastered if local(p).is_contiguous()
                         and local(p).dtype == local(p.grad).dtype == torch.bfloat16]  # fmt: skip
                if whole:
                    targets = [self.state[q]["master"] for q in whole]
                    grads = [local(q.grad) for q in whole]
                    self.run_rule(hyper, whole, targets, grads, first, amp,
                                     out=[local(q) for q in whole])  # fmt: skip
                    for q in whole:
                        self.records[q].mark_written(q)
                    done = {id(q) for q in whole}
                    mastered = [p for p in mastered if id(p) not in done]
        for kind in (plain, strided, mastered):
            chunk: list[torch.Tensor] = []
            nbytes = 0
            for n, p in enumerate(kind):
                chunk.append(p)
                nbytes += p.numel() * 4
                if nbytes < self.bucket_nbytes and n < len(kind) - 1:
                    continue
                if kind is mastered:
                    targets = [self.state[q]["master"] for q in chunk]
                elif kind is strided:
                    targets = [
                        local(q).detach().clone(memory_format=torch.contiguous_format)
                        for q in chunk
                    ]
                else:
                    targets = [local(q) for q in chunk]
                grads = [_matching(local(q.grad), t) for q, t in zip(chunk, targets, strict=True)]
                if scale is not None:
                    # The clip factors on fp32 grads, as the offloaded path applies them; the
                    # user's grads are left as they are.
                    factors = scale if isinstance(scale, tuple) else (scale,)
                    theirs = [n for n, (g, q) in enumerate(zip(grads, chunk, strict=True))
                              if g is local(q.grad)]  # fmt: skip
                    skip = set(theirs)
                    mine = [g for n, g in enumerate(grads) if n not in skip]
                    if mine:  # upcast copies: in place, one launch per list
                        torch._foreach_mul_(mine, factors[0])
                    if theirs:
                        scaled = torch._foreach_mul([grads[n] for n in theirs], factors[0])
                        for n, g in zip(theirs, scaled, strict=True):
                            # A 0-d bf16 grad times the 0-d fp32 factor promotes to fp32
                            # (0-d operands promote as equals): back to the grad's dtype, the
                            # one rounding an n-d grad's product gets.
                            grads[n] = g.to(grads[n].dtype)
                    for f in factors[1:]:
                        torch._foreach_mul_(grads, f)
                self.run_rule(hyper, chunk, targets, grads, first, amp)
                if kind is not plain:
                    # weights = round(master), or strided
                    torch._foreach_copy_([local(q) for q in chunk], targets)
                for q in chunk:
                    self.records[q].mark_written(q)
                chunk, nbytes = [], 0

    def run_rule(self, hyper: Hyper, params, weights, grads, first=False, amp=None,
                    out=None) -> None:  # fmt: skip
        """The rule over ``params`` on their device: ``weights`` (the params or their masters)
        updated in place from ``grads``; ``out`` (compressed rules): the params, written with
        the new weights rounded to nearest even."""
        if not params:
            return
        keys = self.records[params[0]].state_keys  # one group: the same keys
        states = [[self.state[p][k] for p in params] for k in keys]
        steps = [self.state[p]["step"] for p in params] if self.rule.has_step else []
        if steps:
            torch._foreach_add_(steps, 1)
        args = None if amp is None else amp.kernel_args(host=False)
        where = [(self.records[p].salt, 0) for p in params] if self.rule.compressed else None
        self.apply(hyper, weights, grads, states, steps, host=False, first=first, amp=args,
                   where=where, out=out)  # fmt: skip
        if steps and amp is not None and amp.found_inf is not None:
            # as torch.optim.AdamW(fused=True): a skipped step does not count
            torch._foreach_sub_(steps, [amp.found_inf.to(steps[0].device)] * len(steps))
