"""The schedule of the offloaded part of a step: D2H -> CPU update (worker) -> H2D, per bucket.

The pipeline moves bytes; it does not know the update rule. Each step's offloaded work is one
:class:`StepRun`: the optimizer *feeds* it buckets as they become ready (all at once inside
``step()``, or one by one from grad hooks during backward), each with its grads, the event
those grads are final after (captured on the thread that knew it: no thread looks up
``current_stream()`` for another), an optional clip coefficient and what the update needs; the
run hands each bucket to an ``update(work, grads)`` callable on the worker. The whole schedule
runs on the worker, D2H launches included (a training thread launching copies while the
worker's OpenMP pool runs the kernel preempts one of its threads and stalls the whole parallel
region): per bucket, taking of those queued the one the next forward reads first (not the feed
order: :class:`StepRun`), it starts the D2H while a staging slot is free, waits for the oldest
started bucket's D2H, runs the update, gives the slot back and queues the H2D. So the D2H of
one bucket and the H2D of the one before run while the CPU updates the one between. Where the
worker has an update thread (opt-in: OFFLOADOPT_UPDATE_THREAD), the updates run there,
back to back, and the worker's launches overlap them (:meth:`StepRun._serve`). The invariants
(I1)-(I5) cited below are in transfer.py's note.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt import kernels
from offloadopt.link.layout import Bucket
from offloadopt.link.transfer import SLOTS, Slot, Transfer, wait_event
from offloadopt.link.worker import Job, WaitTimeout, Worker

__all__ = ["BucketWork", "BucketError", "StepRun", "Pipeline"]


_UNTRACED = contextlib.nullcontext()


def _traced(name: str) -> Any:
    """A ``torch.profiler`` range called ``name`` while a profiler runs, else nothing: a range
    makes a dispatcher call on entry and exit even when no profiler listens, four per bucket.
    The worker is not the thread that started the profiler, so the check is the process-wide
    flag that every ``torch.profiler`` start sets (the C++ one is per thread)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return _UNTRACED


class BucketError(RuntimeError):
    """The update of one bucket failed; the message names the bucket and the cause."""


@dataclass(eq=False)
class BucketWork:
    """One bucket's share of a step, prepared by the feeding thread (the worker never reads
    ``opt.state`` or ``p.grad``).

    ``idx``: the segments whose param has a grad; ``grads``: their flat grad ranges on the
    device, in ``idx`` order, captured when the bucket was fed; ``ready``: the event after which
    those grads are final and no queued kernel reads the bucket's old weights (None without
    CUDA); ``scale``: a clip coefficient (0-dim fp32 on the device), or a tuple of such factors
    applied in order (a GradScaler's inverse scale, then the clip coefficient), that the upcast
    grads are multiplied by before D2H, or None; ``release``: ``(param, weakref to the grad fed)`` pairs
    whose grad the grads' owner drops once this D2H has landed (see StepRun.take_landed);
    ``payload``: the optimizer's (frozen hyperparameters, steps); ``targets``: where the new
    weights go, one flat view per segment of the bucket (None: the params themselves);
    the worker drops ``grads`` once the D2H has landed (overlap="delayed" took them from their
    params: their device memory goes back at once; otherwise it goes when the caller drops
    ``p.grad``, not when this step ends, which with ``wait="module"`` is the next forward);
    ``amp``: the step's GradScaler inputs (offloadopt/step/amp.py ``AmpInputs``), or None;
    ``out``: set by the pipeline before the update where the grads crossed in the arena's
    ``link_dtype`` (bf16): per segment of ``idx``, the host staging view (the grads' own)
    where the update writes the new weights in that dtype, which cross H2D from there.
    ``before``: called with this work on the worker just before its update (speculative
    updates keep the pre-step state there: offloadopt/step/speculate.py), or None;
    ``backup``: set by ``before`` where the update itself copies the pre-step state out (the
    CPU kernel's backups): per arena buffer (the master, then each state key in arena order)
    the bucket's range of it, where the update writes the values it overwrites; or None.
    """

    bucket: Bucket
    idx: list[int]
    grads: list[torch.Tensor]
    ready: Any = None
    scale: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    release: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    payload: Any = None
    targets: list[torch.Tensor] | None = None
    amp: Any = None
    out: list[torch.Tensor] | None = None
    before: Callable[[BucketWork], None] | None = None
    backup: list[torch.Tensor] | None = None


