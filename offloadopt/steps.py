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
    been checked for infs (offloadopt/amp.py's note);
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
  landed weights in on the stream that reads them (``_publish_delayed``), and only then are
  the params marked written (the stale-master check must not see our own copy as an edit).
- A step is consistent or refused: if a backward that started updates fails part-way, or a
  second backward comes before ``step()``, the optimizer refuses ``step()`` and
  ``state_dict()`` until ``load_state_dict()`` or ``opt.discard_failed_step()``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt.amp import AmpInputs, found_inf, inverse, scaler_inputs
from offloadopt.layout import Bucket
from offloadopt.pipeline import BucketWork, StepRun
from offloadopt.placement import update_dtype
from offloadopt.records import ParamRecord
from offloadopt.rules import Hyper
from offloadopt.shards import is_dtensor, local
from offloadopt.transfer import SLOTS
from offloadopt.warn import warn
from offloadopt.worker import WaitTimeout, local_ranks

__all__ = ["Stepping", "StepState"]


def _matching(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``like``'s dtype and strides. torch's fused kernels walk param, grad and
    state as flat memory, so a grad with other strides (a transposed grad set by hand) would
    be paired with the wrong elements; autograd's grads already match and pass through."""
    if grad.dtype == like.dtype and grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 L2 norms of ``grads`` (one foreach launch per device and dtype, no copies)."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32)) if grads else []


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


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Signals with a Python handler (Ctrl-C's SIGINT, a preemption handler's SIGTERM or
    SIGUSR1) that arrive inside the block reach their handler when it ends, so an interrupt
    cannot leave a step half done (tests/test_state_contract.py). Main thread only: Python runs
    signal handlers there alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"):
        sig = getattr(signal, name, None)
        handler = signal.getsignal(sig) if sig is not None else None
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum, frame in pending:
            previous[signum](signum, frame)  # KeyboardInterrupt for SIGINT: raised from here


_PENDING = -2  # StepState.task_id of a step begun by DDP's comm hook, before any grad hook


@dataclass(eq=False)
class StepState:
    """One step from its first bucket to the end of ``step()`` (or, with ``wait="module"``,
    until its copies back are all waited for)."""

    hypers: dict[int, Hyper]  # id(group) -> its values, frozen at the step's start
    group_of: dict[torch.Tensor, dict]  # param -> the group that holds it this step
    stats: dict[str, float]
    run: StepRun | None = None
    prepared: set[torch.Tensor] = field(default_factory=set)  # state ready, step advanced
    announced: set[torch.Tensor] = field(default_factory=set)  # grad hooks that fired
    fed: dict[Bucket, BucketWork] = field(default_factory=dict)
    versions: dict[torch.Tensor, tuple] = field(default_factory=dict)  # (grad, _version) fed
    # The fp32 L2 norm of each grad fed before step(), on its device: a grad whose version moved
    # with an unchanged norm (torch's clip_grad_norm_ at an infinite max_norm, which
    # transformers' Trainer calls to log the norm, multiplies by 1.0) is not an edit; any
    # scaling, clipping or zeroing changes the norm.
    fingerprints: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    landing: dict[torch.Tensor, int] = field(default_factory=dict)  # buckets left to feed
    backward_done: bool = False
    task_id: int = -1  # autograd graph task that announced grads
    norm: torch.Tensor | None = None
    scale: torch.Tensor | tuple[torch.Tensor, ...] | None = None  # clip factors (BucketWork)
    amp: AmpInputs | None = None  # a GradScaler's scale and found_inf (offloadopt/amp.py)
    waited: set[Bucket] = field(default_factory=set)  # wait="module": buckets waited for
    first: set[torch.Tensor] = field(default_factory=set)  # lazy-state params' first update
    t0: float = 0.0
    delayed: bool = False  # overlap="delayed", past delay_after: the update lands one step late


class Stepping:
    """The step machinery of :class:`offloadopt.optim.HybridOptimizer` (a mixin)."""

    # ------------------------------------------------------------------ public
    @torch.compiler.disable  # under torch.compile the step runs eagerly (a graph break)
    @torch.no_grad()
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
                st = self._begin()
            st.t0 = t0
            # Params fed during backward were checked then (their grads may be released now).
            with_grad = [p for p in st.group_of if p not in st.versions and p.grad is not None]
            for p in with_grad:
                self._check_grad(p)
            # Each grad is read once: with release_grads the worker sets p.grad to None at any
            # moment (tests/test_overlap.py ran into a None between two reads).
            moved = {}
            for p, (grad, version) in st.versions.items():
                now = p.grad
                if now is not None and (now is not grad() or local(now)._version != version):
                    moved[p] = now
            same = self._same_values(st, moved)
            for p in moved:
                if p not in same:
                    self._broken = f"the grad of {self._records[p].name} changed after its update"
                    hint = ("with grad_scaler= attached, leave out scaler.unscale_(opt) and "
                            "clip with max_grad_norm=" if self.grad_scaler is not None else
                            "clip or scale through the optimizer: max_grad_norm=, grad_scaler=, "
                            "or leave grads_final=False")  # fmt: skip
                    raise RuntimeError(
                        f"the grad of {self._records[p].name} changed after its bucket's update "
                        f"started during backward ({hint}; mark non-final micro-steps with "
                        "opt.accumulating())"
                    )
            self._check_worker(with_grad)  # a closed optimizer changes nothing
            # A GradScaler's step() set these (offloadopt/amp.py's note); None otherwise.
            grad_scale, scaler_inf = scaler_inputs(self)
            self._check_scaler(st, grad_scale, scaler_inf)
            scaled = grad_scale is not None or scaler_inf is not None
            # Nothing decided at the end of backward (or decided there without the scaler's
            # values, and nothing started): this step's clip factors and scaling, now.
            if st.amp is None and (st.scale is None or (scaled and not st.fed)):
                if self.max_grad_norm is None and self._pending_clip is not None:
                    st.norm, st.scale = self._pending_clip
                self._scaling(st, with_grad, grad_scale, scaler_inf)
            self._pending_clip = None
            # release_grads at a step that creates device-resident state (the first one, whose
            # backward ran before any hook): the offloaded grads go before that state is
            # allocated, so this step's peak is no higher than a later step's.
            lazy = self.release_grads and any(
                not self._records[p].offloaded and not self.state.get(p) for p in with_grad
            )
            device_work = [] if lazy else self._prepare_device(st, with_grad)
            streams = self._streams()

            def feed() -> None:
                try:
                    self._feed(st, self._open_buckets(st, with_grad), st.scale)
                    if lazy:
                        self._land_and_release(st)
                        device_work.extend(self._prepare_device(st, with_grad))
                except BaseException:
                    if st.run is not None:  # a bucket failed while others were fed
                        st.run.abort()
                        self._broken = "an offloaded update failed"
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
                self._device_update(hyper, params, st.scale, first, st.amp)
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
                # Phase 3: publish. wait="step": the compute stream waits for every copy back;
                # wait="module": each watched module waits for its own (opt.watch, _wait_for);
                # overlap="delayed": the next step() (or synchronize()) copies the new weights in.
                self._inflight, self._inflight_streams = st, streams
                if (self.wait == "step" or self._compiled_region()) and not st.delayed:
                    self.synchronize()  # compiled: one full wait for the region's modules
                elif not st.delayed and not (self._watched or self._watch_later):
                    self._warn_once(
                        "module-unwatched",
                        "wait='module' with no model given to opt.watch(): nothing makes the "
                        "next forward wait for the weights being copied back; call "
                        "opt.watch(model), or opt.synchronize() before the next forward",
                    )
        if auto is not None:
            # offload_fraction="auto": a sample (a step that updated nothing is none); may move
            # the state, between steps
            auto.end(self, worked=bool(st.prepared))
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's grads by their global L2 norm, inside the update: the next
        ``step()`` multiplies every fp32 grad by ``min(1, max_norm / (norm + 1e-6))`` (torch's
        ``clip_grad_norm_`` coefficient) on the device, before the update; ``p.grad`` is left
        as it is. Returns the norm, a 0-dim fp32 tensor on the params' device.

        The norm is the L2 norm of the per-param norms in group order (each computed in fp32),
        the same at every fraction and in every mode.

        Raises:
            ValueError: ``max_norm`` is not a finite number > 0.
            RuntimeError: the optimizer was built with ``max_grad_norm`` (it clips every step).
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):  # fmt: skip
            raise ValueError(f"Invalid max_norm: {max_norm!r} (expected a finite number > 0)")
        if self.max_grad_norm is not None:
            raise RuntimeError(
                f"built with max_grad_norm={self.max_grad_norm}: it clips every step already"
            )
        with self._lock:
            if self._step is not None and self._step.fed:
                raise RuntimeError(
                    "updates of this step already started from the unclipped grads "
                    "(grads_final=True): clip with max_grad_norm= instead"
                )
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm, scale = self._norm_and_scale(params, float(max_norm))
            self._pending_clip = (norm, scale)
            return norm

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-steps of gradient accumulation:
        their grads stay on the device and nothing starts before the final backward (outside
        this context) or ``step()``. Without the marker, ``overlap="backward"`` treats every
        backward as final (a second backward before ``step()`` is an error)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def synchronize(self) -> None:
        """Wait for this optimizer's work in flight (host side), and make the current stream
        wait for every copy back (GPU side). A no-op when nothing is in flight.

        Raises:
            WorkerError, TimeoutError: as ``step()``.
        """
        st = self._inflight
        if st is None:
            return
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
            raise
        finally:
            self._pipeline.publish(streams, st.run)  # (I4) whatever landed is waited for
        if st.delayed:
            self._publish_delayed(st, streams)
        self._finish(st, streams)

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
    def _publish_delayed(self, st: StepState, streams) -> None:
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
        from offloadopt.hooks import ModuleWaits

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
        ``overlap="delayed"`` the update already took the offloaded params' grads)."""
        if not set_to_none and self.overlap != "delayed":
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def discard_failed_step(self) -> None:
        """Accept the state a failed step left (some params updated, others not) and go on."""
        with self._lock:
            if self._step is not None and self._step.run is not None:
                self._step.run.abort()
            self._step, self._broken = None, None

    # ------------------------------------------------------------------ grads from backward
    def _on_grad(self, p: torch.Tensor) -> None:
        """A grad hook (autograd's thread): ``p``'s grad is final for this backward (with
        ``ddp=``: accumulated locally; it is announced once reduced, by :meth:`_on_reduced`)."""
        if self._accumulating or self._holding():
            return  # auto's probe: step() feeds everything, as in step mode
        task = torch._C._current_graph_task_id()
        with self._lock:
            st = self._step
            if st is not None and st.task_id == _PENDING:
                st.task_id = task  # begun by a bucket reduced before this backward's first hook
            if st is not None and st.task_id != task:
                if st.fed:  # its updates used grads that this backward now adds to
                    what = "did not finish" if not st.backward_done else "came before step()"
                    self._abandon(st, f"a backward {what}, and another one started")
                self._step = st = None
            if st is None:
                self._check_single_process()
                st = self._step = self._begin()
                st.task_id = task
            if self._ddp is not None:
                return  # DDP's all-reduce of its bucket announces it (hooks.DDPGrads)
            if p not in st.group_of:
                return  # no longer in any group
            st.announced.add(p)
            if self.grads_final and not self._starts_at_end():
                rec = self._records[p]
                done = [b for b in rec.buckets if b not in st.fed
                        and all(q in st.announced for q in b.params)]  # fmt: skip
                self._feed(st, [(b, self._announced_idx(st, b)) for b in done], None, early=True)
        if self.release_grads and st.run is not None:
            st.run.wait_launched(SLOTS, self.timeout_s)  # backpressure: grads do not pile up
            self._release(st)

    def _reduction_started(self, fut) -> None:
        """DDP's comm hook launched a bucket's all-reduce (autograd's thread)."""
        with self._lock:
            self._reductions.append(fut)

    def _on_reduced(self, params: list[torch.Tensor]) -> None:
        """``ddp=``: DDP's all-reduce of a bucket holding ``params`` is done (a future's
        callback, see hooks.DDPGrads): their grads are final; complete buckets start
        (``grads_final``), or wait for the end of backward (``max_grad_norm``)."""
        if self._accumulating:
            return
        with self._lock:
            st = self._step
            if st is None:  # before this backward's first grad hook (a small first bucket)
                st = self._step = self._begin()
                st.task_id = _PENDING
            # A param DDP reduced without a grad of its own (unused this step, with
            # find_unused_parameters=True) keeps grad None: it is not announced, as in torch.
            params = [p for p in params if p in st.group_of and p.grad is not None]
            st.announced.update(params)
            if self.grads_final and not self._starts_at_end():
                mine = {b for p in params for b in self._records[p].buckets}
                done = [b for b in self.buckets if b in mine and b not in st.fed
                        and all(q in st.announced for q in b.params)]  # fmt: skip
                self._feed(st, [(b, self._announced_idx(st, b)) for b in done], None, early=True)

    def _land_and_release(self, st: StepState) -> None:
        """Wait until every bucket fed so far has landed on the host, then drop its grads.

        Raises:
            TimeoutError, WorkerError: as ``step()``.
        """
        if st.run is None:
            return
        for work in list(st.run.fed):
            st.run.wait_h2d_queued(work.bucket, self.timeout_s)  # queued after it landed
        self._release(st)

    def _release(self, st: StepState) -> None:
        """Drop the device grads whose every D2H has landed (release_grads), on the thread that
        owns the grads (autograd's during backward, the training thread in step())."""
        for work in st.run.take_landed():
            work.grads = []
            for p, fed in work.release:
                if p.grad is not None and p.grad is fed():  # not a later backward's new grad
                    p.grad = None

    def _on_backward_end(self) -> None:
        """Autograd's final callback (the thread that called backward): complete the buckets
        whose params got no grad, and start the clipped updates. With ``ddp=``: first wait
        for this backward's all-reduces (outside the lock: their callbacks take it); none
        means a ``no_sync()`` micro-step, which starts nothing."""
        if self._ddp is not None:
            with self._lock:
                futures, self._reductions = self._reductions, []
            for fut in futures:
                fut.wait()  # gloo: done; NCCL: the current stream waits for it
            if not futures:
                with self._lock:
                    if self._step is not None:
                        self._step.backward_done = True
                return
        with self._lock:
            st = self._step
            if st is None or st.backward_done:
                return
            st.backward_done = True
            scale = self._attached_scale()
            if self.max_grad_norm is not None or scale is not None:
                params = [p for p in st.group_of if p.grad is not None]
                inf = None
                if scale is not None:  # the scaler's check, made here (offloadopt/amp.py)
                    inf = found_inf([local(p.grad) for p in params], scale.device)
                self._scaling(st, params, scale, inf)
            elif not self.grads_final:
                return
            items = [(b, self._announced_idx(st, b)) for b in self._forward_order()
                     if b not in st.fed]  # fmt: skip
            self._feed(st, [(b, idx) for b, idx in items if idx], st.scale, early=True)

    def _check_scaler(self, st: StepState, grad_scale, scaler_inf) -> None:
        """Updates begun before ``step()`` must have used the scale of the GradScaler that is
        stepping this optimizer now (amp.py's note); otherwise the step is refused.

        Raises:
            RuntimeError: an unattached scaler after updates started (grads_final or
                max_grad_norm in backward mode), or a scaler other than the attached one.
        """
        if not st.fed or (grad_scale is None and scaler_inf is None):
            return
        if st.amp is None and grad_scale is not None:
            self._broken = "its updates started from grads a GradScaler had scaled"
            why = (
                "max_grad_norm= clipped them"
                if self.max_grad_norm is not None
                else "grads_final=True"
            )
            other = ("or clip with torch after scaler.unscale_(opt) and leave max_grad_norm out"
                     if self.max_grad_norm is not None else "or leave grads_final=False")  # fmt: skip
            raise RuntimeError(
                f"updates of this step started during backward ({why}) from the scaled grads, "
                "and a GradScaler's step() came after them: attach the scaler, "
                f"{type(self).__name__}(..., grad_scaler=scaler), {other}"
            )
        records = getattr(self.grad_scaler, "_per_optimizer_states", None)
        if st.amp is not None and hasattr(records, "get") and records.get(id(self)) is None:
            # the attached scaler keeps a record of this optimizer while it steps it
            self._broken = "its updates started with the attached GradScaler's scale"
            raise RuntimeError(
                "a GradScaler other than the attached one (grad_scaler=) is stepping this "
                "optimizer, whose updates already started with the attached one's scale: "
                "attach the scaler that scales the loss and calls step()"
            )

    def _compiled_region(self) -> bool:
        """A watched module ran inside a ``torch.compile``d region, where its per-module wait
        does not run (hooks.Compiled): ``step()`` waits for every copy back instead."""
        return self._unwaited or any(w.compiled.seen for w in self._module_waits)

    def _attached_scale(self) -> torch.Tensor | None:
        """The scale of the attached GradScaler (``grad_scaler=``) while it scales losses."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)  # None before its first scale()

    def _starts_at_end(self) -> bool:
        """Backward mode's updates start at the end of backward, all at once: a clip or a
        GradScaler's found_inf needs every grad (steps.py's note)."""
        return self.max_grad_norm is not None or self._attached_scale() is not None

    def _holding(self) -> bool:
        """offload_fraction="auto"'s probe: updates wait for ``step()``, so that its window
        measures forward and backward alone (auto.AutoFraction.holds)."""
        return self._auto is not None and self._auto.holds

    def _announced_idx(self, st: StepState, b: Bucket) -> list[int]:
        return [n for n, s in enumerate(b.segments) if b.arena.params[s.k] in st.announced]

    def _forward_order(self) -> list[Bucket]:
        """Buckets in the order the next forward reads them (first-registered params first)."""
        return self.buckets[::-1]

    def _wait_for(self, params: list[torch.Tensor], streams_too: tuple = ()) -> None:
        """A module's forward pre-hook: its stream, and ``streams_too`` (FSDP2's all-gather
        streams), wait for the copies back of ``params`` (overlap="delayed": none; the forward
        reads the weights of the step before)."""
        st = self._inflight
        if st is None or st.delayed:
            return
        streams = self._inflight_streams
        for p in params:
            for b in self._records[p].buckets:
                if b in st.fed and b not in st.waited:
                    st.run.wait_h2d_queued(b, self.timeout_s)
                    tr = self._pipeline.transfers[b.arena.device]
                    if tr.cuda:
                        # (I4) the forward reads these params only after their H2D.
                        torch.cuda.current_stream(b.arena.device).wait_event(tr.h2d_done[b])
                        for stream in streams_too:
                            stream.wait_event(tr.h2d_done[b])
                    st.waited.add(b)
        if len(st.waited) == len(st.fed):
            self.synchronize()  # every copy back is waited for: the step is over
        del streams

    # ------------------------------------------------------------------ phases
    def _begin(self) -> StepState:
        """Freeze and validate every group, find each param's group by identity."""
        prev = self._inflight
        if prev is not None and prev.fed and not prev.waited and not prev.delayed and self._module_waits:  # fmt: skip
            # A forward and backward ran since step() and no watched module waited: their
            # pre-hooks did not run (torch.compile ignores hooks added after a region first
            # ran compiled), so that forward may have read weights being copied back.
            self._unwaited = True
            self._warn_once(
                "unwaited-forward",
                "a forward ran after step() and no module watched with opt.watch() waited for "
                "the weights being copied back (a model that ran under torch.compile before "
                "watch(): torch.compile ignores hooks added after that); from now on step() "
                "waits for every copy back before it returns. Call opt.watch(model) before the "
                "model's first compiled forward",
            )
        self.synchronize()  # the previous step's copies back (wait="module") are done
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
                    raise ValueError(
                        f"param group {gi}: {rec.name} keeps state {list(rec.state_keys)} since "
                        f"it was placed, the group's values now need {list(keys)} (momentum "
                        "turned on or off after the optimizer was built)"
                    )
                if p in group_of:
                    raise RuntimeError(
                        f"{self._name(group, gi, i)} is in param groups {index_of[p]} and {gi}: "
                        "a param may be in one group only"
                    )
                group_of[p], index_of[p] = group, gi
                self._record(p, group, gi, i)
        stats = dict.fromkeys(("d2h_wait_ms", "cpu_update_ms", "h2d_ms", "d2h_ms"), 0.0)
        stats.update(d2h_nbytes=0, h2d_nbytes=0)
        st = StepState(hypers, group_of, stats)
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

    def _same_values(self, st: StepState, moved: dict[torch.Tensor, torch.Tensor]) -> set:
        """Of the params in ``moved`` (param -> its grad now, whose version moved after its
        update started), those whose norm is unchanged (one host sync, on this rare path)."""
        have = [p for p in moved if p in st.fingerprints]
        if not have:
            return set()
        now = torch.stack(_norms([local(moved[p]) for p in have])).cpu()
        then = torch.stack([st.fingerprints[p] for p in have]).cpu()
        # NaN == NaN here: GradScaler's own check rewrites a grad holding a NaN unchanged
        same = ((now == then) | (now.isnan() & then.isnan())).tolist()
        return {p for p, ok in zip(have, same, strict=True) if ok}

    def _check_single_process(self) -> None:
        """A hook's grad is reduced: one process, FSDP2's (sharded, hooks after reduce), or
        announced by DDP's comm hook (``ddp=``)."""
        dist = torch.distributed
        if (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and self._ddp is None
            and not all(is_dtensor(p) for p in self._records)
        ):
            raise RuntimeError(
                f"overlap='backward' with a world size of {dist.get_world_size()} and params "
                "that are not FSDP2's: a grad hook sees DDP's un-reduced grad (no DDP grad "
                "source is attached yet); use FSDP2, overlap='step' or overlap='delayed'"
            )

    def _check_grad(self, p: torch.Tensor) -> None:
        if p.grad.layout != torch.strided:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients: "
                f"{self._records[p].name} has a {p.grad.layout} grad"
            )
        if is_dtensor(p) and (
            not is_dtensor(p.grad) or tuple(p.grad.placements) != tuple(p.placements)
        ):
            got = tuple(p.grad.placements) if is_dtensor(p.grad) else "a plain tensor"
            raise RuntimeError(
                f"the grad of {self._records[p].name} is {got}, the param is sharded "
                f"{tuple(p.placements)}: each rank updates its own shard from a grad sharded "
                "the same way (FSDP2 reduce-scatters it so)"
            )
        if p.grad.shape != p.shape:
            raise RuntimeError(
                f"grad of {self._records[p].name} has shape {tuple(p.grad.shape)}, "
                f"param {tuple(p.shape)}"
            )

    def _check_worker(self, params: list[torch.Tensor]) -> None:
        if self._closed or (self._pipeline is not None and not self._pipeline.worker.alive):
            raise RuntimeError(
                f"{type(self).__name__} is closed (opt.close() was called; its CPU worker is "
                "stopped): build a new optimizer and load this one's state_dict() to go on"
            )

    def _prepare(self, st: StepState, params: list[torch.Tensor]) -> None:
        """Create state lazily, refresh stale masters, advance the offloaded params' ``step``
        (once per step, even when buckets cut a param in several segments)."""
        steps = []
        for p in params:
            if p in st.prepared:
                continue
            st.prepared.add(p)
            rec = self._records[p]
            if not self.state.get(p):  # none yet (an empty entry: a defaultdict lookup)
                self._init_state(p, rec)
            elif rec.is_stale(p):
                self._refresh_if_stale(p, rec)
            state = self.state[p]
            if self.rule.lazy_state and any(k not in state for k in rec.state_keys):
                st.first.add(p)  # the kernel's is_first_step initialises these
                for k in rec.state_keys:
                    state[k] = self._new_state_tensor(p, rec, k)
            if rec.offloaded and self.rule.has_step:
                steps.append(state["step"])
        if steps:
            torch._foreach_add_(steps, 1)

    def _prepare_device(self, st: StepState, with_grad: list[torch.Tensor]) -> list:
        """Prepare the device-resident params; their work grouped by frozen hyperparameters."""
        on_device = [p for p in with_grad if not self._records[p].offloaded]
        self._prepare(st, on_device)
        by_group: dict[tuple, tuple[Hyper, list, bool]] = {}
        for p in on_device:
            hyper, first = st.hypers[id(st.group_of[p])], p in st.first
            by_group.setdefault((id(hyper), first), (hyper, [], first))[1].append(p)
        return list(by_group.values())

    def _open_buckets(self, st: StepState, with_grad: list[torch.Tensor]) -> list:
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

    def _feed(
        self, st: StepState, items: list[tuple[Bucket, list[int]]], scale, early=False
    ) -> None:
        """Prepare the params of these buckets and queue each on the step's run, with its
        grads captured now and an event on this thread's stream (I1)."""
        if not items:
            return
        params = list(
            dict.fromkeys(b.arena.params[b.segments[n].k] for b, idx in items for n in idx)
        )
        for p in params:
            if p not in st.prepared:
                self._check_grad(p)
        self._prepare(st, params)
        if st.run is None:
            st.run = self._pipeline.begin(self._update_bucket, st.stats)
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
                              targets, drop_grads=delayed, amp=st.amp)  # fmt: skip
            st.fed[b] = work
            st.run.feed(work)
            if delayed:
                # The update holds the grads until their D2H lands; the next backward makes
                # new ones instead of accumulating into memory a copy may still read.
                for n in idx:
                    p = params[b.segments[n].k]
                    if st.landing[p] == 0:
                        p.grad = None

    def _finish(self, st: StepState, streams) -> None:
        """The step is over: its params are marked written, its figures become ``stats``."""
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
        st.stats["step_ms"] = (time.perf_counter() - st.t0) * 1e3
        self._stats = st.stats

    def _streams(self) -> dict[torch.device, Any]:
        """The training thread's stream per device, captured here: the stream that reads the
        new weights."""
        return {d: torch.cuda.current_stream(d) if tr.cuda else None
                for d, tr in self._transfers().items()}  # fmt: skip

    def _abandon(self, st: StepState, why: str) -> None:
        """A step whose updates started cannot complete: refuse until load or discard."""
        if st.run is not None:
            st.run.abort()
        self._broken = why
        self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"{type(self).__name__} is inconsistent: {self._broken}, so some params were "
                "updated and others not; call opt.load_state_dict(...) to restore a checkpoint, "
                "or opt.discard_failed_step() to go on from here"
            )

    # ------------------------------------------------------------------ clipping
    def _norm_and_scale(self, params: list[torch.Tensor], max_norm: float, inv=None):
        """Global L2 norm of ``params``' grads (times ``inv``, a GradScaler's inverse scale,
        when given) and torch's clip coefficient, on the device."""
        if not params:
            zero = torch.zeros((), dtype=torch.float32)
            return zero, torch.ones((), dtype=torch.float32)
        device = params[0].grad.device
        sharded = [p.grad for p in params if is_dtensor(p.grad)]
        if sharded:
            # FSDP2: the same DTensor arithmetic as torch's clip_grad_norm_ (per-shard norms,
            # their norm, then one all-reduce over the mesh in full_tensor()): every rank gets
            # the global norm. Params outside FSDP2 (plain) join through one more norm.
            norms = torch._foreach_norm(sharded, 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack(list(norms))).full_tensor().to(device)
            plain = [p.grad for p in params if not is_dtensor(p.grad)]
            if plain:
                rest = torch._foreach_norm(plain, 2, dtype=torch.float32)
                rest = torch.linalg.vector_norm(torch.stack([n.to(device) for n in rest]))
                norm = torch.linalg.vector_norm(torch.stack([norm, rest]))
        else:
            norms = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
        if inv is not None:
            norm = norm * inv.to(norm.device)  # the unscaled grads' norm (amp.py's note)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_
        return norm, scale

    def _clip(self, st: StepState, params: list[torch.Tensor], max_norm: float, inv=None) -> None:
        have = set(params)
        order = [p for p in st.group_of if p in have]  # group order: fixed
        st.norm, coef = self._norm_and_scale(order, max_norm, inv)
        st.scale = coef if inv is None else (inv, coef)  # unscale first, as torch's order
        self.last_grad_norm = st.norm

    def _scaling(self, st: StepState, params: list[torch.Tensor], grad_scale, inf) -> None:
        """This step's clip factors (``st.scale``: ``max_grad_norm``'s coefficient, after the
        inverse scale with a GradScaler) and GradScaler inputs (``st.amp``); amp.py's note."""
        if self.max_grad_norm is not None:
            inv = None if grad_scale is None else inverse(grad_scale)
            self._clip(st, params, self.max_grad_norm, inv)
            grad_scale = None  # unscaled on the device, before the coefficient
        if grad_scale is not None or inf is not None:
            st.amp = AmpInputs(grad_scale, inf)

    # ------------------------------------------------------------------ updates
    def _update_bucket(self, work: BucketWork, grads: list[torch.Tensor]) -> None:
        """On the worker: the rule over the bucket's segments ``work.idx``, whose grads (in
        the update dtype, on the host) are ``grads``; one kernel call per group."""
        b = work.bucket
        masters = b.state_views(b.arena.master)
        states = [b.state_views(flat) for flat in b.arena.states.values()]  # the rule's order
        amp = None
        if work.amp is not None:
            work.amp.wait(self.timeout_s)  # the scale and found_inf have landed (amp.py)
            amp = work.amp.kernel_args(host=True)
        for hyper, positions, steps, first in work.payload:
            segs = [work.idx[j] for j in positions]
            self.rule.update(hyper, [masters[i] for i in segs], [grads[j] for j in positions],
                             [[s[i] for i in segs] for s in states], steps, host=True,
                             first=first, amp=amp)  # fmt: skip

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
        changed = master.to(p.dtype) != current  # (shape of p) bool, where the master is stale
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
                            grads[n] = g
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
