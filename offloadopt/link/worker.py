"""The CPU worker thread that runs the offloaded updates, immune to subnormal floats.

Why a thread of its own: the CPU update can then run while the training thread does other
work, and its floating-point mode and OpenMP pool are its own. torch's fused CPU AdamW slows
down 4-9x on subnormal operands (grads near 1e-20, an ``exp_avg`` stuck at a subnormal value
after ~720 steps of exactly-zero grads; figures in benchmarks/RESULTS.md). Flush-to-zero and
denormals-are-zero (``torch.set_flush_denormal(True)``) set only the calling thread's MXCSR;
OpenMP threads that already exist keep theirs, but a thread's own pool, created at its first
parallel region, inherits its setting. So the worker's first actions, before any other torch
op, are: set flush-to-zero, set its thread count, and run one parallel op so that its pool
exists with both settings. The training thread's floating-point mode is never changed, and its
thread count is restored once the worker's pool exists (``torch.set_num_threads`` also sets the
default for threads that start later).

Its cores (:func:`plan_cpus`): when updates overlap the training thread's work (backward mode,
delayed updates, module waits), the worker's thread sets its CPU affinity to the CPUs this
process may use less one core (and its hyperthread siblings) left to the training thread, before
its pool exists, so that the pool's threads inherit it: the thread that launches the GPU work
is never queued behind 15 busy update threads. The training thread's own affinity is not
touched. Several local ranks each take their slice of the CPUs first.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable

import torch

from offloadopt.validation import update_thread_env

__all__ = [
    "Worker",
    "Job",
    "WorkerError",
    "WaitTimeout",
    "CpuPlan",
    "default_cpu_threads",
    "local_ranks",
    "plan_cpus",
    "start_worker",
]

log = logging.getLogger("offloadopt")


class WaitTimeout(TimeoutError):
    """One of offloadopt's own waits outlasted ``timeout_s``; the message says what it awaited
    (a ``TimeoutError`` a signal handler raises is not one)."""


class WorkerError(RuntimeError):
    """An offloaded update failed on the worker; the message names the bucket, the cause is
    chained (``__cause__``) and its traceback is in the message."""


def local_ranks() -> int:
    """Processes of this job on this host: torchrun's ``LOCAL_WORLD_SIZE``, else the world size
    of an initialised default process group (``mp.spawn`` sets no variable), else 1."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return max(1, dist.get_world_size())
    return 1


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on (its CPU affinity), or None where the OS does not say
    (not Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's count."""
    cpus = usable_cpus()
    return len(cpus) if cpus else os.cpu_count() or 1


def _siblings(cpu: int) -> set[int]:
    """``cpu`` and its hyperthread siblings (Linux sysfs), or just ``cpu``."""
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as fh:
            return set(cpu_list(fh.read().strip())) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (the kernel's CPU list format). Raises ValueError."""
    out: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def cpu_text(cpus) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    cpus = sorted(cpus)
    runs: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs)


class CpuPlan:
    """Where the worker runs: ``cpus`` (its affinity, or None: the OS places its threads),
    ``threads`` (its OpenMP threads) and ``training`` (the CPUs left to the training thread;
    empty when none is)."""

    def __init__(self, cpus: list[int] | None, threads: int, training: list[int]):
        self.cpus, self.threads, self.training = cpus, threads, training

    def describe(self) -> str:
        """One line, e.g. ``"15 threads on CPUs 1-15 (CPU 0 left to the training thread)"``."""
        where = f"CPUs {cpu_text(self.cpus)}" if self.cpus else "any CPU"
        left = (f" (CPU{'s' if len(self.training) > 1 else ''} {cpu_text(self.training)} left to "
                "the training thread)") if self.training else ""  # fmt: skip
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} on {where}{left}"