class StepRun:
    """One step's offloaded buckets in flight: fed from any thread, run by one job on the
    worker until :meth:`close` and the queue is drained. Of the buckets queued when the worker
    takes the next one, it takes the one the next forward reads first (the highest
    ``Bucket.index``: buckets run in reverse registration order), so that with ``wait="module"``
    the forward waits least: in backward mode the grads of the last layers arrive first, and
    their updates would otherwise finish first although the forward needs them last.

    Args:
        pipeline: the transfers and the worker.
        update: ``update(work, grads)``, the rule over one bucket on the worker.
        stats: the step's figures (the worker adds times and bytes).
    """

    def __init__(self, pipeline: Pipeline, update, stats: dict[str, float]):
        self.pipeline, self._update_fn, self.stats = pipeline, update, stats
        self._cond = threading.Condition()
        self._queue: deque[BucketWork] = deque()
        self._closed = False
        self.fed: list[BucketWork] = []  # in feed order
        self.launched = 0  # buckets whose D2H the worker has started
        # buckets whose H2D the worker has queued, in the order it queued them (publish)
        self.h2d_queued: dict[Bucket, None] = {}
        self._landed: list[BucketWork] = []  # buckets whose D2H has landed, not yet taken
        self.job = pipeline.worker.submit(self._serve, "the offloaded update of this step")

    # ---------------------------------------------------------------- feeding side
    def feed(self, work: BucketWork) -> None:
        """Queue one bucket (any thread).

        Raises:
            WorkerError: the run already failed (its error, naming the bucket).
            RuntimeError: the run was closed.
        """
        self._raise_if_failed()
        with self._cond:
            ended = self._closed
            if not ended:
                self._queue.append(work)
                self.fed.append(work)
                self._cond.notify_all()
        if ended:
            # The worker closes a run that failed before its job reports the failure: wait for
            # the report, so the caller sees the bucket's error (tests/test_delayed.py).
            self.job.done.wait(self.pipeline.timeout_s)
            self._raise_if_failed()
            raise RuntimeError("offloadopt: a bucket was fed to a step that has ended")

    def close(self) -> None:
        """No more buckets: the worker drains the queue and ends the job (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self) -> None:
        """Drop the buckets not yet started and close (a step abandoned part-way)."""
        with self._cond:
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Block until the worker is done with this run; re-raise its failure.

        Raises:
            WorkerError: an update failed (names the bucket). TimeoutError: not done in time.
        """
        self.job.wait(timeout_s)

    def wait_launched(self, most_pending: int, timeout_s: float) -> None:
        """Backpressure: block until at most ``most_pending`` fed buckets wait for their D2H.

        Raises:
            TimeoutError: the worker fell behind for ``timeout_s``. WorkerError: it failed.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.fed) - self.launched > most_pending and not self.job.done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(
                        f"offloadopt: waited {timeout_s:g} s for the worker to start the D2H of "
                        f"{len(self.fed) - self.launched - most_pending} more buckets"
                    )
                self._cond.wait(min(left, 1.0))
        self._raise_if_failed()

    def wait_h2d_queued(self, bucket: Bucket, timeout_s: float) -> None:
        """Block until the worker has queued ``bucket``'s H2D (its event then exists: a
        stream waiting on an event not yet recorded would not wait at all).

        Raises:
            TimeoutError: not queued in time (names the bucket). WorkerError: the run failed.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while bucket not in self.h2d_queued and not self.job.done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(
                        f"offloadopt: waited {timeout_s:g} s for the H2D of {bucket.label}"
                    )
                self._cond.wait(min(left, 1.0))
        self._raise_if_failed()

    def take_landed(self) -> list[BucketWork]:
        """The buckets whose D2H has landed since the last call (any thread): their device
        grads are no longer read by this step's copies."""
        with self._cond:
            landed, self._landed = self._landed, []
        return landed

    def _raise_if_failed(self) -> None:
        if self.job.done.is_set() and self.job.error is not None:
            self.job.wait(0)  # raises the worker's error

    # ---------------------------------------------------------------- the worker's side
    def _next(self, block: bool) -> BucketWork | None:
        stopping = self.pipeline.worker.stopping
        with self._cond:
            while block and not self._queue and not self._closed:
                if stopping.is_set():  # the optimizer closed or went with this step open
                    return None
                self._cond.wait(0.5)  # a feed, close or abort wakes it at once
            return self._take() if self._queue else None

    def _take(self) -> BucketWork:
        """Remove and return the queued bucket the next forward reads first (under the lock)."""
        first = max(range(len(self._queue)), key=lambda n: self._queue[n].bucket.index)
        work = self._queue[first]
        del self._queue[first]
        return work

    def _serve(self) -> None:
        """On the worker: at most :data:`SLOTS` buckets hold a slot at once. Each bucket's
        update is handed to the worker's update thread where it has one
        (:meth:`Worker.run_update`), queued behind the one before; while it runs, this thread
        queues the H2D of the bucket updated before it and starts the D2H of the next, so the
        kernel never waits for those launches. Without an update thread the update runs here,
        between the launches."""
        p, stats = self.pipeline, self.stats
        pending: deque[tuple[BucketWork, Transfer, Slot, Any]] = deque()  # D2H started
        updating: deque[tuple[BucketWork, Transfer, Slot, bool, Job]] = deque()  # handed on
        depth = 2 if p.worker.overlap else 1  # updates handed on at once: one runs, one waits
        cancel = threading.Event()  # set on a failure: updates handed on and not begun skip
        started = None  # the first bucket's arrival: the worker's busy time runs from there
        try:
            while True:
                while len(pending) + len(updating) < SLOTS:
                    t = time.perf_counter()
                    work = self._next(block=not pending and not updating)
                    if work is None:
                        break
                    if started is None:
                        started = time.perf_counter()
                    else:
                        stats["feed_wait_ms"] += (time.perf_counter() - t) * 1e3
                    t = time.perf_counter()
                    with _traced("offloadopt.launch_d2h"):
                        pending.append((work, *p._start_d2h(work, stats)))
                    stats["launch_ms"] += (time.perf_counter() - t) * 1e3
                    with self._cond:
                        self.launched += 1
                        self._cond.notify_all()
                while pending and len(updating) < depth:
                    work, tr, slot, d2h_done = pending.popleft()
                    # a slot holding the new weights (the link dtype) stays taken until its H2D
                    # is queued: that copy reads it (I5)
                    keeps = slot.holds_weights(work.bucket)
                    run = functools.partial(self._update_one, work, tr, slot, d2h_done, cancel)
                    updating.append((work, tr, slot, keeps,
                                     p.worker.run_update(run, work.bucket.label)))  # fmt: skip
                if not updating:
                    return  # closed and drained
                work, tr, slot, keeps, job = updating.popleft()
                try:
                    job.result()
                except BaseException:
                    if keeps:
                        tr.ring.release(slot)
                    raise
                self._finish(work, tr, slot, keeps, started)
        except BaseException:
            cancel.set()  # the updates handed on and not yet begun skip theirs
            raise
        finally:
            # Handed on: wait until they ended (I5). An update that failed set ``cancel``
            # itself, so the ones queued behind it skipped; one that had begun before a failure
            # here ran to its end, and its H2D is queued as any other's: a failed step leaves
            # every bucket either updated with its weights sent, or untouched.
            for work, tr, slot, keeps, job in updating:
                job.done.wait()
                if job.error is None and job.value:
                    try:
                        self._finish(work, tr, slot, keeps, started)  # gives its slot back
                    except Exception:  # noqa: BLE001, S110 - the step's own error is raised
                        pass
                    continue
                if keeps:
                    tr.ring.release(slot)
            for _, tr, slot, _ in pending:  # started, never updated: wait, then free (I5)
                if tr.cuda:
                    tr.d2h.synchronize()
                tr.ring.release(slot)
            with self._cond:
                self._queue.clear()
                self._closed = True
                self._cond.notify_all()

    def _update_one(self, work: BucketWork, tr: Transfer, slot: Slot, d2h_done,
                    cancel: threading.Event) -> bool:  # fmt: skip
        """One bucket's update (on the update thread, or the worker's), unless ``cancel`` is
        set: a bucket before it failed, and this one then frees its slot without an update.
        Returns whether it updated; on its own failure it sets ``cancel`` before raising."""
        if tr.cuda and torch.cuda.current_device() != tr.device.index:
            # this thread's device is the bucket's before its first CUDA call (an event query
            # on a thread still on device 0 would make a context on GPU 0 on another GPU's rank)
            torch.cuda.set_device(tr.device)
        if cancel.is_set():
            if tr.cuda:
                tr.d2h.synchronize()  # its D2H may still write the slot (I5)
            if not slot.holds_weights(work.bucket):
                tr.ring.release(slot)  # else the worker gives it back (_serve's finally)
            return False
        try:
            self.pipeline._update(work, tr, slot, d2h_done, self._update_fn, self.stats)
        except BaseException:
            cancel.set()  # before the next update on this thread begins
            raise
        return True

    def _finish(self, work: BucketWork, tr: Transfer, slot: Slot, keeps: bool, started) -> None:
        """On the worker, after ``work``'s update: its grads are dropped, its H2D queued, its
        slot given back where it held the new weights, its figures counted."""
        stats = self.stats
        # Landed (waited for in _update). The worker never touches p.grad: setting it here
        # while the training thread reads it crashed torch's tensor wrapper; the thread that
        # owns the grads drops them (take_landed).
        work.grads = []  # read by nothing from here on (the D2H has landed)
        with self._cond:
            self._landed.append(work)
        t = time.perf_counter()
        try:
            with _traced("offloadopt.launch_h2d"):
                tr.start_h2d(work.bucket, work.idx, slot, work.ready, work.targets)
        finally:
            if keeps:
                tr.ring.release(slot)
        stats["launch_ms"] += (time.perf_counter() - t) * 1e3
        if tr.cuda:  # without CUDA the copies are host to host: no link
            link = slot.link or work.bucket.arena.dtype
            stats["h2d_nbytes"] += work.bucket.link_nbytes(link)
        stats["buckets"] += 1
        stats["worker_ms"] = (time.perf_counter() - started) * 1e3
        with self._cond:
            self.h2d_queued[work.bucket] = None
            self._cond.notify_all()


