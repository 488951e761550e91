"""Fault suites of HybridAdamW on the CPU: interrupts, failures, resumes and lifetimes.

Each case is a function of a seed that raises ``AssertionError`` (or any exception) when the
optimizer misbehaves, and returns a short outcome word otherwise. tests/test_faults.py and
tests/test_resume_matrix.py run a fast slice of them in CI; this script runs them in a loop
over seeds for ``--minutes`` and prints the counts run and failed per case.

The model (:class:`Probe`) is a list of params whose loss is ``sum(p * G)`` with ``G`` seeded
per step: backward gives every param the grad ``G`` exactly (grad hooks fire as in any
backward), and the grads do not depend on the weights, so every mode (step, backward, delayed)
trains to the same weights, bitwise ``torch.optim.AdamW(fused=True)`` for fp32 params on the
CPU (the reference of every case). The long run also draws ``wait="module"`` (step and
declared backward mode), where ``step()`` returns before the copies back land.

Cases:

- ``signal_step``, ``signal_backward``, ``signal_load``, ``signal_fraction``: a SIGALRM timer
  (``signal.setitimer``, a random delay up to a little more than the call takes) whose handler
  raises, around ``step()``, ``loss.backward()`` with the optimizer's grad hooks
  (``overlap="backward"``), ``load_state_dict()`` and ``set_offload_fraction()``. Afterwards the
  call either completed or left everything as it was (a retry then completes it), or, for an
  interrupted backward whose updates began, the optimizer refuses ``step()`` until
  ``load_state_dict()`` or ``discard_failed_step()``; never a half step taken silently. Weights
  and state are compared bitwise with the reference at every iteration.
- ``signal_record``: the same timer with a handler that only records: it runs exactly once.
- ``hook_error``: a user's grad hook raises during backward (``overlap="backward"``).
- ``worker_error``: the worker's update fails on the Nth bucket, in every mode; ``step()`` (or,
  delayed, the next ``step()``) raises ``WorkerError`` naming the bucket within ``timeout_s``;
  after ``load_state_dict()`` of the last checkpoint training goes on bitwise, after
  ``discard_failed_step()`` it goes on from the half-applied step.
- ``endurance``: N steps per mode with ``set_offload_fraction`` and a ``state_dict`` /
  ``load_state_dict`` cycle every few steps, bitwise against the reference, while host RSS,
  the process's threads and open file descriptors stay flat after warm-up (fds and Python
  threads exactly, OS threads within one, RSS within 32 MiB).
- ``lifetimes``: optimizers created, stepped once and dropped (some ``close()``d): threads,
  fds and RSS do not grow, and a weak reference to each dies after ``gc.collect()``.

``resume_configs``, ``resume_phase`` and ``resume_mismatches`` are tests/test_resume_matrix.py's
fresh-process resumes (torch.save and torch.distributed.checkpoint, across modes, fractions
and classes); they run there, in two processes, not in this loop.

Usage: python tests/long/faults.py --minutes 10 [--cases signal_step,worker_error]
Prints one line per case (``run``, ``failed``, outcomes) and the first failures; exit status
1 if any case failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import random
import signal
import statistics
import sys
import threading
import time
import traceback
import weakref
from collections import Counter

import torch

from offloadopt import HybridAdamW
from offloadopt.harness.train_log import host_rss_nbytes
from offloadopt.link.worker import WorkerError

SHAPES = [(64, 32), (64,), (48, 64), (48,), (32, 48), (32,), (7, 5, 3)]
MODES = {
    "step": {},
    "backward": dict(overlap="backward", grads_final=True),
    "delayed": dict(overlap="delayed"),
}
# wait="module": step() returns before the copies back land; the long run draws these too
WAIT_MODULE = {
    "module": dict(overlap="backward", grads_final=True, wait="module"),
    "step-module": dict(wait="module"),
}
ALL_MODES = {**MODES, **WAIT_MODULE}
FRACTIONS = (0.0, 0.5, 1.0)
TIMEOUT_S = 30.0  # the optimizer's timeout_s in every case: nothing may hang past it
RSS_SLACK_NBYTES = 32 * 2**20  # host RSS growth allowed after warm-up


class Alarm(Exception):
    """Raised by the SIGALRM handler of the signal cases."""


class Probe(torch.nn.Module):
    """Params of ``SHAPES`` (seeded); ``forward(step)`` is ``sum(p * G)`` with ``G`` seeded by
    the step, so each param's grad is ``G`` (fp32, shaped like it), whatever the weights."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, shapes=SHAPES):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
        )

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        loss = torch.zeros((), dtype=torch.float32)
        for p in self.ps:
            loss = loss + (p * torch.randn(p.shape, generator=g).to(p.dtype)).sum().float()
        return loss


