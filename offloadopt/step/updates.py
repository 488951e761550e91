"""The update itself: the rule on the worker over a bucket, and on the device over the
device-resident params; lazy state, stale masters; a mixin of
:class:`offloadopt.optim.HybridOptimizer`."""

from __future__ import annotations

import torch

from offloadopt.link.layout import CUT_ALIGN
from offloadopt.link.pipeline import BucketWork
from offloadopt.place.placement import update_dtype
from offloadopt.place.records import ParamRecord
from offloadopt.rules import Hyper
from offloadopt.shards import local
from offloadopt.warn import warn

__all__ = ["Updates"]


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


def _joined(segs: list, columns: list[list[torch.Tensor]], steps: list[torch.Tensor]):
    """The kernel's operands with runs of back-to-back segments joined into one flat view.

    ``segs`` are the bucket's segments (:class:`offloadopt.link.layout.Segment`, in bucket order
    for each position), ``columns`` equal-length lists of their flat views (weights, grads,
    then each state: views of an arena buffer or of a staging slot, where a bucket's segments
    lie back to back in bucket order, by construction in offloadopt/link/layout.py), ``steps`` the
    matching step tensors (or empty). Positions ``i`` and ``i + 1`` join when they hold
    consecutive segments of the bucket, their steps hold the same value, and segment ``i``
    has a multiple of :data:`offloadopt.link.layout.CUT_ALIGN` elements: torch's CPU fused
    kernels are elementwise with per-tensor scalars, and with such a length every element of
    the joined view takes the same code path (vector or scalar tail) as in the per-segment
    call, so the result is bitwise the same (tests/test_parity.py). One call over a joined
    run is one parallel region instead of one per segment: 7-12% less kernel time over GPT-2
    1.5B's layers on the GPU host (benchmarks/RESULTS.md). Integer checks only (the step
    values are read when two params meet), so the worker's Python stays short.

    Returns:
        ``(columns, steps)``, joined; the inputs themselves when nothing joins.
    """
    n = len(segs)
    bounds, lo = [], 0
    for i in range(1, n):
        a, b = segs[i - 1], segs[i]
        joins = b.offset == a.offset + a.hi - a.lo and (a.hi - a.lo) % CUT_ALIGN == 0
        if joins and steps and steps[i] is not steps[i - 1]:
            joins = steps[i].item() == steps[i - 1].item()
        if not joins:
            bounds.append((lo, i))
            lo = i
    if n <= 1 or len(bounds) == n - 1:
        return columns, steps  # every position is its own run
    bounds.append((lo, n))
    total = [segs[hi - 1].offset + segs[hi - 1].hi - segs[hi - 1].lo - segs[lo].offset
             for lo, hi in bounds]  # fmt: skip
    out = [
        [c[lo] if hi - lo == 1 else c[lo].as_strided((t,), (1,))
         for (lo, hi), t in zip(bounds, total, strict=True)]
        for c in columns
    ]  # fmt: skip
    return out, [steps[lo] for lo, _ in bounds] if steps else steps


