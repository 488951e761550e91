"""When the new weights are visible: ``synchronize()``, per-module waits (``watch``), the
delayed update's publication, ``zero_grad``; a mixin of :class:`offloadopt.optim.HybridOptimizer`
(steps.py's note has the rules: ``wait="step"``, ``wait="module"``, ``overlap="delayed"``)."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.link.worker import WaitTimeout
from offloadopt.shards import local
from offloadopt.step.step import Step
from offloadopt.warn import warn

__all__ = ["Waits"]


class Waits:
    """The waits of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    def _refuse_other_thread(self) -> None:
        """With ``overlap="delayed"`` only the thread that called ``step()`` publishes the update
        in flight (a fresh user's finding: a second thread's ``state_dict()`` or
        ``set_offload_fraction()`` copied the weights in while the training thread's forward
        read them: autograd's in-place error, or NaN weights).

        Raises:
            RuntimeError: called from another thread while a delayed update is in flight.
        """
        st = self._inflight
        if (
            st is not None
            and st.delayed
            and not self._closed
            and threading.get_ident() != st.thread
        ):
            raise RuntimeError(
                "overlap='delayed': the update in flight is copied into the params by the "
                "thread that called step(), between its steps; this call came from another "
                "thread, where the copy would race with that thread's forward and backward. "
                "Call state_dict(), load_state_dict(), set_offload_fraction(), "
                "opt.synchronize() or model.state_dict() of a watched model from the training "
                "thread"
            )

    def synchronize(self) -> None:
        """Wait for this optimizer's work in flight (host side), and make the current stream
        wait for every copy back (GPU side). A no-op when nothing is in flight.

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        st = self._inflight
        if st is None:
            self._wait_started()
            return
        self._refuse_other_thread()
        # A signal whose handler raises (Ctrl-C, a watchdog's SIGALRM) reaches it once the
        # step is whole: raised from the wait below it skipped the publication, so a delayed
        # update's masters and moments moved while the weights did not, silently, and the
        # next state_dict() paired them (found by benchmarks/faults.py).
        with signals_deferred():
            self._synchronize(st)

    def _synchronize(self, st: Step) -> None:
        self._inflight = None
        streams = self._inflight_streams
        try:
            st.run.wait(self.timeout_s)
        except BaseException as e:
            # Nothing of this step may still write params or state once the caller sees the
            # error (a load_state_dict right after it must stay loaded): drop the buckets not
            # started, wait for the one in hand; a wait that timed out cannot be trusted.
            st.run.abort()
            timed_out = isinstance(e, WaitTimeout)  # ours; not one a signal handler raised
            if not timed_out:
                st.run.job.done.wait(self.timeout_s)
            if timed_out or not st.run.job.done.is_set() or st.run.job.error is not None:
                self._broken = "an offloaded update failed or was interrupted"
            if st.run.job.done.is_set():
                self._publish_after_failure(st, streams)
            raise
        finally:
            self._pipeline.publish(streams, st.run)  # (I4) whatever landed is waited for
        if st.delayed:
            self._publish_delayed(st, streams)
        self._finish(st, streams)
        edited = [p for ref, version, p in st.lent
                  if (g := ref()) is not None and local(g)._version != version]  # fmt: skip
        if edited:
            # A fresh user's finding: model.zero_grad(set_to_none=False) or p.grad.zero_()
            # right after step() zeroed grads the worker had not copied yet, silently.
            names = ", ".join(self._records[p].name for p in edited[:3])
            self._broken = f"the grads of {len(edited)} params were edited in place ({names})"
            raise RuntimeError(
                f"the grads of {len(edited)} params ({names}{', ...' if len(edited) > 3 else ''})"
                " were changed in place after step() returned, while this step's copies could "
                "still read them (wait='module': step() returns before they are done), so their "
                "update may have read the changed values. Zero grads with opt.zero_grad() (it "
                "waits first) or set_to_none=True, or call opt.synchronize() before editing them"
            )

    def _wait_update(self) -> None:
        """Wait until the update in flight has written the host state (a read of
        ``opt.state``). Delayed, its weights are not copied in: reading must not end the
        staleness; otherwise (wait="module") this is :meth:`synchronize`.

        Raises:
            WorkerError, TimeoutError: as ``synchronize()`` (which then handles the failure).
        """
        st = self._inflight
        if st is not None and st.delayed:
            try:
                st.run.wait(self.timeout_s)
                return
            except BaseException:  # noqa: BLE001 - synchronize() raises it, marking the step
                pass
        self.synchronize()

    @torch.no_grad()
    def _publish_delayed(self, st: Step, streams) -> None:
        """overlap="delayed": copy the landed new weights into the params, on the stream that
        reads them (after its wait on their H2D, in synchronize). A param written outside the
        optimizer since the update started keeps that write: the next step refreshes its
        master from it (the outside write wins, as in every mode), with a warning."""
        by_device: dict[torch.device, tuple[list, list]] = {}
        kept = []
        for p in st.versions:
            rec = self._records[p]
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
                self._records[p].mark_written(p)
        if kept:
            warn(
                f"{len(kept)} params were written or moved outside the optimizer while their "
                f"delayed update was in flight (e.g. {', '.join(kept[:3])}): they keep that "
                "write, not the update (a framework moving the model at the end of training: "
                "call opt.synchronize() before it)"
            )

    def _publish_after_failure(self, st: Step, streams) -> None:
        """overlap="delayed", a step whose run failed (the worker stopped): the buckets whose
        update completed publish their weights (:meth:`_publish_completed`)."""
        if st.delayed and st.run is not None and st.run.job.done.wait(self.timeout_s):
            self._pipeline.publish(streams, st.run)
            self._publish_completed(st, streams)

    @torch.no_grad()
    def _publish_completed(self, st: Step, streams) -> None:
        """overlap="delayed", a step whose run failed: copy in the new weights of the buckets
        whose update completed (their fed segments), so that those params' weights agree with
        their masters and moments, as in the other modes, where each bucket's H2D writes its
        params; the others keep theirs. Without it, after ``discard_failed_step()`` the
        updated params trained on from masters their weights did not show, and a checkpoint
        paired the old fp32 weights with the new moments (found by benchmarks/faults.py)."""
        with st.run._cond:
            completed = [st.fed[b] for b in st.run.h2d_queued if b in st.fed]
        fresh: dict = {}  # param -> whether it takes the landed weights (checked before any copy)
        for work in completed:
            for n in work.idx:
                seg = work.bucket.segments[n]
                p = work.bucket.arena.params[seg.k]
                rec = self._records[p]
                if p not in fresh:  # an outside write wins, as in _publish_delayed
                    fresh[p] = rec.landing is not None and not rec.is_stale(p)
                if not fresh[p]:
                    continue
                stream = streams.get(p.device)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    local(p).view(-1)[seg.lo : seg.hi].copy_(rec.landing.view(-1)[seg.lo : seg.hi])
        for p, ok in fresh.items():
            if ok:
                self._records[p].mark_written(p)

    def watch(self, model: torch.nn.Module) -> None:
        """Register forward pre-hooks on the modules of ``model`` that own offloaded params;
        with ``wait="module"`` each waits only for its own params' copies back. Modules inside
        a ``torch.compile``d region are not waited for one by one (their pre-hooks trace as
        nothing, ``fullgraph=True`` included): once one has run compiled, or the model was
        compiled before this call, ``step()`` waits for every copy back before it returns (one
        full wait, as ``wait="step"``). Call it before the model's first compiled forward:
        torch.compile ignores hooks added after a region first ran (then the step after the
        first forward that waited for nothing warns, and ``step()`` waits for everything from
        there on). A region first compiled while a step's copies are in flight (after
        ``step()``, before the next forward): call ``opt.synchronize()`` before its first
        forward. Removed by ``close()``.

        Under FSDP2 call it after ``fully_shard``: the waits go on the FSDP2 modules, before
        FSDP2's own pre-forward (which all-gathers the module's shards on FSDP2's streams, and
        those of the modules it prefetches), and those streams wait too.

        Raises:
            ValueError: FSDP2 params (DTensors) in a model with no FSDP2 module (``watch()``
                before ``fully_shard``).
        """
        from offloadopt.step.hooks import ModuleWaits

        if self._budget_pending():  # placed at the first step(): the waits are registered then
            self._watch_later.append(weakref.ref(model))
            return
        self.ensure_placed()
        offloaded = {p for p, rec in self._records.items() if rec.offloaded}
        self._module_waits.append(ModuleWaits(self, model, offloaded))
        self._watched.append(weakref.ref(model))  # set_offload_fraction watches it again

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with ``set_to_none=False`` the grads are zeroed in place, so this first
        waits for copies that may still read them (``set_to_none=True`` does not wait: the
        copies hold their grads and ``record_stream`` protects the memory; with
        ``overlap="delayed"`` the update already took the offloaded params' grads).

        Raises:
            RuntimeError: between backward and ``step()`` once this step's updates began
                (declared backward mode: ``grads_final=True``, ``max_grad_norm=`` or
                ``grad_scaler=``); zeroing the grads would not skip the step (they ran with
                backward's grads), and nothing is changed. A fresh user's finding: the usual skip of a step with a
                non-finite loss was silently an update.
        """
        if self._updates_started():
            started = len(self._step.fed)
            raise RuntimeError(
                f"zero_grad() between backward and step(): this step's updates already began "
                f"({started} buckets, at the end of backward or during it with "
                "grads_final=True), so zeroing the grads cannot skip the step; nothing was "
                "changed. Call step() to finish it, or, to be able to skip steps (a "
                "non-finite loss), leave grads_final and max_grad_norm unset so that updates "
                "wait for step() (an attached GradScaler, grad_scaler=, skips a step whose "
                "grads hold an inf or NaN by itself)"
            )
        if not set_to_none and self.overlap != "delayed":
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def _compiled_region(self) -> bool:
        """A watched module ran inside a ``torch.compile``d region, where its per-module wait
        does not run (hooks.Compiled): ``step()`` waits for every copy back instead."""
        return self._unwaited or any(w.compiled.seen for w in self._module_waits)

    def _updates_started(self) -> bool:
        """Updates began before ``step()`` (backward mode, declared): from then until
        ``step()`` returns the worker writes the params of the buckets fed so far."""
        return self._timeline.updates_started()

    def _wait_started(self, params: list[torch.Tensor] | None = None, streams_too=()) -> None:
        """Between backward and ``step()`` (declared backward mode): wait until the updates
        started so far (of ``params``' buckets, or all) have queued their copies back, and
        make the current stream (and ``streams_too``) wait for them (I4), so that a forward
        or a read in that window (an evaluation, a second forward) sees whole new weights, not
        weights being written (a fresh user's finding: five different losses in 15 runs of
        one eval forward; tests/test_overlap.py, test_a_read_between_backward_and_step_...).

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        if not self._updates_started():
            return
        self._wait_buckets(self._step, params, streams_too)

    def _wait_buckets(self, st: Step, params, streams_too=()) -> None:
        """Of the buckets fed to ``st`` (those of ``params``, or all), those not waited for
        yet: block until the worker has queued each one's H2D, then make the current stream
        and ``streams_too`` wait on it."""
        if params is None:
            buckets = list(st.fed)  # a copy: autograd's thread may feed more meanwhile
        else:  # a module's few buckets, not a scan of all (its pre-hook runs every forward)
            buckets = [b for p in params for b in self._records[p].buckets if b in st.fed]
        for b in buckets:
            if b in st.waited:
                continue
            st.run.wait_h2d_queued(b, self.timeout_s)  # its event exists from here on
            tr = self._pipeline.transfers[b.arena.device]
            if tr.cuda:
                # (I4) what runs next on these streams reads the params only after their H2D.
                torch.cuda.current_stream(b.arena.device).wait_event(tr.h2d_done[b])
                for stream in streams_too:
                    stream.wait_event(tr.h2d_done[b])
            st.waited.add(b)

    def _wait_for(self, params: list[torch.Tensor], streams_too: tuple = ()) -> None:
        """A module's forward pre-hook: its stream, and ``streams_too`` (FSDP2's all-gather
        streams), wait for the copies back of ``params`` (overlap="delayed": none; the forward
        reads the weights of the step before), and for the updates of the step in progress
        that started before ``step()`` (:meth:`_wait_started`)."""
        self._wait_started(params, streams_too)
        st = self._inflight
        if st is None or st.delayed:
            return
        self._wait_buckets(st, params, streams_too)  # (I4) the forward reads them after their H2D
        if len(st.waited) == len(st.fed):
            self.synchronize()  # every copy back is waited for: the step is over