def groups(params: list) -> list[dict]:
    """Two groups with different hyperparameters."""
    return [
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


def hybrid(model: Probe, fraction: float, mode: str, **kw) -> HybridAdamW:
    """HybridAdamW over ``groups(model)``; a bucket of about 1,000 elements, so each case
    runs several buckets."""
    kw = {"min_offload_numel": 1, "bucket_nbytes": 4 * 1024, "timeout_s": TIMEOUT_S,
          **ALL_MODES[mode], **kw}  # fmt: skip
    return HybridAdamW(groups(list(model.parameters())), offload_fraction=fraction, **kw)


class Reference:
    """``torch.optim.AdamW(fused=True)`` on a copy of the model, fed the hybrid's grads; can
    take a snapshot and go back to it."""

    def __init__(self, model: Probe):
        self.params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        self.opt = torch.optim.AdamW(groups(self.params), fused=True)

    def step(self, grads: list) -> None:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        self.opt.step()
        self.opt.zero_grad()

    def snapshot(self):
        return [p.detach().clone() for p in self.params], copy.deepcopy(self.opt.state_dict())

    @torch.no_grad()
    def restore(self, snap) -> None:
        weights, sd = snap
        for p, w in zip(self.params, weights, strict=True):
            p.copy_(w)
        self.opt.load_state_dict(copy.deepcopy(sd))

    @torch.no_grad()
    def take(self, model: Probe, opt) -> None:
        """Become the hybrid: its weights and state (after a step accepted as it is)."""
        for p, q in zip(self.params, model.parameters(), strict=True):
            p.copy_(q)
        self.opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def grads_of(model: Probe, step: int) -> list[torch.Tensor]:
    """The grads step ``step`` gives (what backward writes)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def same(model: Probe, ref: Reference) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.params, strict=True))


def same_state(opt, ref: Reference) -> bool:
    """The hybrid's state dict equals the reference's, bitwise (keys it has in common)."""
    mine, theirs = opt.state_dict()["state"], ref.opt.state_dict()["state"]
    if set(mine) != set(theirs):
        return False
    for k, entry in theirs.items():
        for key, t in entry.items():
            if not torch.equal(mine[k][key].reshape(t.shape), t):
                return False
    return True


def check(model: Probe, opt, ref: Reference, what: str) -> None:
    opt.synchronize()
    if not same(model, ref):
        diffs = [i for i, (p, q) in enumerate(zip(model.parameters(), ref.params, strict=True))
                 if not torch.equal(p, q)]  # fmt: skip
        raise AssertionError(f"{what}: weights of params {diffs} differ from the reference")
    if not same_state(opt, ref):
        raise AssertionError(f"{what}: optimizer state differs from the reference")


def train(model: Probe, opt, ref: Reference, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        model(s).backward()
        ref.step(grads_of(model, s))
        opt.step()
    check(model, opt, ref, f"after steps {steps.start}..{steps.stop - 1}")


@contextlib.contextmanager
def alarm_handler(handler=None):
    """SIGALRM's handler for the block (default: raise :class:`Alarm`); the timer and the
    previous handler are restored after it."""

    def raising(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, handler or raising)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def interrupted(call, delay_s: float) -> bool:
    """Run ``call()`` with SIGALRM due in ``delay_s``; whether :class:`Alarm` was raised (the
    timer is disarmed before this returns; an alarm in the disarming itself counts)."""
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(delay_s, 1e-6))
            call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Alarm:
        return True
    return False


def timed(call, n: int = 3) -> float:
    """Median seconds of ``call()`` over ``n`` runs."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------------------------- signals
def signal_step(seed: int, mode: str = "step", fraction: float = 0.5, iters: int = 8) -> str:
    """SIGALRM at a random point of ``step()``: the step completes whole (the handler's
    exception arrives after it) or does not start (a retry completes it)."""
    rng = random.Random(seed)
    model = Probe(seed)
    opt, ref = hybrid(model, fraction, mode), Reference(model)
    train(model, opt, ref, range(2))
    outcomes, took = Counter(), [0.002]
    with alarm_handler():
        for s in range(2, 2 + iters):
            opt.zero_grad()
            model(s).backward()
            grads = grads_of(model, s)
            t = time.perf_counter()
            alarmed = interrupted(opt.step, rng.uniform(0, 1.3 * statistics.median(took)))
            took.append(time.perf_counter() - t)
            opt.synchronize()
            ref.step(grads)
            # declared backward mode: the weights are new before step() ends the step
            ended = opt.debug.step is None
            if same(model, ref) and ended:
                outcomes["whole" if alarmed else "clean"] += 1
            elif not alarmed:
                raise AssertionError(f"step {s}: step() returned, weights differ or step open")
            else:
                opt.step()  # the step did not start (alarm before it): the retry is it
                opt.synchronize()
                outcomes["retried"] += 1
            check(model, opt, ref, f"step {s}, {mode}, fraction {fraction}, alarm {alarmed}")
    opt.close()
    return "+".join(f"{k}{v}" for k, v in sorted(outcomes.items()))


def signal_record(seed: int, mode: str = "step", fraction: float = 0.5) -> str:
    """A SIGALRM handler that records: it runs exactly once per timer, inside or after the
    step, and the step is whole."""
    rng = random.Random(seed)
    model = Probe(seed)
    opt, ref = hybrid(model, fraction, mode), Reference(model)
    calls = []
    with alarm_handler(lambda signum, frame: calls.append(signum)):
        for s in range(4):
            opt.zero_grad()
            model(s).backward()
            ref.step(grads_of(model, s))
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 0.003))
            opt.step()
            deadline = time.monotonic() + 1.0
            while not calls and time.monotonic() < deadline:
                time.sleep(0.001)
            if calls != [signal.SIGALRM]:
                raise AssertionError(f"step {s}: the handler ran {len(calls)} times, not once")
            calls.clear()
            check(model, opt, ref, f"step {s} with a recording handler")
    opt.close()
    return "once"


