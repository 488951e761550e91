"""How a step runs: ``step()`` as its phases, and the same phases started from backward.

[Note: when an update may start]
- ``overlap="step"`` (default): everything happens inside ``step()``.
- ``overlap="backward"``: post-accumulate-grad hooks announce each offloaded grad. A bucket is
  *complete* when every param in it has been announced, or when backward ends (autograd's final
  callback: a param that gets no grad cannot hang a bucket). Its update may start early only
  when nothing can change the grads after backward:
  - ``grads_final=True`` (the caller declares it) and no clipping: at completion, during
    backward;
  - ``max_grad_norm=`` (clipping through the optimizer): at the end of backward, once the
    global norm is known (the coefficient multiplies the fp32 grads on the device before D2H);
  - ``grad_scaler=`` (a GradScaler attached): at the end of backward, once every grad has
    been checked for infs (offloadopt/step/amp.py's note);
  - otherwise (torch's ``clip_grad_norm_``, an unattached GradScaler, a hand edit may
    follow): inside ``step()``, as in step mode.
  Non-final micro-steps of gradient accumulation run under ``with opt.accumulating():`` and
  announce nothing; the last micro-step is never inferred from counts. An update that started
  from a grad changed afterwards (``grad._version`` moved) is an error naming the param.
- ``wait="step"`` (default): ``step()`` returns once every copy back is queued and the compute
  stream waits for them. ``wait="module"``: ``step()`` returns at once; each module watched with
  ``opt.watch(model)`` waits, before its forward, for its own params' copies only;
  ``opt.synchronize()`` waits for everything (``state_dict()``, ``load_state_dict()``,
  ``add_param_group()``, ``zero_grad(set_to_none=False)`` and ``close()`` call it).
- ``overlap="delayed"`` (the delayed parameter update): ``step()`` reads the grads (after any
  clipping or scaling), queues every offloaded bucket, takes the grads from their params and
  returns. The worker's H2D writes each param's landing buffer (``ParamRecord.landing``), not
  the param, so the next forward and backward read the weights of the step before; the next
  ``step()``, or anything that calls ``synchronize()``, waits for the update and copies the
  landed weights in on the stream that reads them (publish.py's ``NextStep``), and only then are
  the params marked written (the stale-master check must not see our own copy as an edit).
- A step is consistent or refused: if a backward that started updates fails part-way, or a
  second backward comes before ``step()``, the optimizer refuses ``step()`` and
  ``state_dict()`` until ``load_state_dict()`` or ``opt.discard_failed_step()``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.interrupts import no_grad_whole, signals_deferred
from offloadopt.link.layout import Bucket
from offloadopt.link.pipeline import BucketWork, StepRun
from offloadopt.link.worker import local_ranks
from offloadopt.rules import Hyper
from offloadopt.shards import local
from offloadopt.step.amp import scaler_inputs
from offloadopt.step.backward import FromBackward
from offloadopt.step.guards import _norms
from offloadopt.step.step import Phase, Step

__all__ = ["Stepping", "Step", "signals_deferred"]


class Stepping(FromBackward):
    """The step machinery of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    # ------------------------------------------------------------------ public
    @torch.compiler.disable  # under torch.compile the step runs eagerly (a graph break)
    def step(self, closure: Callable[[], float] | None = None):
        """One update of every param with a grad; params whose grad is None are skipped.

        Raises:
            RuntimeError: a sparse grad, a grad whose shape differs from its param, a param
                listed in two groups, a grad changed after its update started (named), or an
                optimizer left inconsistent by a failed step (see ``discard_failed_step``).
            ValueError, TypeError: a group's hyperparameter is invalid (named); nothing changed.
            WorkerError: an offloaded update failed on the worker (names the bucket).
            TimeoutError: a wait outlasted ``timeout_s`` (names what it waited for).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_whole()
        return loss

    @no_grad_whole  # the closure above runs with signals delivered as they come
    def _step_whole(self) -> None:
        """The step after the closure: without grad, signals deferred until it is whole."""
        t0 = time.perf_counter()
        self.ensure_placed()  # params built on the meta device, materialized since
        auto = self._auto if self._auto is not None and self._auto.active else None
        if auto is not None:
            auto.begin(self._device())
        with signals_deferred(), self._lock:
            self._raise_if_broken()
            st = self._step
            if st is not None and not st.backward_done:
                self._abandon(st, "a backward that announced grads never finished")
            self._step = None
            # Phase 0: freeze every group's hyperparameters (at the first hook, in backward
            # mode) and check every grad, before any state changes.
            if st is None:
                st = self._begin(may_replace=True)
            elif st.fed:
                self._guards.warn_if_hypers_moved(st, self.param_groups)
            st.phase = Phase.STEPPING
            st.thread = threading.get_ident()
            try:
                # Params fed during backward were checked then (their grads may be released now).
                with_grad = [p for p in st.group_of if p not in st.versions and p.grad is not None]
                # Grads the update cannot use, grads set, dropped or edited after their
                # update started, a closed optimizer (offloadopt/step/guards.py)
                self._guards.check_step(st, with_grad)
            except BaseException:
                if st.run is not None:  # updates started in backward: end their run, so the
                    self._stop_run(st.run)  # next step's run is not queued behind it forever
                raise
            # A GradScaler's step() set these (offloadopt/step/amp.py's note); None otherwise.
            grad_scale, scaler_inf = scaler_inputs(self)
            self._scaling.check_scaler(st, grad_scale, scaler_inf)
            self._scaling.at_step(st, with_grad, grad_scale, scaler_inf)
            # release_grads at a step that creates device-resident state (the first one, whose
            # backward ran before any hook): the offloaded grads go before that state is
            # allocated, so this step's peak is no higher than a later step's.
            lazy = self.release_grads and any(
                not self._records[p].offloaded and not self.state.get(p) for p in with_grad
            )
            device_work = [] if lazy else self._updater.prepare_device(st, with_grad)
            streams = self._streams()

            def feed() -> None:
                try:
                    self._feed(st, self._open_buckets(st, with_grad), st.scale)
                    if lazy:
                        self._land_and_release(st)
                        device_work.extend(self._updater.prepare_device(st, with_grad))
                except BaseException:
                    if st.run is not None:  # a bucket failed while others were fed
                        st.run.abort()
                        self._broken = "an offloaded update failed"
                        self._publish.publish_after_failure(st, streams)
                    raise

            # Phase 2 starts first (the worker copies and updates the offloaded buckets while
            # phase 1 is launched): every bucket with a grad not fed during backward. Not in
            # offload_fraction="auto"'s probe: there phase 1 is timed alone (the D2H waits for
            # it on its stream), as fraction 0 would run it.
            alone = auto is not None and auto.phase == "probe" and not lazy
            if not alone:
                feed()
            # Phase 1: device-resident params, torch's fused kernel on the compute stream.
            t = time.perf_counter()
            if auto is not None:
                auto.mark("dev0")
            for hyper, params, first in device_work:
                self._updater.device_update(hyper, params, st.scale, first, st.amp)
            if auto is not None:
                auto.mark("dev1")
            if alone:
                feed()
            st.stats["device_update_ms"] = (time.perf_counter() - t) * 1e3
            st.stats["collect_ms"] = (t - t0) * 1e3
            if st.run is None:
                self._finish(st, streams)
            else:
                st.run.close()
                # Phase 3: publish, as the policy chosen at construction says (publish.py):
                # wait="step": the compute stream waits for every copy back; wait="module":
                # each watched module waits for its own (opt.watch); overlap="delayed": the
                # next step() (or synchronize()) copies the new weights in.
                st.phase = Phase.STEPPED
                self._publish.after_step(st, streams)
        # The host wall time of step() itself: with wait="module" or overlap="delayed" the step
        # ends later (the next synchronize() or step()), and the time in between is the
        # caller's (tests/test_overlap.py).
        st.stats["step_ms"] = (time.perf_counter() - t0) * 1e3
        if auto is not None:
            # offload_fraction="auto": a sample (a step that updated nothing is none); may move
            # the state, between steps
            auto.end(self, worked=bool(st.prepared))

    def discard_failed_step(self) -> None:
        """Accept the state a failed step left (some params updated, others not) and go on.

        Nothing is rolled back and the grads stay as they are: call ``zero_grad()`` before the
        next ``step()``, or the params already updated get the same grads applied again (a
        fresh user's finding; the README says so)."""
        with self._lock:
            if self._step is not None and self._step.run is not None:
                self._stop_run(self._step.run)
            self._step, self._broken = None, None

    def _stop_run(self, run: StepRun) -> None:
        """Drop the buckets ``run`` has not started and wait until the worker is done with
        the one in hand (an abort alone lets it write that bucket's state and weights after a
        load_state_dict that follows; bounded by ``timeout_s``)."""
        run.abort()
        run.job.done.wait(self.timeout_s)

    def _keys_changed(self) -> bool:
        """Whether a group's values now need other state keys than its params were placed with."""
        for g in self.param_groups:
            keys = self.rule.state_keys_for(g)  # once per group, not per param
            if any((r := self._records.get(p)) is not None and r.state_keys != keys
                   for p in g["params"]):  # fmt: skip
                return True
        return False

    def _replace_for_keys(self) -> None:
        """Place every param again with the state keys its group's values need now.

        Raises:
            ValueError: a ``max_gpu_memory`` budget was met with the old keys (more state now:
                the fraction it chose may not fit); before a step nothing changed, inside
                ``load_state_dict()`` the load fails (and is refused until one succeeds).
        """
        if self._placer.sizes["max_gpu_memory"] is not None:
            raise ValueError(
                "the param groups' values need other state than when max_gpu_memory chose the "
                f"fraction {self.offload_fraction:g} (momentum turned on or off after the "
                "first step()); build the optimizer with the values it trains with (OneCycleLR "
                "sets momentum at construction, before max_gpu_memory chooses)"
            )
        self._replace(self.offload_fraction)

    # ------------------------------------------------------------------ phases
    def _begin(self, may_replace: bool = False) -> Step:
        """Freeze and validate every group, find each param's group by identity.

        ``may_replace`` (from ``step()``, never from a backward's hooks): a group whose values
        now need other state keys than its params were placed with (SGD's ``momentum_buffer``:
        ``OneCycleLR(cycle_momentum=True)`` on a group built with ``momentum=0``) has its
        params placed again while no param has state: torch's SGD then starts its buffers at
        this step, and so does this. Otherwise the change is an error naming the param."""
        self._publish.before_step()  # the step before is over (publish.py)
        hypers: dict[int, Hyper] = {}
        group_of: dict[torch.Tensor, dict] = {}
        index_of: dict[torch.Tensor, int] = {}
        for gi, group in enumerate(self.param_groups):
            try:
                hypers[id(group)] = self.rule.freeze(group)
            except (TypeError, ValueError) as e:
                raise type(e)(f"param group {gi}: {e}") from e
            keys = self.rule.state_keys_for(group)
            for i, p in enumerate(group["params"]):
                rec = self._records.get(p)
                if rec is not None and rec.state_keys != keys:
                    if may_replace and not any(self.state.get(q) for q in self._records):
                        self._replace_for_keys()  # waited for above: nothing is in flight
                        return self._begin()
                    raise ValueError(
                        f"param group {gi}: {rec.name} keeps state {list(rec.state_keys)} since "
                        f"it was placed, the group's values now need {list(keys)} (momentum "
                        "turned on or off after the first step with state; while no param "
                        "has state, step() places the params again, but not a backward that "
                        "starts updates)"
                    )
                if p in group_of:
                    raise RuntimeError(
                        f"{self._name(group, gi, i)} is in param groups {index_of[p]} and {gi}: "
                        "a param may be in one group only"
                    )
                group_of[p], index_of[p] = group, gi
                self._record(p, group, gi, i)
        stats = dict.fromkeys(
            ("d2h_wait_ms", "cpu_update_ms", "launch_ms", "feed_wait_ms", "h2d_ms", "d2h_ms"), 0.0
        )
        stats.update(d2h_nbytes=0, h2d_nbytes=0, buckets=0, worker_ms=0.0)
        st = Step(hypers, group_of, stats)
        st.delayed = self.overlap == "delayed" and self._steps_taken() >= self.delay_after
        return st

    def _steps_taken(self) -> int:
        """The updates the offloaded params have had: the largest ``step`` among them (host
        tensors: no device sync), so a resume from a checkpoint counts on where it left off.
        Read at each step's start when ``delay_after`` > 0."""
        if self.delay_after == 0:
            return 0
        steps = (self.state.get(p, {}).get("step") for p, rec in self._records.items()
                 if rec.offloaded)  # fmt: skip
        return max((int(s) for s in steps if s is not None), default=0)

    def _open_buckets(self, st: Step, with_grad: list[torch.Tensor]) -> list:
        """The buckets with a grad that were not fed during backward, with their segments."""
        have = {p for p in with_grad if self._records[p].offloaded}
        order = self._forward_order() if self.wait == "module" else self.buckets
        items = []
        for b in order:
            if b in st.fed:
                continue
            idx = [n for n, s in enumerate(b.segments) if b.arena.params[s.k] in have]
            if idx:
                items.append((b, idx))
        return items

    def _feed(self, st: Step, items: list[tuple[Bucket, list[int]]], scale, early=False) -> None:
        """Prepare the params of these buckets and queue each on the step's run, with its
        grads captured now and an event on this thread's stream (I1)."""
        if not items:
            return
        params = list(
            dict.fromkeys(b.arena.params[b.segments[n].k] for b, idx in items for n in idx)
        )
        for p in params:
            if p not in st.prepared:
                self._guards.check_grad(p)
        # All or nothing: a signal (Ctrl-C landing in a grad hook, whose autograd thread is the
        # main one on the CPU) waits for its handler until the buckets are queued; any other
        # failure part-way leaves the step refused, not an open run the worker waits on (a
        # fresh user's finding: step() then hung until timeout_s; tests/test_overlap.py,
        # test_an_interrupt_in_a_grad_hook_...).
        with signals_deferred():
            try:
                self._feed_checked(st, items, scale, early, params)
            except BaseException:
                if st.run is not None:
                    st.run.abort()
                if self._broken is None:
                    self._broken = "queuing this step's offloaded updates failed part-way"
                raise

    def _feed_checked(self, st: Step, items, scale, early: bool, params: list) -> None:
        self._updater.prepare(st, params)
        if st.run is None:
            st.run = self._pipeline.begin(self._updater.update_bucket, st.stats)
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
                left = st.landing.setdefault(p, len(self._records[p].buckets)) - 1
                st.landing[p] = left
                if left == 0 and self.release_grads:
                    release.append((p, weakref.ref(p.grad)))
            grads = b.grad_views(idx)
            targets = None
            if delayed:
                targets = [self._records[params[s.k]].landing.view(-1)[s.lo : s.hi]
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
            tr = self._pipeline.transfers[b.arena.device]
            ready = tr.mark(torch.cuda.current_stream(b.arena.device) if tr.cuda else None)
            work = BucketWork(b, idx, grads, ready, scale, release, list(calls.values()),
                              targets, amp=st.amp)  # fmt: skip
            st.fed[b] = work
            st.run.feed(work)
            if delayed:
                # The update holds the grads until their D2H lands; the next backward makes
                # new ones instead of accumulating into memory a copy may still read.
                for n in idx:
                    p = params[b.segments[n].k]
                    if st.landing[p] == 0:
                        p.grad = None

    def _finish(self, st: Step, streams) -> None:
        """The step is over: its params are marked written, its figures become ``stats``."""
        st.phase = Phase.PUBLISHED
        if st.run is not None:
            if self.release_grads:
                self._release(st)
            else:
                st.run.take_landed()
        amp = st.amp
        if amp is not None and amp.host_inf is not None and self.rule.has_step:
            # torch's fused AdamW takes its step increment back when found_inf is 1.0; the
            # worker has read the host copy, so it holds the value
            amp.wait(self.timeout_s)
            steps = [self.state[p]["step"] for p in st.prepared if self._records[p].offloaded]
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
                    for key in self._records[p].state_keys:
                        dict.pop(entry, key, None)
        if not st.delayed:  # delayed: marked when the weights are copied in
            for p in st.prepared:
                if self._records[p].offloaded:
                    self._records[p].mark_written(p)
        st.stats["cpu_threads"] = self.cpu_threads if self._pipeline is not None else 0
        st.stats["local_ranks"] = local_ranks()  # processes on this host sharing its cores
        self._stats = st.stats  # step() sets its step_ms (the same dict) when it returns

    def _streams(self) -> dict[torch.device, Any]:
        """The training thread's stream per device, captured here: the stream that reads the
        new weights."""
        return {d: torch.cuda.current_stream(d) if tr.cuda else None
                for d, tr in self._transfers().items()}  # fmt: skip

    def _abandon(self, st: Step, why: str) -> None:
        """A step whose updates started cannot complete: refuse until load or discard."""
        if st.run is not None:
            st.run.abort()
        self._broken = why
        self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        self._timeline.raise_if_broken()
