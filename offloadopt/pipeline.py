"""The schedule of the offloaded part of a step: D2H -> CPU update (worker) -> H2D, per bucket.

The pipeline moves bytes; it does not know the update rule. The optimizer hands it, per step,
the buckets to move (with the segments whose param has a grad), the events the copies must
follow (captured on the training thread: no thread looks up ``current_stream()`` for another)
and an ``update(work, grads)`` callable that runs the rule on the worker. Step mode: the
training thread starts each bucket's D2H as soon as a staging slot is free and queues the
bucket on the worker; the worker waits for that D2H, runs the update, gives the slot back and
queues the H2D. So the D2H of bucket k+1 and the H2D of bucket k-1 overlap the CPU update of
bucket k. ``step()`` waits for the worker before it returns. The invariants (I1)-(I5) cited
below are in transfer.py's note.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offloadopt.layout import Bucket
from offloadopt.transfer import Slot, Transfer, wait_event
from offloadopt.worker import Job, Worker

__all__ = ["BucketWork", "Pipeline"]


@dataclass
class BucketWork:
    """One bucket's share of a step: the segments ``idx`` whose param has a grad, and what the
    update needs, prepared on the training thread (the worker never reads ``opt.state``)."""

    bucket: Bucket
    idx: list[int]
    payload: Any = None  # the optimizer's (frozen hyperparameters, steps, ...)


class Pipeline:
    """Transfers per device, the worker, and the step-mode schedule over them.

    Args:
        worker: runs the updates and the H2D launches.
        timeout_s: the longest any single wait may last before it raises ``TimeoutError``.
    """

    def __init__(self, worker: Worker, timeout_s: float):
        self.worker = worker
        self.timeout_s = timeout_s
        self.transfers: dict[torch.device, Transfer] = {}
        # Test hook: called on the worker before each bucket's update (a delay there shows any
        # reliance on the worker being fast).
        self.worker_hook: Callable[[Bucket], None] | None = None

    def run(
        self,
        works: list[BucketWork],
        ready: dict[torch.device, Any],
        update: Callable[[BucketWork, list[torch.Tensor]], None],
        stats: dict[str, float],
    ) -> list[Job]:
        """Start every bucket of ``works`` (in order) and queue its update on the worker.

        ``ready[device]`` is the event (None without CUDA) after which the grads are final and
        no queued kernel reads the old weights. Returns the jobs; :meth:`finish` waits for them.
        Blocks only for free staging slots (I5).
        """
        jobs: list[Job] = []
        try:
            for work in works:
                jobs.append(self._start(work, ready[work.bucket.arena.device], update, stats))
        except BaseException:
            # Nothing of this step may still run when the caller sees the error.
            try:
                self.finish(jobs)
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
            raise
        return jobs

    def _start(self, work: BucketWork, ready: Any, update, stats: dict[str, float]) -> Job:
        """Take a slot, start the bucket's D2H, queue its host part on the worker."""
        b = work.bucket
        tr = self.transfers[b.arena.device]
        slot = tr.ring.acquire(self.timeout_s, b.label)  # (I5) backpressure from the worker
        try:
            d2h_done = tr.start_d2h(b, work.idx, slot, ready)
            stats["d2h_nbytes"] += b.nbytes

            def host_part() -> None:
                self._host_part(tr, work, slot, d2h_done, ready, update, stats)

            return self.worker.submit(host_part, b.label)
        except BaseException:
            if tr.cuda:
                tr.d2h.synchronize()  # (I5) the D2H into this slot is done before it is reused
            tr.ring.release(slot)
            raise

    def _host_part(
        self, tr: Transfer, work: BucketWork, slot: Slot, d2h_done, weights_free, update, stats
    ) -> None:
        """On the worker: wait for the D2H, update, free the slot, queue the H2D."""
        b = work.bucket
        try:
            t = time.perf_counter()
            wait_event(d2h_done, f"the D2H of {b.label}", self.timeout_s)  # (I2)
            tr.wait_h2d_done(b, self.timeout_s)  # (I3) last step's H2D from this master is done
            stats["d2h_wait_ms"] += (time.perf_counter() - t) * 1e3
            if self.worker_hook is not None:
                self.worker_hook(b)
            views = b.slot_views(slot.host)
            t = time.perf_counter()
            with torch.profiler.record_function("offloadopt.cpu_update"):
                update(work, [views[i] for i in work.idx])
            stats["cpu_update_ms"] += (time.perf_counter() - t) * 1e3
        finally:
            tr.ring.release(slot)  # (I5) the host has read the grads (or given up on them)
        tr.start_h2d(b, work.idx, slot, weights_free)
        stats["h2d_nbytes"] += b.nbytes

    def finish(self, jobs: list[Job]) -> None:
        """Wait for ``jobs`` in order; the first failure is raised once all have ended, so no
        job of this step still runs when the caller sees the error.

        Raises:
            WorkerError: a job failed (names its bucket). TimeoutError: a job never ended.
        """
        first: BaseException | None = None
        for job in jobs:
            try:
                job.wait(self.timeout_s)
            except TimeoutError:
                raise
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
                first = first or e
        if first is not None:
            raise first

    def publish(self, streams: dict[torch.device, Any], works: list[BucketWork]) -> None:
        """(I4) Each device's consumer stream (handed in) waits for its buckets' H2D."""
        by_device: dict[torch.device, list[Bucket]] = {}
        for work in works:
            by_device.setdefault(work.bucket.arena.device, []).append(work.bucket)
        for device, buckets in by_device.items():
            self.transfers[device].publish(streams[device], buckets)

    def collect_timing(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for tr in self.transfers.values():
            if tr.cuda:
                for key, ms in tr.collect_timing().items():
                    totals[key] = totals.get(key, 0.0) + ms
        return totals

    def close(self) -> None:
        """Stop the worker, wait for every copy, unpin the staging (idempotent)."""
        self.worker.close()
        for tr in self.transfers.values():
            tr.close()