class Pipeline:
    """Transfers per device and the worker; each step's work is a :class:`StepRun`.

    Args:
        worker: runs the schedule: D2H launches, updates, H2D launches.
        timeout_s: the longest any single wait may last before it raises ``TimeoutError``.
    """

    def __init__(self, worker: Worker, timeout_s: float):
        self.worker = worker
        self.timeout_s = timeout_s
        self.transfers: dict[torch.device, Transfer] = {}
        # Test hook: called on the worker before each bucket's update (a delay there shows any
        # reliance on the worker being fast).
        self.worker_hook: Callable[[Bucket], None] | None = None

    def begin(self, update, stats: dict[str, float]) -> StepRun:
        """A new run for one step (the previous one must have ended: the worker runs jobs in
        order, so an open run would hold the next one back)."""
        return StepRun(self, update, stats)

    def _start_d2h(self, work: BucketWork, stats) -> tuple[Transfer, Slot, Any]:
        """Take a staging slot (I5) and start the bucket's D2H into it (on the worker)."""
        b = work.bucket
        tr = self.transfers[b.arena.device]
        slot = tr.ring.acquire(self.timeout_s, b.label)
        try:
            d2h_done = tr.start_d2h(b, work.idx, work.grads, slot, work.ready, work.scale)
        except BaseException:
            tr.ring.release(slot)
            raise
        if tr.cuda:  # without CUDA the copies are host to host: no link
            stats["d2h_nbytes"] += b.link_nbytes(slot.link)
        return tr, slot, d2h_done

    def _update(self, work: BucketWork, tr: Transfer, slot: Slot, d2h_done, update, stats) -> None:
        """Wait for the bucket's D2H, run the update, give the slot back (also on failure),
        unless it holds the new weights in the link dtype (the caller gives it back once their
        H2D is queued).

        Raises:
            BucketError: the update failed; the message names the bucket.
        """
        b = work.bucket
        try:
            t = time.perf_counter()
            wait_event(d2h_done, f"the D2H of {b.label}", self.timeout_s)  # (I2)
            tr.wait_h2d_done(b, self.timeout_s)  # (I3) last step's H2D from this master is done
            stats["d2h_wait_ms"] += (time.perf_counter() - t) * 1e3
            if self.worker_hook is not None:
                self.worker_hook(b)
            views = b.slot_views(slot.host, slot.link)
            # grads in the link dtype: the update writes the new weights over them
            work.out = [views[i] for i in work.idx] if slot.holds_weights(b) else None
            t, k = time.perf_counter(), kernels.kernel_ms()
            with _traced("offloadopt.cpu_update"):
                if work.before is not None:
                    work.before(work)
                update(work, [views[i] for i in work.idx])
            stats["cpu_update_ms"] += (time.perf_counter() - t) * 1e3
            stats["cpu_kernel_ms"] += kernels.kernel_ms() - k
        except WaitTimeout:
            raise
        except Exception as e:
            raise BucketError(f"{b.label}: {type(e).__name__}: {e}") from e
        finally:
            if not slot.holds_weights(b):
                tr.ring.release(slot)  # (I5) the host has read the grads (or given up on them)

    def publish(self, streams: dict[torch.device, Any], run: StepRun) -> None:
        """(I4) Each device's consumer stream (handed in) waits for the H2D of the run's
        buckets (after :meth:`StepRun.wait`: every H2D is queued), in the order the worker
        queued them, which is not the feed order (:class:`StepRun` takes the forward's first)."""
        by_device: dict[torch.device, list[Bucket]] = {}
        with run._cond:
            queued = list(run.h2d_queued)
        for b in queued:
            by_device.setdefault(b.arena.device, []).append(b)
        for device, buckets in by_device.items():
            self.transfers[device].publish(streams[device], buckets)

    def collect_timing(self) -> dict[str, float]:
        """GPU ms of the copies since the last call, summed over devices (``stats``)."""
        return {key: ms for key, (ms, _) in self.collect_link().items()}

    def collect_link(self) -> dict[str, tuple[float, int]]:
        """GPU ms and bytes of the copies since the last call, per direction (``d2h_ms``,
        ``h2d_ms``), summed over devices."""
        totals: dict[str, tuple[float, int]] = {}
        for tr in self.transfers.values():
            if tr.cuda:
                for key, (ms, n) in tr.collect_link().items():
                    old_ms, old_n = totals.get(key, (0.0, 0))
                    totals[key] = (old_ms + ms, old_n + n)
        return totals

    def close(self) -> None:
        """Stop the worker, wait for every copy, unpin the staging (idempotent)."""
        self.worker.close()
        for tr in self.transfers.values():
            tr.close()
