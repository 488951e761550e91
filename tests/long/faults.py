"""Fault suites of HybridAdamW on the CPU, in a loop over seeds for ``--minutes``: interrupts,
failures and lifetimes; prints the counts run and failed per case.

Each case is a function of a seed that raises ``AssertionError`` (or any exception) when the
optimizer misbehaves, and returns a short outcome word otherwise; tests/test_faults.py runs a
fast slice of them in CI. Here they draw larger parameters, and ``wait="module"`` too. The
modules beside this one hold them, by intent:

- fault_probe.py: the model (``Probe``: grads that do not depend on the weights, so every mode
  trains to torch's ``AdamW(fused=True)`` bitwise), the reference, the comparisons, the alarm.
- fault_signals.py: ``signal_step``, ``signal_backward``, ``signal_load``,
  ``signal_fraction`` (a SIGALRM whose handler raises, at a random point of the call: it
  completes whole, leaves everything as it was, or is refused until recovered; never a half
  step taken silently) and ``signal_record`` (a handler that records runs exactly once).
- fault_failures.py: ``hook_error`` (a user's grad hook raises during backward) and
  ``worker_error`` (the worker's update fails on the Nth bucket: ``WorkerError`` naming it,
  then a load or a discard, and training goes on).
- fault_lifetimes.py: ``endurance`` (steps with re-placement and checkpoint cycles while
  RSS, threads and fds stay flat) and ``lifetimes`` (optimizers dropped are collected).
- fault_resumes.py: tests/test_resume_matrix.py's fresh-process resumes (torch.save and
  torch.distributed.checkpoint, across modes, fractions and classes); they run there, in two
  processes, not in this loop.

Usage: python tests/long/faults.py --minutes 10 [--cases signal_step,worker_error]
Prints one line per case (``run``, ``failed``, outcomes) and the first failures; exit status
1 if any case failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter

import torch
from fault_failures import hook_error, worker_error
from fault_lifetimes import endurance, lifetimes
from fault_probe import ALL_MODES, FRACTIONS
from fault_signals import (
    signal_backward,
    signal_fraction,
    signal_load,
    signal_record,
    signal_step,
)


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
