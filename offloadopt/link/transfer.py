"""Moving one bucket's bytes over the link, per device: a staging slot ring and two side streams.

[Note: pipeline invariants] Every sync line in this file and in pipeline.py cites one of these:

- (I1) *Grads are final before D2H*: the D2H side stream waits on an event recorded on the
  stream that produced the grads (handed in by the caller: the training thread's stream at
  ``step()``), so backward and any in-place edit of the grads queued before it are done.
- (I2) *The host reads a slot only after its D2H event*: the worker waits on the bucket's
  D2H-done event before the CPU update reads the pinned grads.
- (I3) *The host writes a master only after the last H2D from it*: before the CPU update of a
  bucket, the worker waits on that bucket's previous H2D-done event.
- (I4) *The forward reads a param only after its H2D*: the H2D side stream first waits on the
  caller's event (no queued kernel still reads the old weights), and the consumer's stream
  waits on the bucket's H2D-done event before it reads the params.
- (I5) *A slot is reused only once free*: a staging slot goes back to the ring only after the
  host finished reading it; whoever starts a D2H takes a slot from the ring first, waiting for
  one (backpressure) with a timeout that names what it waited for.

Without CUDA the same calls make plain synchronous copies (the CPU stands in for the device):
no streams, no events, no pinning.
"""

from __future__ import annotations

import queue
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt.link.host import HostBuffers
from offloadopt.link.layout import Bucket
from offloadopt.link.times import LinkTimes
from offloadopt.link.worker import WaitTimeout
from offloadopt.shards import local

__all__ = ["SLOTS", "Slot", "SlotRing", "Transfer", "wait_event"]

SLOTS = 2  # staging slots per device: bucket k+1 moves while bucket k is updated


def wait_event(event: Any, what: str, timeout_s: float) -> None:
    """Block the calling thread until ``event`` (a CUDA event, or None) has completed.

    Polls instead of ``event.synchronize()`` so that the wait can end: a GPU that never
    finishes raises instead of hanging the caller.

    Raises:
        TimeoutError: not done after ``timeout_s`` seconds; the message says what was awaited.
    """
    if event is None or event.query():
        return
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise WaitTimeout(f"offloadopt: waited {timeout_s:g} s for {what}; it never finished")
        time.sleep(20e-6)


@dataclass(eq=False)
class Slot:
    """One staging slot: flat uint8 buffers of the ring's ``nbytes``.

    ``link``: the dtype the grads of the bucket now in the slot crossed in (set by
    :meth:`Transfer.start_d2h`): the update dtype, or the arena's ``link_dtype`` (bf16), in
    which case the update writes the new bf16 weights over those grads in ``host`` and they
    cross H2D from there (:meth:`Transfer.start_h2d`); ``host_read``: the event of that H2D,
    which the next D2H into ``host`` waits for (I5)."""

    index: int
    host: torch.Tensor  # (nbytes,) uint8, host, pinned on CUDA: grads land here (D2H)
    d2h: torch.Tensor | None  # (nbytes,) uint8, device: grads upcast here before D2H
    h2d: torch.Tensor | None  # (nbytes,) uint8, device: masters land here, then downcast
    link: torch.dtype | None = None
    host_read: Any = None

    def holds_weights(self, b: Bucket) -> bool:
        """Whether bucket ``b``'s grads crossed in its narrower link dtype, so that the update
        writes the new weights into ``host`` and they cross H2D from there."""
        return self.link is not None and self.link != b.arena.dtype


@dataclass(eq=False)
class _Plan:
    """One bucket's operands in one staging slot, made once and reused every step (the
    worker launches two copies per bucket per step; rebuilding these views each time cost
    more than the copies' own launches: benchmarks/RESULTS.md, the launch profile). Only
    views of staging and of the master: the slot and the master never move while they live
    (a new slot ring makes new plans, a re-placed arena new buckets, and ``master_ptr`` is
    checked). No view of a param is kept: it would keep a rebound param's old memory alive."""

    master_ptr: int  # the arena master's address when the plan was made
    d2h_views: list[torch.Tensor]  # per segment: its range of slot.d2h, in the link dtype
    d2h_flat: torch.Tensor  # slot.d2h[:nbytes]: the D2H's source
    host_flat: torch.Tensor  # slot.host[:nbytes]: the D2H's destination (pinned)
    h2d_flat: torch.Tensor  # slot.h2d[:nbytes]: the H2D's destination
    h2d_views: list[torch.Tensor]  # per segment: its range of slot.h2d, in the link dtype
    # the H2D's source, as uint8 (pinned): the bucket's range of the master (update dtype),
    # or host_flat (the link dtype: the update wrote the new weights there)
    master_bytes: torch.Tensor
    # segment -> its h2d view shaped like its param (a segment that is a whole param)
    shaped: dict[int, torch.Tensor] = field(default_factory=dict)