def plan_cpus(option, threads: int | None, training_thread_busy: bool) -> CpuPlan:
    """The worker's CPUs and threads from the ``worker_cpus`` and ``cpu_threads`` options.

    ``option``: None (choose: this process's CPUs, or its local rank's slice of them when
    several local ranks share them, less the first core and its hyperthread siblings when the
    training thread is busy while the worker runs, unless that would leave the worker
    nothing), ``"any"`` (no affinity: the OS places the threads; :func:`default_cpu_threads`),
    or the CPU ids. ``threads``: the ``cpu_threads`` option (None: one per CPU of the plan)."""
    threads = None if threads is None else int(threads)  # numpy's ints too
    if isinstance(option, str):  # "any" (validated)
        n = threads or default_cpu_threads(training_thread_busy)
        return CpuPlan(None, n, [])
    if option is not None:
        cpus = sorted(set(int(c) for c in option))
        return CpuPlan(cpus, threads or len(cpus), [])
    mine = usable_cpus()
    if not mine:  # not Linux: the OS places the threads
        return CpuPlan(None, threads or default_cpu_threads(training_thread_busy), [])
    ranks = local_ranks()
    if ranks > 1 and len(mine) >= ranks:  # each local rank its own slice
        rank = int(os.environ.get("LOCAL_RANK", "0") or 0) % ranks
        per = len(mine) // ranks
        mine = mine[rank * per : (rank + 1) * per]
    training: list[int] = []
    if training_thread_busy:
        training = sorted(_siblings(mine[0]) & set(mine))
        if len(training) >= len(mine):
            training = []
    cpus = [c for c in mine if c not in training]
    return CpuPlan(cpus, threads or len(cpus), training)


def default_cpu_threads(training_thread_busy: bool) -> int:
    """The cores this process may use divided by the local ranks, minus one for the training
    thread when it has work of its own while the worker runs; at least 1.

    In step mode the training thread sleeps in ``step()`` while the worker runs, so the worker
    takes its core too: on the GPU host (16 cores, GPT-2 1.5B at fraction 1) the CPU update took
    443 ms on 15 threads against 409 ms on 16 (benchmarks/RESULTS.md)."""
    spare = 1 if training_thread_busy else 0
    return max(1, usable_cores() // local_ranks() - spare)


class Job:
    """One unit of work on the worker; :meth:`wait` re-raises its failure on the caller."""

    def __init__(self, fn: Callable[[], None], label: str):
        self.fn, self.label = fn, label
        self.value = None  # what ``fn`` returned
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.error_text = ""

    def result(self) -> None:
        """Block until the job ran (no limit: an update's own waits have theirs); re-raise its
        error as it was raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error

    def wait(self, timeout_s: float) -> None:
        """Block until the job ran.

        Raises:
            WorkerError: the job raised (the message names it, the cause is chained).
            TimeoutError: not done within ``timeout_s``; names the job.
        """
        if not self.done.wait(timeout_s):
            raise WaitTimeout(f"offloadopt: waited {timeout_s:g} s for the worker to finish {self.label}")  # fmt: skip
        if self.error is not None:
            raise WorkerError(
                f"{self.label} failed on the worker: {type(self.error).__name__}: "
                f"{self.error}\n{self.error_text}"
            ) from self.error


def _run(job: Job) -> None:
    try:
        job.value = job.fn()
    except BaseException as e:  # noqa: BLE001 - reported to the waiter, never lost
        job.error, job.error_text = e, traceback.format_exc()
    finally:
        job.fn = None  # drop the closure (and what it holds) now
        job.done.set()


def _serve(jobs: queue.SimpleQueue, ready: threading.Event, threads: int, flush: bool,
           cpus: list[int] | None, failed: list[BaseException]) -> None:  # fmt: skip
    """A worker thread's loop. Holds no reference to the optimizer (it can be collected while
    the thread waits; its finalizer then stops the thread). A failure to start goes to
    ``failed`` (the thread then ends)."""
    try:
        if cpus:  # this thread's affinity (Linux: pid 0 is the calling thread); its pool inherits
            os.sched_setaffinity(0, cpus)
        if flush:
            torch.set_flush_denormal(True)  # FTZ/DAZ for this thread; its pool inherits
        torch.set_num_threads(threads)  # this thread's count (and, for now, the default)
        torch.get_num_threads()  # torch's per-thread lazy init: adopts the count now
        torch.ones(1 << 20).mul_(2.0).sum()  # a parallel region: the pool exists, with FTZ set
        torch.set_grad_enabled(False)  # grad mode is per thread: the updates write in place
    except BaseException as e:  # noqa: BLE001 - the constructor raises it, at once
        failed.append(e)
        return
    finally:
        ready.set()
    while True:
        job = jobs.get()
        if job is None:
            return
        _run(job)
        # Not held while the thread waits for the next: a failed job's error holds its
        # traceback's frames, and with them the optimizer that ran it.
        del job


def _start_thread(name: str, threads: int, flush: bool, cpus: list[int] | None,
                  timeout_s: float) -> tuple[queue.SimpleQueue, threading.Thread]:  # fmt: skip
    """A daemon thread running :func:`_serve` (a live optimizer never keeps the process from
    exiting), started: its job queue and the thread."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    ready = threading.Event()
    failed: list[BaseException] = []
    thread = threading.Thread(target=_serve, args=(jobs, ready, threads, flush, cpus, failed),
                              name=name, daemon=True)  # fmt: skip
    thread.start()
    started = ready.wait(timeout_s)
    if failed:  # before the wait's timeout, not after it
        raise RuntimeError(
            f"offloadopt: the CPU worker thread did not start ({threads} threads, CPUs "
            f"{cpus or 'any'}): {type(failed[0]).__name__}: {failed[0]}"
        ) from failed[0]
    if not started:
        raise WaitTimeout(f"offloadopt: the CPU worker thread did not start in {timeout_s:g} s")
    return jobs, thread


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread, stopping: threading.Event) -> None:
    stopping.set()  # a job waiting for more work (an open step) ends too
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=60)


