"""The fault suites' failure cases: a user's grad hook that raises during backward
(``hook_error``, ``overlap="backward"``), and the worker's update failing on the Nth bucket in
every mode (``worker_error``): ``step()`` (or, delayed, the next ``step()``) raises
``WorkerError`` naming the bucket within ``timeout_s``; after ``load_state_dict()`` of the
last checkpoint training goes on bitwise, after ``discard_failed_step()`` it goes on from the
half-applied step.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time

import torch
from fault_probe import Probe, Reference, check, hybrid, recover, train

from offloadopt.link.worker import WorkerError


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
    outcome = recover(model, opt, ref, before, rng.choice(["load", "discard"]))
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
