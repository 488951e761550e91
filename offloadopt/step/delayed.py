"""``overlap="delayed"``'s publish policy, :class:`NextStep`: a step's update lands during the
next forward and backward, and its weights are copied in at the next ``step()`` (start.py's
note has the rules; the policies' shared waits are step/publish.py's :class:`Publisher`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from offloadopt.shards import local
from offloadopt.step.publish import Publisher
from offloadopt.step.step import Step
from offloadopt.warn import warn

__all__ = ["NextStep"]


class NextStep(Publisher):
    """``overlap="delayed"`` (the delayed parameter update): the worker's H2D writes each
    param's landing buffer (``ParamRecord.landing``), not the param, so the next forward and
    backward read the weights of the step before; the next ``step()``, or anything that calls
    ``synchronize()``, waits for the update and copies the landed weights in on the stream
    that reads them (:meth:`publish_delayed`). The steps before ``delay_after`` are not delayed
    (``Step.delayed`` is False): published when ``step()`` returns, as :class:`AtReturn`."""

    def after_step(self, st: Step, streams: dict[torch.device, Any]) -> None:
        super().after_step(st, streams)
        if not st.delayed:
            self.synchronize()

    def before_zero_grad(self, set_to_none: bool) -> None:
        """No wait: the update already took the offloaded params' grads."""

    def refuse_other_thread(self) -> None:
        """With ``overlap="delayed"`` only the thread that called ``step()`` publishes the update
        in flight (a fresh user's finding: a second thread's ``state_dict()`` or
        ``set_offload_fraction()`` copied the weights in while the training thread's forward
        read them: autograd's in-place error, or NaN weights).

        Raises:
            RuntimeError: called from another thread while a delayed update is in flight.
        """
        st = self.timeline.inflight
        if (
            st is None
            or not st.delayed
            or self.timeline.closed
            or threading.get_ident() == st.thread
        ):
            return
        raise RuntimeError(
            "overlap='delayed': the update in flight is copied into the params by the "
            "thread that called step(), between its steps; this call came from another "
            "thread, where the copy would race with that thread's forward and backward. "
            "Call state_dict(), load_state_dict(), set_offload_fraction(), "
            "opt.synchronize() or model.state_dict() of a watched model from the training "
            "thread"
        )

    def wait_update(self) -> None:
        """Wait until the update in flight has written the host state (a read of
        ``opt.state``). Delayed, its weights are not copied in: reading must not end the
        staleness; otherwise this is :meth:`synchronize`.

        Raises:
            WorkerError, TimeoutError: as ``synchronize()`` (which then handles the failure).
        """
        st = self.timeline.inflight
        if st is not None and st.delayed:
            try:
                st.run.wait(self.timeout_s)
                return
            except BaseException:  # noqa: BLE001 - synchronize() raises it, marking the step
                pass
        self.synchronize()

    def publish(self, st: Step, streams: dict) -> None:
        if st.delayed:
            self.publish_delayed(st, streams)

    @torch.no_grad()
    def publish_delayed(self, st: Step, streams) -> None:
        """Copy the landed new weights into the params, on the stream that reads them (after
        its wait on their H2D, in synchronize). A param written outside the optimizer since
        the update started keeps that write: the next step refreshes its master from it (the
        outside write wins, as in every mode), with a warning."""
        by_device: dict[torch.device, tuple[list, list]] = {}
        kept = []
        for p in st.versions:
            rec = self.records[p]
            if rec.landing is None:
                continue
            if rec.is_stale(p):
                kept.append(rec.name)
                continue
            params, landed = by_device.setdefault(p.device, ([], []))
            params.append(p)
            landed.append(rec.landing)
        for device, (params, landed) in by_device.items():
            stream = streams.get(device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                torch._foreach_copy_([local(p) for p in params], landed)
            for p in params:
                self.records[p].mark_written(p)
        if kept:
            warn(
                f"{len(kept)} params were written or moved outside the optimizer while their "
                f"delayed update was in flight (e.g. {', '.join(kept[:3])}): they keep that "
                "write, not the update (a framework moving the model at the end of training: "
                "call opt.synchronize() before it)"
            )

    def publish_after_failure(self, st: Step, streams) -> None:
        """A delayed step whose run failed (the worker stopped): the buckets whose update
        completed publish their weights (:meth:`publish_completed`)."""
        if st.delayed and st.run is not None and st.run.job.done.wait(self.timeout_s):
            self.placer.pipeline.publish(streams, st.run)
            self.publish_completed(st, streams)

    @torch.no_grad()
    def publish_completed(self, st: Step, streams) -> None:
        """A delayed step whose run failed: copy in the new weights of the buckets whose
        update completed (their fed segments), so that those params' weights agree with
        their masters and moments, as in the other modes, where each bucket's H2D writes its
        params; the others keep theirs. Without it, after ``discard_failed_step()`` the
        updated params trained on from masters their weights did not show, and a checkpoint
        paired the old fp32 weights with the new moments (found by tests/long/faults.py)."""
        with st.run._cond:
            completed = [st.fed[b] for b in st.run.h2d_queued if b in st.fed]
        fresh: dict = {}  # param -> whether it takes the landed weights (checked before any copy)
        for work in completed:
            for n in work.idx:
                seg = work.bucket.segments[n]
                p = work.bucket.arena.params[seg.k]
                rec = self.records[p]
                if p not in fresh:  # an outside write wins, as in publish_delayed
                    fresh[p] = rec.landing is not None and not rec.is_stale(p)
                if not fresh[p]:
                    continue
                stream = streams.get(p.device)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    local(p).view(-1)[seg.lo : seg.hi].copy_(rec.landing.view(-1)[seg.lo : seg.hi])
        for p, ok in fresh.items():
            if ok:
                self.records[p].mark_written(p)
