"""WHEN the new weights are visible: the publish policy, chosen once from the options
(offloadopt/wiring.py's ``publisher_for``). It owns the waits for a step's copies back (``synchronize()``, a
module's forward pre-hook, a read of ``opt.state``), the models given to ``watch()`` and their
module waits, the end of ``step()`` once its buckets are queued, and the delayed update's
publication (start.py's note has the rules): :class:`AtReturn` (``wait="step"``), at the return
of ``step()``; :class:`PerModule` (``wait="module"``), in each watched module's forward
pre-hook; ``NextStep`` (``overlap="delayed"``, step/delayed.py), at the next ``step()``.

Three small subclasses rather than one class with a mode field: what differs between the modes
is a handful of decisions (what ``step()`` does once its buckets are queued, what the next
step checks first, what a read of the state and ``zero_grad(set_to_none=False)`` wait for,
whether a finished step has weights to copy in), each one method of one subclass; a mode field
would make each an if on the mode, as ``step()`` had. What every policy shares (the waits, the
watched models) is the base :class:`Publisher`'s. Whether a step is delayed stays the step's
own (``Step.delayed``: ``delay_after`` makes a delayed run's first steps synchronous).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.link.worker import WaitTimeout
from offloadopt.place.placer import Placer
from offloadopt.place.records import ParamRecord
from offloadopt.shards import local
from offloadopt.step.hooks import ModuleWaits, dynamo_compiled_any
from offloadopt.step.step import Phase, Step, Timeline

__all__ = ["Publisher", "AtReturn", "PerModule"]


class Publisher:
    """What every publish policy shares: the waits for a step's copies back and the models
    given to ``watch()``. A subclass decides what ``step()`` does at its end (:meth:`after_step`).

    Args:
        timeline: the optimizer's :class:`~offloadopt.step.step.Timeline` (the step in flight
            and its streams are cleared here once waited for; a failed wait refuses the
            optimizer through it).
        records: param -> its :class:`~offloadopt.place.records.ParamRecord` (the optimizer's
            own dict, emptied and refilled in place): which buckets hold a param, its landing
            buffer, its name for messages, its written marks.
        placer: the :class:`~offloadopt.place.placer.Placer`: its ``pipeline`` (None before
            the first offloaded bucket is placed; read only while a step is in flight, when it
            exists).
        timeout_s: the longest wait for the worker, in seconds (``TimeoutError`` past it).
        warn_once: ``warn_once(key, message)`` warns once per optimizer for each ``key``.
        (``timeline.closed``: a closed optimizer's update in flight may be waited for from
        any thread.)

    Owns: ``module_waits`` (the :class:`~offloadopt.step.hooks.ModuleWaits` of each watched
    model; ``close()`` and re-placement take them off), ``watched`` (weak references to the
    models given to ``watch()``, watched again after a re-placement), ``watch_later`` (models
    given to ``watch()`` before a budget's choice: watched once placed) and ``unwaited`` (a
    forward ran past its waits: from then on ``step()`` waits for everything).
    """

    def __init__(
        self,
        timeline: Timeline,
        records: dict[torch.Tensor, ParamRecord],
        placer: Placer,
        *,
        timeout_s: float,
        warn_once: Callable[[str, str], None],
    ):
        self.timeline = timeline
        self.records = records
        self.placer = placer
        self.timeout_s = timeout_s
        self._finish: Callable[[], Callable[[Step, dict], None] | None] = lambda: None
        self.warn_once = warn_once
        self.module_waits: list[ModuleWaits] = []
        self.unwaited = False  # a forward ran past its waits (PerModule.before_step)
        self.watched: list = []  # weak references to the models given to watch()
        self.watch_later: list = []  # watch() before a budget's choice: registered after it

    def finish(self, st: Step, streams: dict) -> None:
        """End a step whose copies are all waited for (its params marked written, its
        figures made the optimizer's ``stats``): the Feeder's ``finish`` (:meth:`ends`)."""
        self._finish()(st, streams)

    def ends(self, finish: Callable[[Step, dict], None]) -> None:
        """``finish``: the Feeder's bound ``finish``, which the Feeder hands over as it is
        built. Held weakly: the Feeder holds this publisher, and a cycle between owners would
        keep a dropped optimizer's memory (its state, through the Updater) until Python's gc."""
        self._finish = weakref.WeakMethod(finish)

    # ------------------------------------------------------------------ step()'s ends
    def before_step(self) -> None:
        """A new step begins: the step before is over (its copies back waited for, a delayed
        update copied in).

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        self.synchronize()  # the previous step's copies back (wait="module") are done

    def end_step(self, st: Step, streams: dict[torch.device, Any]) -> None:
        """``step()``'s last phase: a step that fed nothing to the worker ends now; otherwise
        its run is closed (every bucket queued) and :meth:`after_step` says when its weights
        become visible (the policy chosen at construction)."""
        if st.run is None:
            self.finish(st, streams)
            return
        st.run.close()
        st.phase = Phase.STEPPED
        self.after_step(st, streams)

    def after_step(self, st: Step, streams: dict[torch.device, Any]) -> None:
        """The end of ``step()`` once ``st``'s offloaded buckets are all queued (its run
        closed): ``st`` is in flight, its weights read on ``streams`` (device -> the training
        thread's stream, None on the CPU); a subclass says when they become visible.

        Raises:
            WorkerError, TimeoutError: as ``step()`` (where the policy waits here).
        """
        self.timeline.inflight, self.timeline.inflight_streams = st, streams

    def before_zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad(set_to_none=False)`` zeroes the grads in place: first wait for the
        copies that may still read them (``set_to_none=True`` does not wait: the copies hold
        their grads and ``record_stream`` protects the memory)."""
        if not set_to_none:
            self.synchronize()

    # ------------------------------------------------------------------ waits
    def refuse_other_thread(self) -> None:
        """Only a delayed update is published by one thread (:class:`NextStep`); nothing here."""

    def synchronize(self) -> None:
        """Wait for the work in flight (host side), and make the current stream wait for
        every copy back (GPU side). A no-op when nothing is in flight.

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        st = self.timeline.inflight
        if st is None:
            self.wait_started()
            return
        self.refuse_other_thread()
        # A signal whose handler raises (Ctrl-C, a watchdog's SIGALRM) reaches it once the
        # step is whole: raised from the wait below it skipped the publication, so a delayed
        # update's masters and moments moved while the weights did not, silently, and the
        # next state_dict() paired them (found by tests/long/faults.py).
        with signals_deferred():
            self._synchronize(st)

    def _synchronize(self, st: Step) -> None:
        timeline = self.timeline
        timeline.inflight = None
        streams = timeline.inflight_streams
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
                timeline.refuse("an offloaded update failed or was interrupted")
            if st.run.job.done.is_set():
                self.publish_after_failure(st, streams)
            raise
        finally:
            self.placer.pipeline.publish(streams, st.run)  # (I4) whatever landed is waited for
        self.publish(st, streams)
        self.finish(st, streams)
        edited = [p for ref, version, p in st.lent
                  if (g := ref()) is not None and local(g)._version != version]  # fmt: skip
        if edited:
            # A fresh user's finding: model.zero_grad(set_to_none=False) or p.grad.zero_()
            # right after step() zeroed grads the worker had not copied yet, silently.
            names = ", ".join(self.records[p].name for p in edited[:3])
            timeline.refuse(f"the grads of {len(edited)} params were edited in place ({names})")
            raise RuntimeError(
                f"the grads of {len(edited)} params ({names}{', ...' if len(edited) > 3 else ''})"
                " were changed in place after step() returned, while this step's copies could "
                "still read them (wait='module': step() returns before they are done), so their "
                "update may have read the changed values. Zero grads with opt.zero_grad() (it "
                "waits first) or set_to_none=True, or call opt.synchronize() before editing them"
            )

    def publish(self, st: Step, streams: dict) -> None:
        """Every copy back of ``st`` is waited for: its new weights are in the params already
        (each bucket's H2D wrote them). :class:`NextStep` copies a delayed update in here."""

    def publish_after_failure(self, st: Step, streams: dict) -> None:
        """A step whose run failed: each bucket's H2D wrote its params, nothing to copy in
        (:class:`NextStep` copies in the completed buckets of a delayed update)."""

    def wait_update(self) -> None:
        """Wait until the update in flight has written the host state (a read of
        ``opt.state``): here :meth:`synchronize` (:class:`NextStep` does not copy a delayed
        update in).

        Raises:
            WorkerError, TimeoutError: as ``synchronize()`` (which then handles the failure).
        """
        self.synchronize()

    def wait_started(self, params: list[torch.Tensor] | None = None, streams_too=()) -> None:
        """Between backward and ``step()`` (declared backward mode): wait until the updates
        started so far (of ``params``' buckets, or all) have queued their copies back, and
        make the current stream (and ``streams_too``) wait for them (I4), so that a forward
        or a read in that window (an evaluation, a second forward) sees whole new weights, not
        weights being written (a fresh user's finding: five different losses in 15 runs of
        one eval forward; tests/test_overlap.py, test_a_read_between_backward_and_step_...).

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        if not self.timeline.updates_started():
            return
        self.wait_buckets(self.timeline.current, params, streams_too)

    def wait_buckets(self, st: Step, params, streams_too=()) -> None:
        """Of the buckets fed to ``st`` (those of ``params``, or all), those not waited for
        yet: block until the worker has queued each one's H2D, then make the current stream
        and ``streams_too`` wait on it."""
        if params is None:
            buckets = list(st.fed)  # a copy: autograd's thread may feed more meanwhile
        else:  # a module's few buckets, not a scan of all (its pre-hook runs every forward)
            buckets = [b for p in params for b in self.records[p].buckets if b in st.fed]
        for b in buckets:
            if b in st.waited:
                continue
            st.run.wait_h2d_queued(b, self.timeout_s)  # its event exists from here on
            tr = self.placer.pipeline.transfers[b.arena.device]
            if tr.cuda:
                # (I4) what runs next on these streams reads the params only after their H2D.
                torch.cuda.current_stream(b.arena.device).wait_event(tr.h2d_done[b])
                for stream in streams_too:
                    stream.wait_event(tr.h2d_done[b])
            st.waited.add(b)

    def wait_for(self, params: list[torch.Tensor], streams_too: tuple = ()) -> None:
        """A module's forward pre-hook: its stream, and ``streams_too`` (FSDP2's all-gather
        streams), wait for the copies back of ``params`` (overlap="delayed": none; the forward
        reads the weights of the step before), and for the updates of the step in progress
        that started before ``step()`` (:meth:`wait_started`)."""
        self.wait_started(params, streams_too)
        st = self.timeline.inflight
        if st is None or st.delayed:
            return
        self.wait_buckets(st, params, streams_too)  # (I4) the forward reads them after their H2D
        if len(st.waited) == len(st.fed):
            self.synchronize()  # every copy back is waited for: the step is over

    # ------------------------------------------------------------------ watched models
    def watch(self, model: torch.nn.Module, offloaded: set[torch.Tensor]) -> None:
        """Register the module waits of ``model`` (its modules that own params of
        ``offloaded``) and remember ``model`` (weakly) to watch it again after a re-placement.

        Raises:
            ValueError: as ``ModuleWaits`` (FSDP2 params in a model with no FSDP2 module).
        """
        self.module_waits.append(ModuleWaits(self, model, offloaded))
        self.watched.append(weakref.ref(model))  # set_offload_fraction watches it again

    def compiled_region(self) -> bool:
        """A watched module ran inside a ``torch.compile``d region, where its per-module wait
        does not run (hooks.Compiled), or dynamo compiled anything in this process (its graph
        may run a watched model without the waits: hooks.dynamo_compiled_any): ``step()``
        waits for every copy back instead."""
        if self.unwaited or any(w.compiled.seen for w in self.module_waits):
            return True
        return bool(self.module_waits) and dynamo_compiled_any()


class AtReturn(Publisher):
    """``wait="step"``: the new weights are visible when ``step()`` returns (the compute
    stream waits for every copy back)."""

    def after_step(self, st: Step, streams: dict[torch.device, Any]) -> None:
        super().after_step(st, streams)
        self.synchronize()


class PerModule(Publisher):
    """``wait="module"``: ``step()`` returns at once; each module watched with
    ``opt.watch(model)`` waits, before its forward, for its own params' copies back
    (:meth:`Publisher.wait_for`); the next ``step()`` or ``synchronize()`` waits for the rest."""

    def before_step(self) -> None:
        prev = self.timeline.inflight
        if prev is not None and prev.fed and not prev.waited and not prev.delayed and self.module_waits:  # fmt: skip
            # A forward and backward ran since step() and no watched module waited: their
            # pre-hooks did not run (torch.compile ignores hooks added after a region first
            # ran compiled), so that forward may have read weights being copied back.
            self.unwaited = True
            self.warn_once(
                "unwaited-forward",
                "a forward ran after step() and no module watched with opt.watch() waited for "
                "the weights being copied back (a model that ran under torch.compile before "
                "watch(): torch.compile ignores hooks added after that); from now on step() "
                "waits for every copy back before it returns. Call opt.watch(model) before the "
                "model's first compiled forward",
            )
        super().before_step()

    def after_step(self, st: Step, streams: dict[torch.device, Any]) -> None:
        super().after_step(st, streams)
        if self.compiled_region():
            self.synchronize()  # compiled: one full wait for the region's modules
            return
        # The copies still read the grads after step() returns; an in-place edit before they
        # are done is an error when the step ends (synchronize(); tests/test_overlap.py,
        # test_a_grad_zeroed_in_place_...)
        st.lent = [(ref, local(g)._version, p) for p, (ref, _) in st.versions.items()
                   if (g := ref()) is not None]  # fmt: skip
        if not (self.watched or self.watch_later):
            self.warn_once(
                "module-unwatched",
                "wait='module' with no model given to opt.watch(): nothing makes "
                "the next forward wait for the weights being copied back; call "
                "opt.watch(model), or opt.synchronize() before the next forward",
            )
