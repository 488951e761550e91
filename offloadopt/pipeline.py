"""The schedule of the offloaded part of a step: D2H -> CPU update (worker) -> H2D, per bucket.

The pipeline moves bytes; it does not know the update rule. The optimizer hands it, per step,
the buckets to move (with the segments whose param has a grad), the events the copies must
follow (captured on the training thread: no thread looks up ``current_stream()`` for another)
and an ``update(work, grads)`` callable that runs the rule on the worker. Step mode: the whole
schedule runs on the worker: it starts the D2H of the first buckets, then per bucket waits for
its D2H, runs the update, gives the slot back, starts the D2H of the bucket that takes the slot
and queues this bucket's H2D. So the D2H of bucket k+2 and the H2D of bucket k run while the
CPU updates bucket k+1. ``step()`` waits for the worker before it returns. The invariants
(I1)-(I5) cited below are in transfer.py's note.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offloadopt.layout import Bucket
from offloadopt.transfer import SLOTS, Slot, Transfer, wait_event
from offloadopt.worker import Job, Worker

__all__ = ["BucketWork", "BucketError", "Pipeline"]


class BucketError(RuntimeError):
    """The update of one bucket failed; the message names the bucket and the cause."""


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
        """Queue the step-mode schedule of ``works`` (in order) on the worker; :meth:`finish`
        waits for it.

        ``ready[device]`` is the event (None without CUDA), captured by the caller on the
        training thread's stream, after which the grads are final and no queued kernel reads
        the old weights. The whole schedule, D2H launches included, runs on the worker: a
        training thread launching copies while the worker's OpenMP pool runs the kernel would
        preempt one of its threads and stall the whole parallel region.
        """
        if not works:
            return []

        def schedule() -> None:
            self._schedule(works, ready, update, stats)

        return [self.worker.submit(schedule, f"the offloaded update of {len(works)} buckets")]

    def _schedule(self, works, ready, update, stats) -> None:
        """On the worker: the D2H of bucket n+SLOTS and the H2D of bucket n overlap the CPU
        update of bucket n+1; at most :data:`SLOTS` buckets hold a slot at once."""
        pending: deque[tuple[BucketWork, Transfer, Slot, Any]] = deque()

        def start(n: int) -> None:
            work = works[n]
            pending.append((work, *self._start_d2h(work, ready[work.bucket.arena.device], stats)))

        try:
            for n in range(min(SLOTS, len(works))):
                start(n)
            for n in range(len(works)):
                work, tr, slot, d2h_done = pending.popleft()
                self._update(work, tr, slot, d2h_done, update, stats)
                if n + SLOTS < len(works):
                    start(n + SLOTS)  # into the slot just given back
                tr.start_h2d(work.bucket, work.idx, slot, ready[work.bucket.arena.device])
                stats["h2d_nbytes"] += work.bucket.nbytes
        finally:
            for _, tr, slot, _ in pending:  # started, never updated: wait, then free (I5)
                if tr.cuda:
                    tr.d2h.synchronize()
                tr.ring.release(slot)

    def _start_d2h(self, work: BucketWork, ready: Any, stats) -> tuple[Transfer, Slot, Any]:
        """Take a staging slot (I5) and start the bucket's D2H into it."""
        b = work.bucket
        tr = self.transfers[b.arena.device]
        slot = tr.ring.acquire(self.timeout_s, b.label)
        try:
            d2h_done = tr.start_d2h(b, work.idx, slot, ready)
        except BaseException:
            tr.ring.release(slot)
            raise
        stats["d2h_nbytes"] += b.nbytes
        return tr, slot, d2h_done

    def _update(self, work: BucketWork, tr: Transfer, slot: Slot, d2h_done, update, stats) -> None:
        """Wait for the bucket's D2H, run the update, give the slot back (also on failure).

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
            views = b.slot_views(slot.host)
            t = time.perf_counter()
            with torch.profiler.record_function("offloadopt.cpu_update"):
                update(work, [views[i] for i in work.idx])
            stats["cpu_update_ms"] += (time.perf_counter() - t) * 1e3
        except TimeoutError:
            raise
        except Exception as e:
            raise BucketError(f"{b.label}: {type(e).__name__}: {e}") from e
        finally:
            tr.ring.release(slot)  # (I5) the host has read the grads (or given up on them)

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