def _recover(model: Probe, opt, ref: Reference, before, how: str) -> str:
    """After a backward that failed part-way: ``step()`` either takes the grads backward left
    (equal to the reference fed the same), or refuses, naming the way out; then recover by
    ``how`` ("load": the checkpoint ``before``; "discard": accept the step as it is)."""
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
        # some params updated ("inconsistent"), or none yet ("nothing was changed": the
        # signal came before the first bucket was fed); either names the way out
        said = "inconsistent" in msg or "nothing was changed" in msg
        if not said or "discard_failed_step" not in msg:
            raise AssertionError(f"step() after a failed backward: unclear refusal: {msg}") from e
        try:  # refuses too, until recovered
            opt.state_dict()
        except RuntimeError:
            pass
        else:
            raise AssertionError("state_dict() after a refused step did not refuse")
        if how == "load":
            weights, sd = before
            with torch.no_grad():  # the model's checkpoint first, as a resume loads it
                for p, w in zip(model.parameters(), weights, strict=True):
                    p.copy_(w)
            opt.load_state_dict(copy.deepcopy(sd))
        else:
            opt.discard_failed_step()
            ref.take(model, opt)
        opt.zero_grad()
        return f"refused-{how}"
    opt.synchronize()
    ref.step(grads)
    return "stepped"


def signal_backward(seed: int, fraction: float = 0.5, iters: int = 6, **kw) -> str:
    """SIGALRM at a random point of backward, whose grad hooks start updates
    (``overlap="backward"``, ``grads_final=True``)."""
    rng = random.Random(seed)
    model = Probe(seed)
    opt, ref = hybrid(model, fraction, "backward", **kw), Reference(model)
    train(model, opt, ref, range(2))
    outcomes = Counter()
    with alarm_handler():
        for s in range(2, 2 + iters):
            before = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
            opt.zero_grad()
            if not interrupted(lambda s=s: model(s).backward(), rng.uniform(0, 0.003)):
                opt.step()
                ref.step(grads_of(model, s))
                outcomes["clean"] += 1
            else:
                outcomes[_recover(model, opt, ref, before, rng.choice(["load", "discard"]))] += 1
            check(model, opt, ref, f"step {s} after an alarm in backward")
    train(model, opt, ref, range(2 + iters, 4 + iters))  # usable afterwards
    opt.close()
    return "+".join(f"{k}{v}" for k, v in sorted(outcomes.items()))