class _OnStream:
    """``with _OnStream(stream):`` queues the block's CUDA work on ``stream`` and afterwards
    puts back the calling thread's previous stream of that device: torch.cuda.stream's effect
    without the Python device and stream objects that it builds on each use (it cost tens of
    microseconds a bucket on the worker; make one per use). The calling thread's current
    device stays the stream's: the worker's only CUDA work is these copies, and putting back
    its initial device 0 on a rank of another GPU would make a context on GPU 0."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: Any):
        self.stream = stream

    def __enter__(self) -> None:
        s = self.stream
        self.prev = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(
            stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type
        )

    def __exit__(self, *exc: object) -> None:
        sid, index, kind = self.prev
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=kind)


class SlotRing:
    """:data:`SLOTS` staging slots, handed out in FIFO order: a slot is taken before a D2H
    writes it and given back once the host has read it (I5)."""

    def __init__(self, device: torch.device, nbytes: int, pin: bool, count: int = SLOTS):
        self.nbytes = nbytes
        self.buffers = HostBuffers(self)
        self.slots = []
        for i in range(count):
            host = self.buffers.alloc(nbytes, torch.uint8, pin, f"grad staging slot {i}")
            d2h = h2d = None
            if device.type == "cuda":
                d2h = torch.empty(nbytes, dtype=torch.uint8, device=device)
                h2d = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.slots.append(Slot(i, host, d2h, h2d))
        self._free: queue.Queue[Slot] = queue.Queue()
        for slot in self.slots:
            self._free.put(slot)

    def acquire(self, timeout_s: float, what: str) -> Slot:
        """The next free slot, waiting for the host to give one back (backpressure).

        Raises:
            TimeoutError: none came back within ``timeout_s``; names what it waited for.
        """
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise WaitTimeout(
                f"offloadopt: waited {timeout_s:g} s for a free staging slot for {what}"
            ) from None

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def close(self) -> None:
        """Unpin the host slots now; the caller guarantees no copy still uses them."""
        self.buffers.close()


class Transfer:
    """The staging ring and, on CUDA, the D2H and H2D side streams of one device.

    Each bucket is copied as one contiguous range of a slot, so every async copy is same dtype,
    contiguous and pinned on the host side. Both casts run on the device: grads are upcast to
    the update dtype into the device slot before D2H; masters land in a device slot and are
    downcast into the params (benchmarks/RESULTS.md has the figures behind this choice).

    An arena whose ``link_dtype`` is not its update dtype (bf16 params under a compressed
    representation with fp32 masters: offloadopt's kernel reads bf16 grads and writes the
    bf16 weights itself) moves 2 bytes per element each way instead of 4: its grads cross in
    bf16 and the update writes the new weights over them in the host slot, from where they
    cross H2D. A bucket whose grads get clip factors (``scale``) crosses as before: the
    factors multiply the fp32 grads on the device. Either way the bits are the same: the
    upcast is exact, and the kernel's round to nearest even is the device's downcast
    (tests/test_link_dtype.py).
    """

    def __init__(self, device: torch.device, nbytes: int, pin: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.ring = SlotRing(device, nbytes, pin)
        self.d2h = self.h2d = None
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
        # bucket -> slot index -> its operands (weak: a re-placed optimizer's old buckets go)
        self._plans: weakref.WeakKeyDictionary[Bucket, dict[int, _Plan]] = (
            weakref.WeakKeyDictionary()
        )
        # without CUDA: bucket -> segment -> its master range shaped like its param
        self._host_shaped: weakref.WeakKeyDictionary[Bucket, dict[int, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self.h2d_done: dict[Bucket, Any] = {}  # bucket -> the event of its last H2D
        self.timing = LinkTimes()  # the copies' events, added from the worker's thread
        # Test hook: called as hook("d2h" | "h2d") inside each side-stream context, before the
        # copies; the race tests queue a torch.cuda._sleep there to make the copies late.
        self.side_stream_hook: Callable[[str], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def host_slots(self) -> list[torch.Tensor]:
        return [s.host for s in self.ring.slots]

    def adopt(self, old: Transfer) -> None:
        """Take over ``old``'s per-bucket events and hooks (staging grew: same device)."""
        self.h2d_done, self.side_stream_hook = old.h2d_done, old.side_stream_hook

    def forget(self, buckets: list[Bucket], timeout_s: float) -> None:
        """Drop what this transfer keeps of ``buckets`` (their last H2D's event, their plans),
        which a new placement replaced, after waiting for each one's last H2D on the host (the
        caller frees their masters next). Kept, an old bucket would keep its arena's host
        buffers alive through its cached views.

        Raises:
            TimeoutError: an H2D not done after ``timeout_s`` (names the bucket)."""
        for b in buckets:
            # (I3) the master goes after this: its last H2D must be done (host wait, once)
            wait_event(self.h2d_done.pop(b, None), f"the last H2D of {b.label}", timeout_s)
            self._plans.pop(b, None)
            self._host_shaped.pop(b, None)

    def mark(self, stream: Any) -> Any:
        """An event on ``stream`` (the caller's stream, captured by the caller) marking all
        work queued on it so far; None without CUDA."""
        return stream.record_event() if self.cuda else None

    def _timed_start(self, stream) -> Any:
        """Start-of-copies event on ``stream``, for ``stats`` only: nothing waits on it."""
        if self.side_stream_hook is not None:
            self.side_stream_hook("d2h" if stream is self.d2h else "h2d")
        return stream.record_event(torch.cuda.Event(enable_timing=True))

    def start_d2h(
        self,
        b: Bucket,
        idx: list[int],
        grads: list[torch.Tensor],
        slot: Slot,
        grads_ready: Any,
        scale: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    ) -> Any:
        """Copy ``grads`` (the flat grad ranges of bucket ``b``'s segments ``idx``) into
        ``slot.host``, multiplied by ``scale`` (a clip coefficient, or a tuple of factors in
        order) in the update dtype when given; returns the D2H-done event to wait on (None
        without CUDA: done on return)."""
        factors = () if scale is None else scale if isinstance(scale, tuple) else (scale,)
        slot.link = b.arena.dtype if factors else b.arena.link_dtype
        if not self.cuda:
            views = [b.slot_views(slot.host, slot.link)[i] for i in idx]
            torch._foreach_copy_(views, grads)
            for f in factors:
                torch._foreach_mul_(views, f)
            return None
        plan = self._plan(b, slot, slot.link)
        with _OnStream(self.d2h):
            self.d2h.wait_event(grads_ready)  # (I1) grads final: backward and edits queued before
            if slot.host_read is not None:  # (I5) the last H2D from this host slot is done
                self.d2h.wait_event(slot.host_read)
            start = self._timed_start(self.d2h)
            for g in grads:
                # The grads were made on another stream: their memory is not reused (after a
                # zero_grad) before this stream's reads of it are done.
                g.record_stream(self.d2h)
            views = plan.d2h_views
            if len(idx) != len(views):
                views = [views[i] for i in idx]
            torch._foreach_copy_(views, grads)  # upcast on the GPU (or a same-dtype copy)
            for f in factors:  # the inverse scale, the clip coefficient: in the update dtype
                torch._foreach_mul_(views, f)
            # non_blocking: same dtype, both contiguous, host side pinned -> a true async DMA;
            # the host reads the slot only after the event below (I2).
            plan.host_flat.copy_(plan.d2h_flat, non_blocking=True)
            done = self.d2h.record_event(torch.cuda.Event(enable_timing=True))
        self.timing.add("d2h_ms", start, done, b.link_nbytes(slot.link))
        return done

    def wait_h2d_done(self, b: Bucket, timeout_s: float) -> None:
        """(I3) Block until the last H2D from ``b``'s master is done: the host may write it."""
        wait_event(self.h2d_done.get(b), f"the last H2D of {b.label}", timeout_s)

    def start_h2d(
        self,
        b: Bucket,
        idx: list[int],
        slot: Slot,
        weights_free: Any,
        targets: list[torch.Tensor] | None = None,
    ) -> None:
        """Write bucket ``b``'s new weights (segments ``idx``) into its params, or into
        ``targets`` (one flat view per segment: overlap="delayed"'s landing buffers); on CUDA
        the copy is queued and :attr:`h2d_done` holds its event. The source is the master,
        or where ``slot.link`` is not the update dtype the new weights that the update wrote
        in ``slot.host``; then the slot's next D2H waits for this copy (``slot.host_read``)."""
        link = slot.link if slot.holds_weights(b) else b.arena.dtype
        if not self.cuda:  # the master itself is the source: the same pairs as on CUDA
            if link == b.arena.dtype:
                masters = b.state_views(b.arena.master)
            else:
                masters = b.slot_views(slot.host, link)
            if targets is None:
                shaped = self._host_shaped.get(b)
                if shaped is None:
                    shaped = self._host_shaped[b] = {}
                torch._foreach_copy_(*self._h2d_pairs(b, masters, shaped, idx))
            else:
                torch._foreach_copy_([targets[i] for i in idx], [masters[i] for i in idx])
            return
        plan = self._plan(b, slot, link)
        if targets is None:
            targets, views = self._h2d_pairs(b, plan.h2d_views, plan.shaped, idx)
        else:
            views = plan.h2d_views
            if len(idx) != len(views):  # idx: increasing segment indices (steps, backward)
                targets, views = [targets[i] for i in idx], [views[i] for i in idx]
        with _OnStream(self.h2d):
            # (I4) no queued kernel still reads the old weights (delayed: the landing buffer's
            # last copy into the params is done)
            self.h2d.wait_event(weights_free)
            start = self._timed_start(self.h2d)
            # non_blocking: pinned source, same dtype, contiguous; the host does not write this
            # master again before this bucket's event has completed (I3).
            plan.h2d_flat.copy_(plan.master_bytes, non_blocking=True)
            torch._foreach_copy_(targets, views)  # downcast (or a same-dtype copy)
            done = self.h2d.record_event(torch.cuda.Event(enable_timing=True))
        self.h2d_done[b] = done
        if link != b.arena.dtype:
            slot.host_read = done  # (I5) the host slot is this copy's source until it is done
        self.timing.add("h2d_ms", start, done, b.link_nbytes(link))

    def _plan(self, b: Bucket, slot: Slot, link: torch.dtype | None = None) -> _Plan:
        """Bucket ``b``'s operands in ``slot`` with grads and weights in ``link`` (default the
        update dtype) (CUDA), made on first use (see :class:`_Plan`)."""
        link = b.arena.dtype if link is None else link
        master = b.arena.master
        plans = self._plans.get(b)
        if plans is None:
            plans = self._plans[b] = {}
        plan = plans.get((slot.index, link))
        if plan is None or plan.master_ptr != master.data_ptr():
            n = b.link_nbytes(link)
            host_flat = slot.host[:n]
            plan = plans[slot.index, link] = _Plan(
                master_ptr=master.data_ptr(),
                d2h_views=list(b.slot_views(slot.d2h, link)),
                d2h_flat=slot.d2h[:n],
                host_flat=host_flat,
                h2d_flat=slot.h2d[:n],
                h2d_views=list(b.slot_views(slot.h2d, link)),
                master_bytes=(
                    master[b.lo : b.hi].view(torch.uint8) if link == b.arena.dtype else host_flat
                ),
            )
        return plan

    @staticmethod
    def _h2d_pairs(
        b: Bucket, flat: list[torch.Tensor], shaped: dict[int, torch.Tensor], idx: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The downcast's targets and sources for segments ``idx`` of ``b``, whose new weights
        are ``flat`` (one flat view per segment: a staging slot's on CUDA, the master's on the
        CPU): a segment that is a whole param writes the param itself from its source viewed
        in the param's shape (kept in ``shaped``, by segment), a part of a param a flat view
        of it made now. So no view of a param outlives the call (a kept one would keep a
        rebound param's old memory alive)."""
        params = b.arena.params
        targets, sources = [], []
        for i in idx:
            s, src = b.segments[i], flat[i]
            p = local(params[s.k])
            if s.lo == 0 and s.hi == p.numel() and p.is_contiguous():  # (else: view raises)
                view = shaped.get(i)
                if view is None or view.shape != p.shape or view.data_ptr() != src.data_ptr():
                    view = shaped[i] = src.view(p.shape)
                targets.append(p)
                sources.append(view)
            else:
                targets.append(p.view(-1)[s.lo : s.hi])
                sources.append(src)
        return targets, sources

    def publish(self, stream: Any, buckets: list[Bucket]) -> None:
        """(I4) GPU-side wait, no host sync: ``stream`` (the consumer's, handed in) reads the
        params of ``buckets`` (in the order their H2D was queued) only after their H2D. The H2D
        stream runs its copies in order, so the event of the bucket whose H2D was queued last
        covers every earlier one."""
        if self.cuda and buckets:
            stream.wait_event(self.h2d_done[buckets[-1]])

    def collect_link(self) -> dict[str, tuple[float, int]]:
        """GPU milliseconds of the copies and casts recorded since the last call, per stream,
        with the bytes they moved: key -> (ms, bytes). Waits for those events (the last
        step's; long done by the next forward)."""
        return self.timing.take()

    def close(self) -> None:
        """Wait for this device's copies, then unpin the staging now."""
        if self.cuda:
            self.d2h.synchronize()  # no D2H still writes the host slots
            self.h2d.synchronize()  # no H2D still reads a master
        self.ring.close()
