"""The :class:`Feeder`: a step's offloaded buckets fed to the pipeline (D2H, the CPU update,
H2D: offloadopt/link/pipeline.py), the device-resident params updated beside them, and the
step ended (its params marked written, grads released, its figures kept as ``opt.stats``).
``step()`` calls :meth:`Feeder.update`; the start policy (start.py) calls :meth:`Feeder.feed`
during backward. start.py's note says when an update may start."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from offloadopt.interrupts import signals_deferred
from offloadopt.link.layout import Bucket
from offloadopt.link.pipeline import BucketWork
from offloadopt.link.worker import cpu_text, local_ranks
from offloadopt.place.placer import Placer
from offloadopt.rules import Hyper, Rule
from offloadopt.shards import local
from offloadopt.state.store import OptimizerState
from offloadopt.step.guards import Guards, _norms
from offloadopt.step.step import Phase, Step, Timeline, begin_step, steps_taken
from offloadopt.step.update import Updater

__all__ = ["Feeder"]


class Feeder:
    """Feeds one step at a time to the pipeline and ends it.

    Args:
        timeline: the optimizer's :class:`~offloadopt.step.step.Timeline` (``refuse``).
        placer: the :class:`~offloadopt.place.placer.Placer` (records, buckets, pipeline).
        updater: the :class:`~offloadopt.step.update.Updater` (state, the worker's callable).
        guards: the :class:`~offloadopt.step.guards.Guards` (a grad's checks before its feed).
        publisher: the publish policy (step/publish.py), for a step whose feed failed.
        state: ``opt.state``. rule: the update rule.
        release_grads: drop each offloaded grad once its D2H landed (``release_grads=``).
        module_order: feed in the order the next forward reads (``wait="module"``).
        delay_after: ``overlap="delayed"``'s synchronous steps first (None: not delayed).
        timeout_s: the longest wait for the worker, in seconds.

    Attributes:
        stats: the last completed step's figures (``opt.stats`` sums the link's over them).
    """

    def __init__(
        self,
        timeline: Timeline,
        placer: Placer,
        updater: Updater,
        guards: Guards,
        publisher: Any,
        state: OptimizerState,
        rule: Rule,
        *,
        release_grads: bool,
        module_order: bool,
        delay_after: int | None,
        timeout_s: float,
    ):
        self.timeline, self.placer, self.updater = timeline, placer, updater
        self.guards, self.publisher = guards, publisher
        self.state, self.rule = state, rule
        self.records = placer.records
        self.release_grads, self.module_order = release_grads, module_order
        self.delay_after = delay_after
        self.pin_memory = placer.pin_memory
        self.timeout_s = timeout_s
        self.stats: dict[str, float] = {}
        publisher.ends(self.finish)  # the publisher ends a step once its copies are waited for

    def begin(self, may_place_again: bool = False) -> Step | None:
        """A new step once the step before is over (the publish policy's ``before_step``):
        step/step.py's ``begin_step``; None: "place again" (``may_place_again``, from
        ``step()`` only: a group's values need new state keys)."""
        self.publisher.before_step()
        st = begin_step(self.placer.param_groups, self.rule, self.placer, may_place_again)
        if st is not None and self.delay_after is not None:
            taken = steps_taken(self.state, self.records, self.delay_after)
            st.delayed = taken >= self.delay_after
        return st

    def update(self, st: Step, with_grad: list[torch.Tensor], auto: Any, t0: float) -> dict:
        """``step()``'s phases 2 and 1: feed every offloaded bucket with a grad not fed during
        backward (the worker copies and updates them while phase 1 is launched), and update
        the device-resident params with torch's fused kernel on the compute stream. Returns the
        training thread's streams (the ones that read the new weights).

        ``auto``: offload_fraction="auto"'s sampler while it measures, else None (its probe
        times phase 1 alone: the D2H waits for it on its stream, as fraction 0 would run it).
        """
        # release_grads at a step that creates device-resident state (the first one, whose
        # backward ran before any hook): the offloaded grads go before that state is
        # allocated, so this step's peak is no higher than a later step's.
        lazy = self.release_grads and any(
            not self.records[p].offloaded and not self.state.get(p) for p in with_grad
        )
        device_work = [] if lazy else self.updater.prepare_device(st, with_grad)
        streams = self.streams()

        def feed() -> None:
            try:
                self.feed(st, self.open_buckets(st, with_grad), st.scale)
                if lazy:
                    self.land_and_release(st)
                    device_work.extend(self.updater.prepare_device(st, with_grad))
            except BaseException:
                if st.run is not None:  # a bucket failed while others were fed
                    st.run.abort()
                    self.timeline.refuse("an offloaded update failed")
                    self.publisher.publish_after_failure(st, streams)
                raise

        alone = auto is not None and auto.phase == "probe" and not lazy
        if not alone:
            feed()
        t = time.perf_counter()
        if auto is not None:
            auto.mark("dev0")
        for hyper, params, first in device_work:
            self.updater.device_update(hyper, params, st.scale, first, st.amp)
        if auto is not None:
            auto.mark("dev1")
        if alone:
            feed()
        st.stats["device_update_ms"] = (time.perf_counter() - t) * 1e3
        st.stats["collect_ms"] = (t - t0) * 1e3
        return streams

    def open_buckets(self, st: Step, with_grad: list[torch.Tensor]) -> list:
        """The buckets with a grad that were not fed during backward, with their segments."""
        have = {p for p in with_grad if self.records[p].offloaded}
        order = self.placer.forward_order() if self.module_order else self.placer.buckets
        items = []
        for b in order:
            if b in st.fed:
                continue
            idx = [n for n, s in enumerate(b.segments) if b.arena.params[s.k] in have]
            if idx:
                items.append((b, idx))
        return items

    def feed(self, st: Step, items: list[tuple[Bucket, list[int]]], scale, early=False,
             before=None) -> None:  # fmt: skip
        """Prepare the params of these buckets and queue each on the step's run, with its
        grads captured now and an event on this thread's stream (I1); ``before``: the
        BucketWork's (speculative updates)."""
        if not items:
            return
        params = list(
            dict.fromkeys(b.arena.params[b.segments[n].k] for b, idx in items for n in idx)
        )
        for p in params:
            if p not in st.prepared:
                self.guards.check_grad(p)
        # All or nothing: a signal (Ctrl-C landing in a grad hook, whose autograd thread is the
        # main one on the CPU) waits for its handler until the buckets are queued; any other
        # failure part-way leaves the step refused, not an open run the worker waits on (a
        # fresh user's finding: step() then hung until timeout_s; tests/test_overlap.py,
        # test_an_interrupt_in_a_grad_hook_...).
        with signals_deferred():
            try:
                self._feed_checked(st, items, scale, early, params, before)
            except BaseException:
                if st.run is not None:
                    st.run.abort()
                if self.timeline.broken is None:
                    self.timeline.refuse("queuing this step's offloaded updates failed part-way")
                raise

    def _feed_checked(self, st: Step, items, scale, early: bool, params: list, before) -> None:
        self.updater.prepare(st, params)
        if st.run is None:
            st.run = self.placer.pipeline.begin(self.updater.update_bucket, st.stats)
        new_prints: list[torch.Tensor] = []  # grads fed before step(): their norms, below
        delayed = st.delayed  # the H2D lands in ParamRecord.landing
        for b, idx in items:
            params = b.arena.params
            calls: dict[tuple, tuple[Hyper, list[int], list[torch.Tensor], bool]] = {}
            release = []
            for pos, n in enumerate(idx):
                p = params[b.segments[n].k]
                hyper, first = st.hypers[id(st.group_of[p])], p in st.first
                call = calls.setdefault((id(hyper), first), (hyper, [], [], first))
                call[1].append(pos)
                if self.rule.has_step:
                    call[2].append(self.state[p]["step"])
                # A weak reference: a released grad must not be kept alive by this check.
                st.versions[p] = (weakref.ref(p.grad), local(p.grad)._version)
                if early and p not in st.fingerprints:
                    new_prints.append(p)
                left = st.landing.setdefault(p, len(self.records[p].buckets)) - 1
                st.landing[p] = left
                if left == 0 and self.release_grads:
                    release.append((p, weakref.ref(p.grad)))
            grads = b.grad_views(idx)
            targets = None
            if delayed:
                targets = [self.records[params[s.k]].landing.view(-1)[s.lo : s.hi]
                           for s in b.segments]  # fmt: skip
                # The copy runs during the next backward. A grad that is a view of memory its
                # param does not own (DDP's gradient_as_bucket_view: the next backward writes
                # the same bucket, whatever p.grad is) is copied first, on this stream, so
                # the D2H reads this step's values (a fresh user's finding: runs differed).
                grads = [g.clone() if local(params[b.segments[n].k].grad)._base is not None
                         else g for g, n in zip(grads, idx, strict=True)]  # fmt: skip
            if new_prints:  # on this stream, before `ready`: the values the D2H reads
                st.fingerprints.update(
                    zip(new_prints, _norms([local(q.grad) for q in new_prints]), strict=True)
                )
                new_prints = []
            if st.amp is not None:
                st.amp.to_host(self.pin_memory)  # queued before `ready`, on the same stream
            tr = self.placer.pipeline.transfers[b.arena.device]
            ready = tr.mark(torch.cuda.current_stream(b.arena.device) if tr.cuda else None)
            work = BucketWork(b, idx, grads, ready, scale, release, list(calls.values()),
                              targets, amp=st.amp, before=before)  # fmt: skip
            st.fed[b] = work
            st.run.feed(work)
            if delayed:
                # The update holds the grads until their D2H lands; the next backward makes
                # new ones instead of accumulating into memory a copy may still read.
                for n in idx:
                    p = params[b.segments[n].k]
                    if st.landing[p] == 0:
                        p.grad = None

    def finish(self, st: Step, streams) -> None:
        """The step is over: its params are marked written, its figures become ``stats``."""
        st.phase = Phase.PUBLISHED
        if st.run is not None:
            if self.release_grads:
                self.release(st)
            else:
                st.run.take_landed()
        amp = st.amp
        if amp is not None and amp.host_inf is not None and self.rule.has_step:
            # torch's fused AdamW takes its step increment back when found_inf is 1.0; the
            # worker has read the host copy, so it holds the value
            amp.wait(self.timeout_s)
            steps = [self.state[p]["step"] for p in st.prepared if self.records[p].offloaded]
            if steps:
                torch._foreach_sub_(steps, [amp.host_inf] * len(steps))
        if amp is not None and amp.found_inf is not None and st.first and self.rule.lazy_state:
            # A skipped first update leaves no state, as torch's SGD that GradScaler does not
            # step (its fused kernel would leave the buffer uninitialised): the next update is
            # the first. One host read, at a param's first step only.
            amp.wait(self.timeout_s)
            inf = amp.host_inf if amp.host_inf is not None else amp.found_inf
            if float(inf) == 1.0:
                for p in st.first:
                    entry = self.state[p]
                    for key in self.records[p].state_keys:
                        dict.pop(entry, key, None)
        if not st.delayed:  # delayed: marked when the weights are copied in
            for p in st.prepared:
                if self.records[p].offloaded:
                    self.records[p].mark_written(p)
        worker = self.placer.pipeline is not None
        st.stats["cpu_threads"] = self.placer.cpu_threads if worker else 0
        # where the worker runs: its CPUs ("any": unpinned; "": no worker) and those left to
        # the training thread
        plan = self.placer.cpu_plan
        st.stats["worker_cpus"] = (cpu_text(plan.cpus) if plan.cpus else "any") if worker else ""
        st.stats["training_cpus"] = cpu_text(plan.training) if worker else ""
        st.stats["local_ranks"] = local_ranks()  # processes on this host sharing its cores
        self.stats = st.stats  # step() sets its step_ms (the same dict) when it returns

    def streams(self) -> dict[torch.device, Any]:
        """The training thread's stream per device, captured here: the stream that reads the
        new weights."""
        return {d: torch.cuda.current_stream(d) if tr.cuda else None
                for d, tr in self.placer.transfers().items()}  # fmt: skip

    def land_and_release(self, st: Step) -> None:
        """Wait until every bucket fed so far has landed on the host, then drop its grads.

        Raises:
            TimeoutError, WorkerError: as ``step()``.
        """
        if st.run is None:
            return
        for work in list(st.run.fed):
            st.run.wait_h2d_queued(work.bucket, self.timeout_s)  # queued after it landed
        self.release(st)

    def release(self, st: Step) -> None:
        """Drop the device grads whose every D2H has landed (release_grads), on the thread that
        owns the grads (autograd's during backward, the training thread in step())."""
        for work in st.run.take_landed():
            work.grads = []
            for p, fed in work.release:
                if p.grad is not None and p.grad is fed():  # not a later backward's new grad
                    p.grad = None
                    st.released.add(p)