def signal_load(seed: int, mode: str = "step", fraction: float = 0.5, iters: int = 6) -> str:
    """SIGALRM at a random point of ``load_state_dict()``: the state is the checkpoint's, or
    the one before (a retry loads it), never a mixture."""
    rng = random.Random(seed)
    model = Probe(seed)
    opt, ref = hybrid(model, fraction, mode), Reference(model)
    train(model, opt, ref, range(3))
    opt.synchronize()
    ckpt_a, ref_a = copy.deepcopy(opt.state_dict()), ref.snapshot()
    weights_a = [p.detach().clone() for p in model.parameters()]
    train(model, opt, ref, range(3, 5))
    ckpt_b, ref_b = copy.deepcopy(opt.state_dict()), ref.snapshot()
    took = timed(lambda: opt.load_state_dict(copy.deepcopy(ckpt_b)))
    outcomes = Counter()
    with alarm_handler():
        for _ in range(iters):
            sd = copy.deepcopy(ckpt_a)
            alarmed = interrupted(lambda sd=sd: opt.load_state_dict(sd), rng.uniform(0, 1.3 * took))
            ref.restore(ref_a)
            if same_state(opt, ref):
                outcomes["whole" if alarmed else "clean"] += 1
            else:
                ref.restore(ref_b)
                if not alarmed or not same_state(opt, ref):
                    raise AssertionError(
                        f"load_state_dict (alarm {alarmed}): the state is neither the "
                        "checkpoint's nor the one before"
                    )
                opt.load_state_dict(copy.deepcopy(ckpt_a))
                outcomes["retried"] += 1
            opt.load_state_dict(copy.deepcopy(ckpt_b))  # back to B for the next attempt
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights_a, strict=True):
                p.copy_(w)
        opt.load_state_dict(copy.deepcopy(ckpt_a))
    ref.restore(ref_a)
    train(model, opt, ref, range(3, 6))
    opt.close()
    return "+".join(f"{k}{v}" for k, v in sorted(outcomes.items()))


def _offloaded(model: Probe, opt) -> list[bool]:
    return [opt.is_offloaded(p) for p in model.parameters()]


def signal_fraction(seed: int, mode: str = "step", iters: int = 6) -> str:
    """SIGALRM at a random point of ``set_offload_fraction()``: the placement is the new
    fraction's or the old one's, whole (a retry moves it), and the state is unchanged."""
    rng = random.Random(seed)
    model = Probe(seed)
    layouts = {}
    for f in FRACTIONS:
        o = hybrid(model, f, mode)
        layouts[f] = _offloaded(model, o)
        o.close()
    opt, ref = hybrid(model, 0.5, mode), Reference(model)
    train(model, opt, ref, range(2))
    took = timed(lambda: opt.set_offload_fraction(opt.offload_fraction), 2)
    outcomes = Counter()
    s = 2
    with alarm_handler():
        for _ in range(iters):
            old = opt.offload_fraction
            new = rng.choice([f for f in FRACTIONS if f != old])
            alarmed = interrupted(
                lambda new=new: opt.set_offload_fraction(new), rng.uniform(0, 1.3 * took)
            )
            now = opt.offload_fraction
            if now not in (old, new) or _offloaded(model, opt) != layouts[now]:
                raise AssertionError(
                    f"set_offload_fraction({new}) from {old} (alarm {alarmed}): fraction {now}, "
                    f"placement {_offloaded(model, opt)} is neither's"
                )
            if now == old and old != new:
                if not alarmed:
                    raise AssertionError(f"set_offload_fraction({new}) returned, nothing moved")
                opt.set_offload_fraction(new)
                outcomes["retried"] += 1
            else:
                outcomes["whole" if alarmed else "clean"] += 1
            check(model, opt, ref, f"after set_offload_fraction({new}) from {old}")
            train(model, opt, ref, range(s, s + 1))
            s += 1
    opt.close()
    return "+".join(f"{k}{v}" for k, v in sorted(outcomes.items()))


# ---------------------------------------------------------------------------------- failures
class HookError(Exception):
    """Raised by a user's grad hook."""


