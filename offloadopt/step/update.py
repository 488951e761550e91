"""The update itself, owned by :class:`Updater`: the rule on the worker over a bucket, and on
the device over the device-resident params (step/device.py); the making of state (lazily, at a
param's first grad, in the flat buffers of step/device_flat.py where it goes there, or from a
saved entry), stale masters refreshed, the offloaded ``step`` advanced."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offloadopt.kernels.adam import adam_update
from offloadopt.link.layout import CUT_ALIGN
from offloadopt.link.pipeline import BucketWork
from offloadopt.place.placement import update_dtype
from offloadopt.place.records import ParamRecord
from offloadopt.rules import BLOCK, INT8_KEYS, Hyper
from offloadopt.shards import local
from offloadopt.state import checkpoint
from offloadopt.step.device import DeviceUpdate
from offloadopt.step.device_flat import DeviceFlat
from offloadopt.step.step import Step
from offloadopt.warn import warn

if TYPE_CHECKING:
    from offloadopt.rules import Rule
    from offloadopt.state.store import OptimizerState

__all__ = ["Updater"]


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


def _backup_views(b, backup: list[torch.Tensor], columns: list[list[torch.Tensor]]):
    """Per kernel operand (``columns``: the master views, then each state's, in arena order;
    views of bucket ``b``'s arena buffers), the view of ``backup`` (per arena buffer, the
    bucket's range of it) at the same place."""
    out = []
    for base, bk, views in zip([b.arena.master, *b.arena.states.values()], backup, columns,
                               strict=True):  # fmt: skip
        start = b.range_of(base).storage_offset()
        out.append([bk[v.storage_offset() - start :][: v.numel()] for v in views])
    return out


def apply_rule(rule, hyper: Hyper, weights, grads, states, steps, *, host: bool, first: bool,
               amp, where, out=None) -> None:  # fmt: skip
    """``rule`` over lists of same-device tensors (:meth:`offloadopt.rules.Rule.update`'s
    arguments): torch's fused kernel, or under a compressed representation offloadopt's own
    (:func:`offloadopt.kernels.adam.adam_update`; ``where``: per tensor its param's rounding
    seed and its first element within the param; ``out``: None, or per tensor a bf16 view where
    the new weights go, rounded to nearest even)."""
    if rule.compressed:
        adam_update(rule, hyper, weights, grads, states, steps, host=host, amp=amp, where=where,
                    weights_out=out)  # fmt: skip
    else:
        rule.update(hyper, weights, grads, states, steps, host=host, first=first, amp=amp)


class Updater:
    """Applies the update rule and makes the state it reads.

    Args:
        rule: the optimizer's :class:`offloadopt.rules.Rule` (its kernels, state keys, whether
            it keeps a ``step`` and makes its state lazily).
        records: the optimizer's param -> :class:`offloadopt.place.records.ParamRecord` dict
            (the same object for the optimizer's lifetime; read, never replaced here).
        state: the optimizer's :class:`offloadopt.state.store.OptimizerState` (``opt.state``,
            the same object for its lifetime), into which the state is installed.
        master_weights: whether low-precision params keep fp32 masters.
        bucket_nbytes: bytes; the device update's fp32 temporaries stay under it per chunk.
        timeout_s: seconds the worker waits for a GradScaler's values to land.
        warn_once: ``(key, message)``: the optimizer's warning given once per ``key``.

    Owns: the rule's application over one bucket on the CPU worker (:meth:`update_bucket`,
    the worker's callable) and over the device-resident params on the compute stream
    (:attr:`device`, a :class:`~offloadopt.step.device.DeviceUpdate`; the flat buffers of
    compressed state: :attr:`flat`, a :class:`~offloadopt.step.device_flat.DeviceFlat`); the
    making of state (:meth:`init_state`, :meth:`make_state`,
    :meth:`new_state_tensor`, :meth:`load_entry`, :meth:`load_state`); stale masters
    (:meth:`refresh_if_stale`); a step's preparation of its params (:meth:`prepare`,
    :meth:`prepare_device`).
    """

    def __init__(
        self,
        rule: Rule,
        records: dict[torch.Tensor, ParamRecord],
        state: OptimizerState,
        *,
        master_weights: bool,
        bucket_nbytes: int,
        timeout_s: float,
        warn_once: Callable[[str, str], None],
    ):
        self.rule = rule
        self.records = records
        self.state = state
        self.master_weights = master_weights
        self.bucket_nbytes = bucket_nbytes
        self.timeout_s = timeout_s
        self.warn_once = warn_once
        self.flat = DeviceFlat(rule, records, state, master_weights=master_weights)
        # the rule alone, not self.apply: a bound method would make the two hold each other,
        # and a dropped optimizer's state would wait for the garbage collector
        self.device = DeviceUpdate(rule, records, state, self.flat, functools.partial(apply_rule, rule),
                                   bucket_nbytes=bucket_nbytes)  # fmt: skip

    def update_bucket(self, work: BucketWork, grads: list[torch.Tensor]) -> None:
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
            where = out = None
            if self.rule.compressed:  # per segment: its param's salt, its first element
                where = [(self.records[b.arena.params[b.segments[i].k]].salt, b.segments[i].lo)
                         for i in segs]  # fmt: skip
                weights, gs, *ss = columns
                if work.out is not None:  # the new weights in the link dtype (pipeline.py)
                    out = [work.out[j] for j in positions]
            else:
                (weights, gs, *ss), steps = _joined([b.segments[i] for i in segs], columns, steps)
            if work.backup is not None:
                backups = _backup_views(b, work.backup, [weights, *ss])
                adam_update(self.rule, hyper, weights, gs, ss, steps, host=True, amp=amp,
                            where=where, weights_out=out, backups=backups)  # fmt: skip
                continue
            self.apply(hyper, weights, gs, ss, steps, host=True, first=first, amp=amp,
                       where=where, out=out)  # fmt: skip

    def backs_up_in_kernel(self, b) -> bool:
        """Whether bucket ``b``'s update can copy its pre-step state out itself (the CPU
        kernel's ``backups``, offloadopt/kernels/__init__.py; speculative updates,
        offloadopt/step/speculate.py): Adam/AdamW whose update runs the kernel (a compressed
        representation), or with fp32 masters and moments on a host where the kernel's
        all-fp32 mode is bitwise torch's (AVX2/AVX512: ``torch_vec_size() >= 8``) and the
        kernel builds. Otherwise the backup is a copy before the update."""
        from offloadopt import kernels
        from offloadopt.rules import AdamWRule

        if not isinstance(self.rule, AdamWRule):
            return False
        if not self.rule.compressed:
            fp32 = [b.arena.master, *b.arena.states.values()]
            if any(t.dtype != torch.float32 for t in fp32) or kernels.torch_vec_size() < 8:
                return False
        return kernels.available()

    def apply(self, hyper: Hyper, weights, grads, states, steps, *, host: bool, first: bool,
              amp, where, out=None) -> None:  # fmt: skip
        """:func:`apply_rule` with this updater's rule."""
        apply_rule(self.rule, hyper, weights, grads, states, steps, host=host, first=first,
                   amp=amp, where=where, out=out)  # fmt: skip

    def device_update(self, hyper: Hyper, params: list[torch.Tensor], scale, first=False,
                      amp=None) -> None:  # fmt: skip
        """The rule over device-resident ``params`` (:meth:`DeviceUpdate.update`)."""
        self.device.update(hyper, params, scale, first, amp)

    def prepare(self, st: Step, params: list[torch.Tensor]) -> None:
        """Create state lazily, refresh stale masters, advance the offloaded params' ``step``
        (once per step, even when buckets cut a param in several segments)."""
        steps = []
        for p in params:
            if p in st.prepared:
                continue
            st.prepared.add(p)
            rec = self.records[p]
            if not self.state.get(p):  # none yet (an empty entry: a defaultdict lookup)
                self.init_state(p, rec)
                st.created.add(p)
            elif rec.is_stale(p):
                self.refresh_if_stale(p, rec)
            state = self.state[p]
            if self.rule.lazy_state and any(k not in state for k in rec.state_keys):
                st.first.add(p)  # the kernel's is_first_step initialises these
                for k in rec.state_keys:
                    state[k] = self.new_state_tensor(p, rec, k)
            if rec.offloaded and self.rule.has_step:
                steps.append(state["step"])
        if steps:
            torch._foreach_add_(steps, 1)

    def prepare_device(self, st: Step, with_grad: list[torch.Tensor]) -> list:
        """Prepare the device-resident params; their work grouped by frozen hyperparameters."""
        on_device = [p for p in with_grad if not self.records[p].offloaded]
        fresh: dict[int, list[torch.Tensor]] = {}  # per group, the params without state yet
        for p in on_device:
            if not self.state.get(p):
                fresh.setdefault(id(st.group_of[p]), []).append(p)
        for params in fresh.values():
            self.flat.reserve(params)  # their state is made in flat buffers (init_state)
        try:
            self.prepare(st, on_device)
        finally:
            self.flat.pending.clear()
        by_group: dict[tuple, tuple[Hyper, list, bool]] = {}
        for p in on_device:
            hyper, first = st.hypers[id(st.group_of[p])], p in st.first
            by_group.setdefault((id(hyper), first), (hyper, [], first))[1].append(p)
        return list(by_group.values())

    def init_state(self, p: torch.Tensor, rec: ParamRecord) -> None:
        """Lazily create ``p``'s state at its first grad, as torch does."""
        step = {"step": torch.zeros((), dtype=torch.float32)} if self.rule.has_step else {}
        # A lazy rule's state keys come with the param's first update (see prepare).
        keys = () if self.rule.lazy_state else rec.state_keys
        if rec.offloaded:
            master = rec.home("master")
            master.copy_(local(p).detach())  # blocking D2H (once per param): master = weights
            state = {**step, **{k: self.new_state_tensor(p, rec, k) for k in keys}}
            if rec.arena.dtype != p.dtype:
                state["master"] = master
        else:
            udt = update_dtype(p.dtype, self.master_weights)
            # torch's fused kernels read the step on the param's device; the compressed
            # device path (kernels.adam.adam_update) computes its per-tensor scalars on the
            # host from the step's value, so there it stays on the CPU: read from the device
            # it would cost a host sync every step on the training thread
            if step and not self.rule.compressed:
                step["step"] = step["step"].to(p.device)
            views = self.flat.claim(p)  # zeroed views of flat buffers (step/device_flat.py)
            if views is not None:
                state = {k: views[k] for k in (*step, *keys)}
                if "master" in views:
                    state["master"] = views["master"].copy_(local(p).detach())
            else:
                state = {**step, **{k: self.new_state_tensor(p, rec, k) for k in keys}}
            if udt != p.dtype and views is None:
                # the compressed kernels walk flat memory: their master is contiguous (a
                # channels_last bf16 param's crashed them); torch's keep the param's layout
                layout = torch.contiguous_format if self.rule.compressed else torch.preserve_format
                state["master"] = local(p).detach().to(udt, memory_format=layout, copy=True)
        self.state.install(p, state)
        rec.mark_written(p)

    def make_state(self, p: torch.Tensor) -> dict:
        """``p``'s state made now (an assignment into ``opt.state`` before its first step)."""
        self.init_state(p, self.records[p])
        return self.state[p]

    def new_state_tensor(self, p: torch.Tensor, rec: ParamRecord, key: str) -> torch.Tensor:
        """State ``key`` of ``p`` at zero: its arena view when offloaded, else a device tensor
        in the rule's dtype for the key (the update dtype under torch's representation) shaped
        like ``p`` (a blockwise key: ``(ceil(numel / BLOCK),)``, contiguous)."""
        if rec.offloaded:
            return rec.home(key).zero_()
        udt = update_dtype(p.dtype, self.master_weights)
        dtype = self.rule.key_dtype(key, udt)
        mine = local(p)
        if self.rule.blockwise(key):
            return torch.zeros(-(-mine.numel() // BLOCK), dtype=dtype, device=mine.device)
        if self.rule.compressed:  # the kernels walk flat memory: contiguous, like the param
            return torch.zeros(mine.shape, dtype=dtype, device=mine.device)
        return torch.zeros_like(mine, dtype=udt, memory_format=torch.preserve_format)

    def refresh_if_stale(self, p: torch.Tensor, rec: ParamRecord) -> None:
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

    def load_entry(self, p: torch.Tensor, rec: ParamRecord, entry: dict[str, Any]) -> None:
        """Copy one validated saved entry into ``p``'s existing state."""
        if not self.state.get(p):
            self.init_state(p, rec)
        mine = self.state[p]
        if self.rule.compressed or any(k in entry for k in INT8_KEYS):
            entry = checkpoint.stored_entry(entry, self.rule, rec.state_keys)
        if self.rule.has_step:
            mine["step"].fill_(entry["step"])
        for k in rec.state_keys:
            if entry.get(k) is None:  # a lazy key not made yet (SGD before its first step)
                mine.pop(k, None)
                continue
            if k not in mine:
                mine[k] = self.new_state_tensor(p, rec, k)
            mine[k].copy_(entry[k])
        if "master" in mine:
            if entry.get("master") is not None:
                mine["master"].copy_(entry["master"])
                rec.forget_written()  # compare with the weights at the next step
            else:
                mine["master"].copy_(local(p).detach())
                rec.mark_written(p)
                self.warn_once(
                    "no-master",
                    f"the state dict has no fp32 master for {rec.name} ({p.dtype}): masters were "
                    "made from the current weights, so this resume is not bitwise exact",
                )
        elif rec.offloaded:
            rec.home("master").copy_(local(p).detach())  # fp32 offloaded: the param is the truth
            rec.mark_written(p)

    def load_state(self, groups: list[dict[str, Any]], saved_state: dict[int, dict],
                   real_entry: Callable[[int, dict], dict] | None = None) -> bool:  # fmt: skip
        """Copy validated saved state (:func:`offloadopt.state.checkpoint.validate`'s, by param
        position over ``groups``, the optimizer's param groups) into each param's state; a
        param with no saved entry loses its state (made again at its next grad, as in torch).
        ``real_entry(index, entry)``: the entry with its values, where ``saved_state`` holds
        only shapes (a streamed load). Returns whether the saved state carried masters that
        were ignored (a param that keeps none here)."""
        ignored_masters = False
        params = [p for g in groups for p in g["params"]]
        for index, p in enumerate(params):
            entry = saved_state.get(index)
            if entry is None:
                self.state.pop(p, None)
                continue
            if real_entry is not None:
                entry = real_entry(index, entry)
            self.load_entry(p, self.records[p], entry)
            ignored_masters |= entry.get("master") is not None and "master" not in self.state[p]
        return ignored_masters


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