def _stop_all(worker, updates, stopping: threading.Event) -> None:
    """The worker's thread first (its open job may still hand the update thread work), then
    the update thread's."""
    _stop(*worker, stopping)
    if updates is not None:
        _stop(*updates, stopping)


class Worker:
    """One daemon thread running submitted jobs in FIFO order, and with ``overlap`` a second
    one, the *update thread*, that runs the updates the first hands it (:meth:`run_update`).

    Why two: the worker launches each bucket's copies (a few hundred microseconds of CUDA calls
    a bucket) between its updates; on one thread the CPU kernel and the memory bus wait while it
    does. With an update thread, bucket k is updated there while the worker launches the H2D of
    bucket k-1 and the D2H of bucket k+1 (offloadopt/link/pipeline.py). The update thread's pool
    then has ``threads - 1`` threads and the worker's one, on the same CPUs: one thread a CPU,
    so that the launches need not preempt a thread of the parallel region.

    Args:
        threads: OpenMP threads of the worker's own pool (``torch.set_num_threads`` there); with
            ``overlap``, the update thread's pool has one fewer and the worker's has one.
        flush_denormal: set flush-to-zero and denormals-are-zero on the worker (its pool too).
        cpus: the CPUs the worker and its pool run on (their affinity), or None: any.
        timeout_s: how long :meth:`__init__` waits for a thread to start.
        overlap: start the update thread (not for fewer than 2 threads).

    Raises:
        TimeoutError: a thread did not start in time.
        RuntimeError: a thread failed to start (its affinity or thread count refused); the
            cause is chained.
    """

    def __init__(self, threads: int, flush_denormal: bool, timeout_s: float = 60.0,
                 cpus: list[int] | None = None, overlap: bool = False):  # fmt: skip
        self.threads, self.flush_denormal, self.cpus = threads, flush_denormal, cpus
        self.overlap = bool(overlap) and threads >= 2
        self.stopping = threading.Event()  # set when the worker is closed or collected
        before = torch.get_num_threads()
        self._updates = None
        try:
            if self.overlap:  # the update thread first: the worker's own count is set last
                self._updates = _start_thread("offloadopt-update", threads - 1, flush_denormal,
                                              cpus, timeout_s)  # fmt: skip
            self._jobs = _start_thread("offloadopt-worker", 1 if self.overlap else threads,
                                       flush_denormal, cpus, timeout_s)  # fmt: skip
        except BaseException:
            if self._updates is not None:
                _stop(*self._updates, self.stopping)
            raise
        finally:
            # The pools exist with their own counts: give the training thread (and threads
            # started later) torch's count back.
            torch.set_num_threads(before)
        self._thread = self._jobs[1]
        self._update_thread = None if self._updates is None else self._updates[1]
        # Stops the threads when the worker is collected, closed, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_all, self._jobs, self._updates,
                                           self.stopping)  # fmt: skip

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._thread.is_alive()

    def submit(self, fn: Callable[[], None], label: str) -> Job:
        """Queue ``fn`` (run on the worker); the returned job's ``wait`` re-raises its error.

        Raises:
            RuntimeError: the worker was closed.
        """
        if not self.alive:
            raise RuntimeError("offloadopt: the CPU worker is closed (opt.close() was called)")
        job = Job(fn, label)
        self._jobs[0].put(job)
        return job

    def run_update(self, fn: Callable[[], None], label: str) -> Job:
        """Called on the worker: queue ``fn`` on the update thread, after the updates queued
        before it, and return at once; without an update thread (or once the worker is
        stopping), run it here first.
        :meth:`Job.result` waits for it and re-raises its own error."""
        job = Job(fn, label)
        if self._updates is None or self.stopping.is_set():  # stopping: it may be gone
            _run(job)
        else:
            self._updates[0].put(job)
        return job

    def close(self) -> None:
        """Let queued jobs finish, then stop the threads (idempotent)."""
        self._finalizer()


