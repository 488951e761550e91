"""The fault suites' long-run and lifetime cases, which watch the process: host RSS, OS and
Python threads, open file descriptors (Linux ``/proc``).

- ``endurance``: N steps per mode with ``set_offload_fraction`` and a ``state_dict`` /
  ``load_state_dict`` cycle every few steps, bitwise against the reference, while host RSS,
  the process's threads and open file descriptors stay flat after warm-up (fds and Python
  threads exactly, OS threads within one, RSS within 32 MiB).
- ``lifetimes``: optimizers created, stepped once and dropped (some ``close()``d): threads,
  fds and RSS do not grow, and a weak reference to each dies after ``gc.collect()``.
"""

from __future__ import annotations

import copy
import gc
import os
import random
import threading
import time
import weakref

from fault_probe import FRACTIONS, MODES, Probe, Reference, check, hybrid, train

from offloadopt.harness.train_log import host_rss_nbytes

RSS_SLACK_NBYTES = 32 * 2**20  # host RSS growth allowed after warm-up


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