def hook_error(seed: int, fraction: float = 0.5, when: str = "after", kind: str = "post") -> str:
    """A user's grad hook (``kind``: a post-accumulate-grad hook, or a tensor hook on the
    grad) on one param raises during backward (``overlap="backward"``, ``grads_final=True``);
    registered before or after (``when``) the optimizer's. Backward raises the user's error;
    ``step()`` then takes the grads there are or refuses clearly; after the recovery training
    goes on bitwise."""
    rng = random.Random(seed)
    model = Probe(seed)
    params = list(model.parameters())
    victim = params[rng.randrange(len(params))]
    armed = [False]

    def fail(*args):
        if armed[0]:
            raise HookError("a user's hook failed")

    def register():
        if kind == "post":
            return victim.register_post_accumulate_grad_hook(fail)
        return victim.register_hook(lambda g: fail())

    handle = register() if when == "before" else None
    opt, ref = hybrid(model, fraction, "backward"), Reference(model)
    handle = handle or register()
    train(model, opt, ref, range(2))
    before = ([p.detach().clone() for p in params], opt.state_dict())
    opt.zero_grad()
    armed[0] = True
    try:
        model(2).backward()
    except HookError:
        pass
    else:
        raise AssertionError("backward did not raise the hook's error")
    armed[0] = False
    outcome = _recover(model, opt, ref, before, rng.choice(["load", "discard"]))
    check(model, opt, ref, f"after a failed hook ({outcome})")
    train(model, opt, ref, range(3, 6))
    handle.remove()
    opt.close()
    return outcome


def worker_error(seed: int, mode: str = "step", fraction: float = 1.0, nth: int = 2,
                 recover: str = "load") -> str:  # fmt: skip
    """The worker's update of the ``nth`` bucket of a step raises: ``WorkerError`` naming the
    bucket at ``step()`` (delayed: at the next ``step()`` or ``synchronize()``), within
    ``timeout_s``; then ``recover`` ("load" the last checkpoint and the weights: training goes
    on bitwise; "discard": it goes on from the half-applied step, nothing hangs)."""
    model = Probe(seed)
    opt, ref = hybrid(model, fraction, mode, timeout_s=10.0), Reference(model)
    train(model, opt, ref, range(2))
    if opt.debug.pipeline is None or len(opt.buckets) < nth:
        raise AssertionError(f"fraction {fraction}: {len(opt.buckets)} buckets, no {nth}th")
    opt.synchronize()
    before = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))
    update, calls = opt.debug.updater.update_bucket, []

    def failing(work, grads):
        calls.append(work.bucket.index)
        if len(calls) == nth:
            raise RuntimeError("injected kernel failure")
        return update(work, grads)

    opt.debug.updater.update_bucket = failing
    t = time.perf_counter()
    opt.zero_grad()
    try:
        model(2).backward()  # backward mode: a hook feeding a bucket may meet the failure
        opt.step()
        opt.synchronize()  # delayed: the failure surfaces here
    except WorkerError as e:
        if "injected kernel failure" not in str(e) or "bucket" not in str(e):
            raise AssertionError(f"unclear WorkerError: {e}") from e
    else:
        raise AssertionError(f"the {nth}th bucket failed and nothing was raised")
    finally:
        del opt.debug.updater.update_bucket  # the class's method again
    if time.perf_counter() - t > 8.0:
        raise AssertionError("the failure took longer than the worker's timeout to surface")
    if recover == "load":
        with torch.no_grad():
            for p, w in zip(model.parameters(), before[0], strict=True):
                p.copy_(w)
        opt.load_state_dict(copy.deepcopy(before[1]))
    else:
        with contextlib.suppress(RuntimeError):  # refused until discarded, or already usable
            opt.step()
        opt.discard_failed_step()
        opt.synchronize()
        ref.take(model, opt)
    opt.zero_grad()
    train(model, opt, ref, range(3, 6))
    opt.close()
    return recover


# ---------------------------------------------------------------------------------- lifetimes
def process_figures() -> dict:
    """Host RSS (bytes), OS threads and open file descriptors of this process (Linux /proc)."""
    return {
        "rss_nbytes": host_rss_nbytes(),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "py_threads": threading.active_count(),
    }


THREAD_SLACK = 1  # OS threads above the first sample: a finished worker's OpenMP thread
# leaves a moment later, so one sample in a few counts one more (a leak of one thread per
# optimizer or per cycle would count tens)


def flat(samples: list[dict], rss_slack: int = RSS_SLACK_NBYTES) -> list[str]:
    """What grew over ``samples`` (after the first): Python threads and fds not at all, OS
    threads by at most ``THREAD_SLACK``, RSS by at most ``rss_slack`` bytes above the first
    sample."""
    first, bad = samples[0], []
    for key, slack in (("threads", THREAD_SLACK), ("fds", 0), ("py_threads", 0)):
        top = max(s[key] for s in samples)
        if top > first[key] + slack:
            bad.append(f"{key} {first[key]} -> {top}")
    top = max(s["rss_nbytes"] for s in samples)
    if top - first["rss_nbytes"] > rss_slack:
        bad.append(f"RSS grew {(top - first['rss_nbytes']) / 2**20:.1f} MiB")
    return bad


