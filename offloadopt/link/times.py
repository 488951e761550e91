"""The link's timed copies, kept in bounded memory until ``opt.stats`` reads them."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["FOLD_AT", "LinkTimes"]

FOLD_AT = 64  # timed copies kept before the completed ones are folded into sums


class LinkTimes:
    """The side streams' timed copies since the last :meth:`take` (``opt.stats``' ``d2h_ms``
    and ``h2d_ms``), in bounded memory.

    The worker adds a (start, end) pair of CUDA events per bucket and direction. Kept until
    ``opt.stats`` was read, a run that never read it held four events per bucket per step
    (a review's finding; tests/test_transfer.py). Once :data:`FOLD_AT` pairs wait, the
    completed ones at the front of each stream's queue are folded into that stream's sums (a
    non-blocking ``query()``; a stream runs its copies in order, so the first pair still in
    flight ends the scan): at most the pairs in flight and ``FOLD_AT`` more are held.
    Thread-safe: the worker adds while the training thread takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque] = {}  # key -> (start, end, nbytes), oldest first
        self._sums: dict[str, tuple[float, int]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, key: str, start: Any, end: Any, nbytes: int) -> None:
        """A copy of ``nbytes`` on the stream that ``key`` names (``"d2h_ms"``, ``"h2d_ms"``)
        between ``start`` and ``end``, timing events recorded in that order on that stream."""
        with self._lock:
            self._queues.setdefault(key, deque()).append((start, end, nbytes))
            if len(self) >= FOLD_AT:
                self._fold(self._queues, self._sums, block=False)

    @staticmethod
    def _fold(queues: dict[str, deque], sums: dict[str, tuple[float, int]], block: bool) -> None:
        """Move the completed pairs at the front of each queue into ``sums`` (every pair,
        waiting for each, when ``block``)."""
        for key, q in queues.items():
            while q:
                start, end, nbytes = q[0]
                if block:
                    end.synchronize()  # stats only: the copies of steps that have returned
                elif not end.query():
                    break
                q.popleft()
                ms, n = sums.get(key, (0.0, 0))
                sums[key] = (ms + start.elapsed_time(end), n + nbytes)

    def take(self) -> dict[str, tuple[float, int]]:
        """GPU ms and bytes per key of every copy added since the last call (waiting for those
        still in flight); ``d2h_ms`` and ``h2d_ms`` are always there."""
        with self._lock:
            queues, sums = self._queues, self._sums
            self._queues, self._sums = {}, {}
        self._fold(queues, sums, block=True)
        return {"d2h_ms": (0.0, 0), "h2d_ms": (0.0, 0), **sums}
