"""The fault suites' signal cases: a SIGALRM timer (``signal.setitimer``, a random delay up
to a little more than the call takes) whose handler raises, around ``step()``,
``loss.backward()`` with the optimizer's grad hooks (``overlap="backward"``),
``load_state_dict()`` and ``set_offload_fraction()``. Afterwards the call either completed or
left everything as it was (a retry then completes it), or, for an interrupted backward whose
updates began, the optimizer refuses ``step()`` until ``load_state_dict()`` or
``discard_failed_step()``; never a half step taken silently. Weights and state are compared
bitwise with the reference at every iteration. ``signal_record``: the same timer with a
handler that only records: it runs exactly once.

Each case is a function of a seed that raises ``AssertionError`` (or any exception) when the
optimizer misbehaves, and returns a short outcome word otherwise.
"""

from __future__ import annotations

import copy
import random
import signal
import statistics
import time
from collections import Counter

import torch
from fault_probe import (
    FRACTIONS,
    Probe,
    Reference,
    alarm_handler,
    check,
    grads_of,
    hybrid,
    interrupted,
    recover,
    same,
    same_state,
    timed,
    train,
)


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
                outcomes[recover(model, opt, ref, before, rng.choice(["load", "discard"]))] += 1
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