def endurance(seed: int, mode: str = "step", steps: int = 200, every: int = 20) -> str:
    """``steps`` steps with a ``set_offload_fraction`` and a ``state_dict`` /
    ``load_state_dict`` cycle every ``every`` steps, bitwise against the reference at each
    cycle; host RSS, threads and fds sampled at each cycle stay flat after the first two
    (threads and fds exactly, RSS within ``RSS_SLACK_NBYTES``). The mode's default bucket size
    (few buckets: each one is a hand-off between two threads, slow on a busy host)."""
    rng = random.Random(seed)
    model = Probe(seed)
    opt = hybrid(model, rng.choice(FRACTIONS), mode, bucket_nbytes=None)
    ref = Reference(model)
    samples = []
    for start in range(0, steps, every):
        train(model, opt, ref, range(start, start + every))
        opt.set_offload_fraction(rng.choice(FRACTIONS))
        sd = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(sd)
        del sd
        check(model, opt, ref, f"after the cycle at step {start + every}")
        samples.append(process_figures())
    opt.close()
    bad = flat(samples[2:])
    if bad:
        raise AssertionError(f"{mode}, {steps} steps: " + "; ".join(bad))
    return f"{len(samples)}samples"


def lifetimes(seed: int, count: int = 200, every: int = 20) -> str:
    """``count`` optimizers (random mode and fraction) built, stepped once and dropped, every
    third one ``close()``d first. Every ``every`` optimizers one ``gc.collect()`` (it takes
    about 0.5 s with torch loaded on a busy 2-core host): each optimizer dropped so far is
    dead (its weak reference), and threads, fds and RSS do not grow past the first sample.
    A delayed optimizer dropped with its update in flight would live until the worker ends that
    update if the worker's job held it (it holds the Updater's method, which refers to no
    optimizer): those still alive get 0.5 s more and one more collection, and are counted
    ("late")."""
    rng = random.Random(seed)
    model = Probe(seed)
    refs, modes, samples, late = [], [], [], 0
    for i in range(count):
        modes.append(rng.choice(list(MODES)))
        opt = hybrid(model, rng.choice(FRACTIONS), modes[-1])
        opt.zero_grad()
        model(i).backward()
        opt.step()
        if i % 3 == 0:
            opt.close()
        refs.append(weakref.ref(opt))
        del opt
        if (i + 1) % every == 0 or i == count - 1:
            gc.collect()
            alive = [n for n, r in enumerate(refs) if r() is not None]
            if any(modes[n] != "delayed" for n in alive):
                raise AssertionError(f"optimizers {alive} ({[modes[n] for n in alive]}) are alive")
            if alive:
                late += len(alive)
                time.sleep(0.5)
                gc.collect()
                alive = [n for n, r in enumerate(refs) if r() is not None]
                if alive:
                    raise AssertionError(f"delayed optimizers {alive} are alive after 0.5 s")
            # A delayed optimizer dropped with its update in flight is freed at once (the
            # worker's job holds the Updater, not the optimizer), and its worker thread ends
            # when that update does: give it up to 1 s before the sample.
            deadline = time.monotonic() + 1.0
            while (samples and threading.active_count() > samples[0]["py_threads"]
                   and time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.02)
            samples.append(process_figures())
    model.zero_grad()
    bad = flat(samples)
    if bad:
        raise AssertionError(f"{count} optimizers: " + "; ".join(bad))
    return f"{count}collected" + (f"+{late}late" if late else "")


# ---------------------------------------------------------------------------------- resumes
RESUME_STEPS = (3, 3)  # steps before the checkpoint, steps after the resume


def build(cfg: dict, model: Probe):
    """The optimizer of a resume configuration: ``cls`` "hybrid" (HybridAdamW, ``mode`` and
    ``fraction``), "torch" (``torch.optim.AdamW(fused=True)``) or "megatron"
    (``HybridDeviceOptimizer`` with torch's AdamW as both classes, ``fraction``)."""
    params = list(model.parameters())
    if cfg["cls"] == "torch":
        return torch.optim.AdamW(groups(params), fused=True)
    if cfg["cls"] == "megatron":
        from offloadopt import HybridDeviceOptimizer

        return HybridDeviceOptimizer(
            groups(params), offload_fraction=cfg["fraction"],
            cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
        )  # fmt: skip
    return hybrid(model, cfg["fraction"], cfg["mode"])