class Updates:
    """The updates of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    def _update_bucket(self, work: BucketWork, grads: list[torch.Tensor]) -> None:
        """On the worker: the rule over the bucket's segments ``work.idx``, whose grads (in
        the update dtype, on the host) are ``grads``; one kernel call per group, over runs of
        back-to-back segments joined (:func:`_joined`)."""
        b = work.bucket
        masters = b.state_views(b.arena.master)
        states = [b.state_views(flat) for flat in b.arena.states.values()]  # the rule's order
        amp = None
        if work.amp is not None:
            work.amp.wait(self.timeout_s)  # the scale and found_inf have landed (amp.py)
            amp = work.amp.kernel_args(host=True)
        for hyper, positions, steps, first in work.payload:
            segs = [work.idx[j] for j in positions]
            columns = [[masters[i] for i in segs], [grads[j] for j in positions]]
            columns += [[s[i] for i in segs] for s in states]
            (weights, gs, *ss), steps = _joined([b.segments[i] for i in segs], columns, steps)
            self.rule.update(hyper, weights, gs, ss, steps, host=True, first=first, amp=amp)

    def _init_state(self, p: torch.Tensor, rec: ParamRecord) -> None:
        """Lazily create ``p``'s state at its first grad, as torch does."""
        step = {"step": torch.zeros((), dtype=torch.float32)} if self.rule.has_step else {}
        # A lazy rule's state keys come with the param's first update (see _prepare).
        keys = () if self.rule.lazy_state else rec.state_keys
        if rec.offloaded:
            master = rec.home("master")
            master.copy_(local(p).detach())  # blocking D2H (once per param): master = weights
            state = {**step, **{k: self._new_state_tensor(p, rec, k) for k in keys}}
            if rec.arena.dtype != p.dtype:
                state["master"] = master
        else:
            udt = update_dtype(p.dtype, self.master_weights)
            if step:
                step["step"] = step["step"].to(p.device)
            state = {**step, **{k: self._new_state_tensor(p, rec, k) for k in keys}}
            if udt != p.dtype:
                state["master"] = (
                    local(p).detach().to(udt, memory_format=torch.preserve_format, copy=True)
                )
        self.state.install(p, state)
        rec.mark_written(p)

    def _make_state(self, p: torch.Tensor) -> dict:
        """``p``'s state made now (an assignment into ``opt.state`` before its first step)."""
        self._init_state(p, self._records[p])
        return self.state[p]

    def _new_state_tensor(self, p: torch.Tensor, rec: ParamRecord, key: str) -> torch.Tensor:
        """State ``key`` of ``p`` at zero: its arena view when offloaded, else a device tensor
        in the update dtype shaped like ``p``."""
        if rec.offloaded:
            return rec.home(key).zero_()
        udt = update_dtype(p.dtype, self.master_weights)
        return torch.zeros_like(local(p), dtype=udt, memory_format=torch.preserve_format)

    def _refresh_if_stale(self, p: torch.Tensor, rec: ParamRecord) -> None:
        """No stale masters: weights changed outside the optimizer win over its copy."""
        master = rec.master(self.state[p])
        if master is None:
            rec.mark_written(p)
            return
        current = local(p).detach().to(master.device)
        changed = stale_elements(master, current)  # (shape of p) bool
        if changed.any():
            warn(
                f"the weights of {rec.name} changed outside the optimizer since its last step "
                f"({int(changed.sum())} of {current.numel()} elements); its master copy was refreshed there"
            )
            # Only the changed elements: the others keep their fp32 master's precision.
            master.copy_(torch.where(changed, current.to(master.dtype), master))
        rec.mark_written(p)

    def _device_update(
        self, hyper: Hyper, params: list[torch.Tensor], scale, first=False, amp=None
    ) -> None:
        """The rule on the device, on the compute stream; fp32 masters where they exist, fed
        grads upcast (and multiplied by the clip factors ``scale``) chunk by chunk so the fp32
        temporaries stay under ``bucket_nbytes``; ``amp``: a GradScaler's inputs or None."""
        plain = [p for p in params if "master" not in self.state[p] and _dense(local(p))]
        # torch's fused kernels walk a tensor's memory flat: a strided view (Parameter(base[..., 0]))
        # is updated through a contiguous copy (tests/test_state_contract.py).
        strided = [p for p in params if "master" not in self.state[p] and not _dense(local(p))]
        mastered = [p for p in params if "master" in self.state[p]]
        if scale is None:
            weights = [local(p) for p in plain]
            grads = [_matching(local(p.grad), w) for p, w in zip(plain, weights, strict=True)]
            self._device_rule(hyper, plain, weights, grads, first, amp)
            plain = []
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
                self._device_rule(hyper, chunk, targets, grads, first, amp)
                if kind is not plain:
                    # weights = round(master), or strided
                    torch._foreach_copy_([local(q) for q in chunk], targets)
                for q in chunk:
                    self._records[q].mark_written(q)
                chunk, nbytes = [], 0

    def _device_rule(self, hyper: Hyper, params, weights, grads, first=False, amp=None) -> None:
        if not params:
            return
        keys = self._records[params[0]].state_keys  # one group: the same keys
        states = [[self.state[p][k] for p in params] for k in keys]
        steps = [self.state[p]["step"] for p in params] if self.rule.has_step else []
        if steps:
            torch._foreach_add_(steps, 1)
        args = None if amp is None else amp.kernel_args(host=False)
        self.rule.update(hyper, weights, grads, states, steps, host=False, first=first, amp=args)
        if steps and amp is not None and amp.found_inf is not None:
            # as torch.optim.AdamW(fused=True): a skipped step does not count
            torch._foreach_sub_(steps, [amp.found_inf.to(steps[0].device)] * len(steps))


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def stale_elements(master: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Where the weights ``current`` (shape of the param, its dtype) no longer hold what the
    ``master`` (same shape, fp32 or the param's dtype, same device) gives them: a bool tensor.

    Same dtype: the bit patterns are compared, so an edit to another NaN payload, or from 0.0
    to -0.0, is seen. Otherwise the master rounded to the weights' dtype is compared by value,
    and a NaN weight over a NaN master is not stale: the rounding does not keep a NaN's payload,
    and taking such an element as edited replaced the master's NaN bits at every refresh
    (tests/test_checkpoint.py, the NaN payload test)."""
    if master.dtype == current.dtype:
        bits = _BITS[current.element_size()]
        return master.view(bits) != current.view(bits)
    rounded = master.to(current.dtype)
    return (rounded != current) & ~(rounded.isnan() & current.isnan())
