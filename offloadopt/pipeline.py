"""The offloaded part of one step: D2H -> CPU fused AdamW -> H2D, bucket by bucket.

One :class:`Pipeline` per device owns the staging slots and, on CUDA, the two side streams.
Without CUDA the same code runs with plain copies and no streams (the CPU stands in for the
device), so CI exercises the whole data path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.host import Bucket, alloc_host

__all__ = ["SLOTS", "fused_adamw", "Pipeline"]

SLOTS = 2  # staging slots per direction: bucket k+1 moves while bucket k is updated


def fused_adamw(
    group: dict[str, Any], weights, grads, exp_avgs, exp_avg_sqs, steps, increment=True
) -> None:
    """torch's own fused AdamW kernel (``torch._fused_adamw_``, as ``torch.optim.AdamW(fused=True)``
    calls it) over lists of same-device tensors, with the group's hyperparameters.

    With ``increment=False`` the ``steps`` were already advanced (a param cut into several
    bucket segments advances once). A CUDA tensor ``lr`` feeding a CPU kernel is brought over
    with one synchronous copy: torch's functional fused path moves it with
    ``non_blocking=True``, which can race with the kernel reading it.
    """
    if not weights:
        return
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    if (
        isinstance(lr, torch.Tensor)
        and lr.device != weights[0].device
        and weights[0].device.type != "cuda"
    ):
        lr = lr.to(weights[0].device)  # synchronous: the kernel reads it at once
    if increment:
        torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        weights, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr,
        beta1=float(beta1), beta2=float(beta2), weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"],
    )  # fmt: skip


def _grad_segments(b: Bucket, idx: list[int]) -> list[torch.Tensor]:
    """The flat grad ranges of a bucket's segments ``idx``."""
    segs = [b.segments[i] for i in idx]
    return [b.arena.params[s.k].grad.reshape(-1)[s.lo : s.hi] for s in segs]