def resume_configs() -> dict[str, tuple[dict, dict, str]]:
    """name -> (the saving run's configuration, the resuming one's, how: "torch.save" or
    "dcp"). Every mode and fraction saves and resumes, into another mode and fraction, and
    each class into each other; the grads do not depend on the weights, so each pair must
    equal torch's AdamW run uninterrupted, bitwise."""
    h = lambda mode, fraction: {"cls": "hybrid", "mode": mode, "fraction": fraction}  # noqa: E731
    torch_ = {"cls": "torch"}
    meg = lambda fraction: {"cls": "megatron", "fraction": fraction}  # noqa: E731
    modes = list(MODES)
    out = {}
    for i, mode in enumerate(modes):
        for j, f in enumerate(FRACTIONS):
            other = (modes[(i + 1) % 3], FRACTIONS[(j + 1) % 3])
            out[f"hybrid-{mode}-{f}-to-{other[0]}-{other[1]}"] = (
                h(mode, f),
                h(*other),
                "torch.save",
            )
        out[f"hybrid-{mode}-0.5-to-same"] = (h(mode, 0.5), h(mode, 0.5), "torch.save")
        out[f"torch-to-hybrid-{mode}"] = (torch_, h(mode, FRACTIONS[i]), "torch.save")
        out[f"hybrid-{mode}-to-torch"] = (h(mode, 0.5), torch_, "torch.save")
        out[f"hybrid-{mode}-to-megatron"] = (h(mode, 1.0), meg(0.5), "torch.save")
        out[f"megatron-to-hybrid-{mode}"] = (meg(0.5), h(mode, 0.0), "torch.save")
        out[f"dcp-hybrid-{mode}-to-{modes[(i + 1) % 3]}"] = (h(mode, 0.5), h(modes[(i + 1) % 3], 1.0), "dcp")  # fmt: skip
    out["megatron-0.0-to-megatron-1.0"] = (meg(0.0), meg(1.0), "torch.save")
    out["torch-to-megatron"] = (torch_, meg(1.0), "torch.save")
    out["megatron-to-torch"] = (meg(0.5), torch_, "torch.save")
    out["dcp-torch-to-hybrid"] = (torch_, h("step", 0.5), "dcp")
    out["dcp-hybrid-to-torch"] = (h("delayed", 1.0), torch_, "dcp")
    return out


def _dcp_state(model: Probe, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def resume_phase(phase: str, folder: str) -> None:
    """One process's part of the resume matrix: "save" trains each configuration's saving
    run ``RESUME_STEPS[0]`` steps and saves model and optimizer (``torch.save``, or
    ``torch.distributed.checkpoint`` with a gloo process group of one); "load" builds each
    resuming run afresh, loads, trains ``RESUME_STEPS[1]`` steps and saves the final weights
    and ``state_dict()`` (``{name}-final.pt``)."""
    import torch.distributed as dist

    folder_path = os.path.abspath(folder)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{folder_path}/pg-{phase}",
                                rank=0, world_size=1)  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    before, after = RESUME_STEPS
    for name, (saving, resuming, how) in resume_configs().items():
        model = Probe(0)
        if phase == "save":
            opt = build(saving, model)
            for s in range(before):
                opt.zero_grad()
                model(s).backward()
                opt.step()
            getattr(opt, "synchronize", lambda: None)()
            if how == "dcp":
                dcp.save(_dcp_state(model, opt), checkpoint_id=f"{folder_path}/{name}")
            else:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           f"{folder_path}/{name}.pt")  # fmt: skip
        else:
            with torch.no_grad():  # a fresh init, overwritten by the checkpoint
                for p in model.parameters():
                    p.mul_(-1.0)
            opt = build(resuming, model)
            if how == "dcp":
                state = _dcp_state(model, opt)
                dcp.load(state, checkpoint_id=f"{folder_path}/{name}")
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])  # fmt: skip
            else:
                ckpt = torch.load(f"{folder_path}/{name}.pt", weights_only=True)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
            for s in range(before, before + after):
                opt.zero_grad()
                model(s).backward()
                opt.step()
            getattr(opt, "synchronize", lambda: None)()
            torch.save({"weights": [p.detach() for p in model.parameters()],
                        "state": opt.state_dict()["state"]}, f"{folder_path}/{name}-final.pt")  # fmt: skip
        getattr(opt, "close", lambda: None)()
    dist.destroy_process_group()