def start_worker(
    plan: CpuPlan, flush_denormal: bool, warn_once: Callable[[str, str], None],
    copies_cross_link: bool = False,
) -> Worker:  # fmt: skip
    """The CPU worker on ``plan``'s CPUs and threads, the count said where it surprises: a log
    line under ``OMP_NUM_THREADS=1`` (torchrun's), a warning (``warn_once(key, message)``)
    when it is above the usable cores or far below them. The environment's
    ``OFFLOADOPT_UPDATE_THREAD`` (validation.update_thread_env) says when it has an update
    thread (:class:`Worker`, at least 2 threads): "link", where ``copies_cross_link`` (a GPU's
    buckets: the copies are launches, short beside an update); "always", host copies too (then
    memcpys on one thread: the tests run the update thread's schedule that way); "never", the
    default until its step rows and CUDA tests have run on a GPU host
    (benchmarks/gpu_run.sh updthread)."""
    cpu_threads = plan.threads
    cores, ranks = usable_cores(), local_ranks()
    if os.environ.get("OMP_NUM_THREADS") == "1" and cpu_threads > 1:
        log.warning(
            "offloadopt: OMP_NUM_THREADS=1 (torchrun sets it when it starts several "
            "processes); the CPU update runs on its own %d threads (cores %d // local ranks "
            "%d, less one when updates overlap the training thread); pass cpu_threads= to "
            "choose", cpu_threads, cores, ranks,
        )  # fmt: skip
    if plan.cpus and cpu_threads > len(plan.cpus):  # pinned: its own CPUs are the limit
        warn_once(
            "threads-over",
            f"cpu_threads={cpu_threads} is more than the {len(plan.cpus)} CPU(s) of "
            f"worker_cpus ({cpu_text(plan.cpus)}): the worker's threads will contend for them",
        )
    elif cpu_threads > cores:
        warn_once(
            "threads-over",
            f"cpu_threads={cpu_threads} is more than the {cores} cores this process "
            "may use: the worker's threads will contend for them",
        )
    if cpu_threads * ranks < cores // 2:
        warn_once(
            "threads",
            f"the CPU update will run on {cpu_threads} threads x {ranks} local ranks, "
            f"far below the {cores} cores this process may use (cpu_threads=)",
        )
    mode = update_thread_env()
    overlap = mode == "always" or (mode == "link" and copies_cross_link)
    return Worker(cpu_threads, flush_denormal, cpus=plan.cpus, overlap=overlap)