class Pipeline:
    """Staging and streams of one device, and the bucket pipeline over them.

    Staging, all flat uint8 slots of ``nbytes`` allocated once: ``host`` (pinned on CUDA), and
    on CUDA ``d2h`` and ``h2d`` device slots (the casts run there). Each bucket is copied as one
    contiguous range, so every async copy is same dtype, contiguous and pinned on the host.
    """

    def __init__(self, device: torch.device, nbytes: int, pin: bool, owner: object):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = [  # SLOTS x (nbytes,) uint8, host, pinned on CUDA: grads land here (D2H)
            alloc_host(nbytes, torch.uint8, pin, "grad staging", owner) for _ in range(SLOTS)
        ]
        self.d2h_slots = self.h2d_slots = None
        self.d2h = self.h2d = None
        if self.cuda:
            self.d2h_slots = [  # SLOTS x (nbytes,) uint8, device: grads upcast here before D2H
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)
            ]
            self.h2d_slots = [  # SLOTS x (nbytes,) uint8, device: masters land here, then downcast
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)
            ]
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.h2d_events: dict[int, torch.cuda.Event] = {}  # id(bucket) -> its last H2D
        self.timing: list[tuple[str, Any, Any]] = []  # (stats key, start event, end event)
        # Test hook: called as hook("d2h" | "h2d") inside each side-stream context, before the
        # copies; the race tests queue a torch.cuda._sleep there to make the copies late.
        self.side_stream_hook: Callable[[str], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.host[0].numel()

    def record_start(self) -> Any:
        """An event on the compute stream marking all work queued before this step."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def _timed(self, stream) -> Any:
        """Start-of-copies event on ``stream``, for ``stats`` only: nothing waits on it."""
        if self.side_stream_hook is not None:
            self.side_stream_hook("d2h" if stream is self.d2h else "h2d")
        return stream.record_event(torch.cuda.Event(enable_timing=True))

    def _launch_d2h(self, b: Bucket, idx: list[int], slot: int, stats: dict) -> Any:
        """Copy bucket ``b``'s grads (segments ``idx``) into host slot ``slot``; the event to wait on."""
        host_slot = self.host[slot]
        if not self.cuda:
            views = b.slot_views(host_slot)
            torch._foreach_copy_([views[i] for i in idx], _grad_segments(b, idx))
            return None
        dev_slot = self.d2h_slots[slot]
        with torch.cuda.stream(self.d2h):
            start = self._timed(self.d2h)
            # On the side stream: a non-contiguous grad's flat copy is made (and freed) there.
            views = b.slot_views(dev_slot)
            torch._foreach_copy_(
                [views[i] for i in idx], _grad_segments(b, idx)
            )  # upcast on the GPU
            # non_blocking: same dtype, both contiguous, host side pinned -> a true async DMA;
            # the host reads the slot only after the event below.
            host_slot[: b.nbytes].copy_(dev_slot[: b.nbytes], non_blocking=True)
            done = self.d2h.record_event(torch.cuda.Event(enable_timing=True))
        self.timing.append(("d2h_ms", start, done))
        stats["d2h_nbytes"] += b.nbytes
        return done

    def _launch_h2d(self, b: Bucket, idx: list[int], slot: int, stats: dict) -> None:
        """Write bucket ``b``'s new weights (segments ``idx``) into its params."""
        targets = b.param_views()
        weights = b.state_views(b.arena.weight)
        if not self.cuda:
            torch._foreach_copy_([targets[i] for i in idx], [weights[i] for i in idx])
            return
        dev_slot = self.h2d_slots[slot]
        with torch.cuda.stream(self.h2d):
            start = self._timed(self.h2d)
            # non_blocking: pinned source, same dtype, contiguous; the host does not write these
            # weights again before this bucket's event has completed (checked in run()).
            dev_slot[: b.nbytes].copy_(
                b.arena.weight[b.lo : b.hi].view(torch.uint8), non_blocking=True
            )
            views = b.slot_views(dev_slot)
            torch._foreach_copy_(
                [targets[i] for i in idx], [views[i] for i in idx]
            )  # downcast on the GPU
            done = self.h2d.record_event(torch.cuda.Event(enable_timing=True))
        self.h2d_events[id(b)] = done
        self.timing.append(("h2d_ms", start, done))
        stats["h2d_nbytes"] += b.nbytes

    def run(
        self, items: list[tuple[Bucket, list[int]]], state, groups, before, stats: dict
    ) -> None:
        """Update the buckets ``items`` (``(bucket, segment indices whose param has a grad)``, in
        bucket order): D2H (k+1) and H2D (k-1) overlap the CPU update of bucket k.

        ``state`` is the optimizer's state (steps already advanced), ``groups`` its param groups,
        ``before`` the event of :meth:`record_start`; ``stats`` accumulates times and bytes.
        """
        if self.cuda:
            self.d2h.wait_event(before)  # grads final: backward and any in-place edit of them done
            self.h2d.wait_event(before)  # no queued compute kernel still reads the old weights
        pending = {
            n: self._launch_d2h(*items[n], n % SLOTS, stats) for n in range(min(SLOTS, len(items)))
        }
        for n, (b, idx) in enumerate(items):
            t = time.perf_counter()
            if self.cuda:
                pending.pop(n).synchronize()  # the host reads the pinned grads only once D2H landed
                last_h2d = self.h2d_events.get(id(b))
                if last_h2d is not None:
                    last_h2d.synchronize()  # last step's H2D from these weights is done: safe to overwrite
            stats["d2h_wait_ms"] += (time.perf_counter() - t) * 1e3
            lists = (b.state_views(b.arena.weight), b.slot_views(self.host[n % SLOTS]),
                     b.state_views(b.arena.exp_avg), b.state_views(b.arena.exp_avg_sq))  # fmt: skip
            # Only the segments whose param has a grad: the others may have no state yet.
            steps = [state[b.arena.params[b.segments[i].k]]["step"] for i in idx]
            t = time.perf_counter()
            with torch.profiler.record_function("offloadopt.cpu_update"):
                fused_adamw(groups[b.arena.group], *([x[i] for i in idx] for x in lists), steps,
                            increment=False)  # fmt: skip
            stats["cpu_update_ms"] += (time.perf_counter() - t) * 1e3
            if n + SLOTS < len(items):
                pending[n + SLOTS] = self._launch_d2h(
                    *items[n + SLOTS], n % SLOTS, stats
                )  # slot consumed above
            self._launch_h2d(b, idx, n % SLOTS, stats)
        if self.cuda and items:
            # GPU-side wait, no host sync: the next forward on the compute stream reads the
            # params only after the last H2D (the h2d stream runs its copies in order).
            torch.cuda.current_stream(self.device).wait_event(self.h2d_events[id(items[-1][0])])

    def collect_timing(self) -> dict[str, float]:
        """GPU milliseconds of the last run's copies and casts, per side stream."""
        totals = {"d2h_ms": 0.0, "h2d_ms": 0.0}
        for key, start, end in self.timing:
            end.synchronize()  # the events of the last step; long done by the next forward
            totals[key] += start.elapsed_time(end)
        self.timing = []
        return totals