def resume_reference() -> tuple[list[torch.Tensor], dict]:
    """torch's AdamW over ``sum(RESUME_STEPS)`` steps without a stop: weights and state."""
    model = Probe(0)
    opt = torch.optim.AdamW(groups(list(model.parameters())), fused=True)
    for s in range(sum(RESUME_STEPS)):
        opt.zero_grad()
        model(s).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]


def resume_mismatches(folder: str) -> dict[str, str]:
    """Each resumed configuration whose final weights or state differ from the reference
    (bitwise), with what differs."""
    weights, state = resume_reference()
    bad = {}
    for name in resume_configs():
        got = torch.load(os.path.join(folder, f"{name}-final.pt"), weights_only=True)
        diff = [i for i, (a, b) in enumerate(zip(got["weights"], weights, strict=True))
                if not torch.equal(a, b)]  # fmt: skip
        diff += [f"{k}.{key}" for k, e in state.items() for key, t in e.items()
                 if not torch.equal(got["state"][k][key].reshape(t.shape).to(t.device), t)]  # fmt: skip
        if diff:
            bad[name] = f"differs at {diff}"
    return bad


# ---------------------------------------------------------------------------------- the run
def cases(rng: random.Random, round_: int = 0) -> dict:
    """One random instance of each case (name -> a zero-argument call); the long run's
    parameters, larger than CI's. ``endurance`` takes the modes in turn (``round_``)."""
    seed = rng.randrange(2**31)
    mode, fraction = rng.choice(list(ALL_MODES)), rng.choice(FRACTIONS)
    turn = list(ALL_MODES)[round_ % len(ALL_MODES)]
    return {
        "signal_step": lambda: signal_step(seed, mode, fraction, iters=16),
        "signal_record": lambda: signal_record(seed, mode, fraction),
        "signal_backward": lambda: signal_backward(seed, rng.choice([0.5, 1.0]), iters=12),
        "signal_load": lambda: signal_load(seed, mode, rng.choice([0.5, 1.0]), iters=12),
        "signal_fraction": lambda: signal_fraction(seed, mode, iters=12),
        "hook_error": lambda: hook_error(
            seed,
            rng.choice([0.5, 1.0]),
            rng.choice(["before", "after"]),
            rng.choice(["post", "tensor"]),
        ),  # fmt: skip
        "worker_error": lambda: worker_error(
            seed,
            mode,
            rng.choice([0.5, 1.0]),
            rng.randint(1, 3),
            rng.choice(["load", "discard"]),
        ),  # fmt: skip
        "endurance": lambda: endurance(seed, turn, steps=2000, every=100),
        "lifetimes": lambda: lifetimes(seed, 200),
    }


def main(argv: list[str] | None = None) -> int:
    names = list(cases(random.Random(0)))
    ap = argparse.ArgumentParser(
        prog="faults.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to loop (default: %(default)s)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="seed of the case draws (default: %(default)s)")  # fmt: skip
    ap.add_argument("--cases", default=",".join(names), help="comma-separated, of: " + ", ".join(names))  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training thread (default: %(default)s; the worker keeps its own; on a busy 2-core host 2 make the reference's kernel 50x slower)")  # fmt: skip
    args = ap.parse_args(argv)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in names]
    if unknown or not chosen or not args.minutes > 0:
        print(f"faults.py: error: unknown cases {unknown} or --minutes {args.minutes} <= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.threads < 1:
        print(f"faults.py: error: --threads {args.threads} < 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    run, failed, outcomes, first = Counter(), Counter(), {c: Counter() for c in chosen}, {}
    deadline = time.monotonic() + 60 * args.minutes
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        for name in chosen:
            if time.monotonic() >= deadline:
                break
            run[name] += 1
            try:
                outcomes[name][cases(rng, run[name] - 1)[name]()] += 1
            except Exception:  # noqa: BLE001 - counted and reported, the loop goes on
                failed[name] += 1
                first.setdefault(name, traceback.format_exc(limit=6))
    print(f"fault suites: {time.monotonic() - t0:.0f} s, torch {torch.__version__}, seed {args.seed}")  # fmt: skip
    print(f"{'case':18}{'run':>6}{'failed':>8}  outcomes")
    for name in chosen:
        top = ", ".join(f"{k} x{v}" for k, v in outcomes[name].most_common(4))
        print(f"{name:18}{run[name]:6d}{failed[name]:8d}  {top}")
    print(f"{'total':18}{sum(run.values()):6d}{sum(failed.values()):8d}")
    for name, tb in first.items():
        print(f"\nfirst failure of {name}:\n{tb}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
