"""The long differential fuzz: HybridAdamW/HybridAdam/HybridSGD against torch's fused
AdamW/Adam/SGD on the CPU, bitwise (tests/fuzz.py has the generator, the reference and what is
compared). Prints progress, the counts run, refused and failed (known and new), and for each
failure a reproducer: the case (its seed and parameters) and the call that replays it.

    python tests/long/fuzz_loop.py --cases 2000 --seed 0
    python tests/long/fuzz_loop.py --replay 1234          # one seed, with its traceback
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: fuzz.py

import torch  # noqa: E402
from fuzz import draw, minimise, run_case  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200, help="how many cases (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (default 0)")
    ap.add_argument(
        "--no-known",
        action="store_true",
        help="leave out what triggers the known failures (issue 28, part 2)",
    )
    ap.add_argument(
        "--no-refusals", action="store_true", help="draw only combinations the constructor accepts"
    )
    ap.add_argument("--replay", type=int, default=None, help="run one seed, print its traceback")
    ap.add_argument("--every", type=int, default=50, help="progress line every N cases")
    ap.add_argument(
        "--minimise",
        action="store_true",
        help="with --replay: shrink the failing case, field by field, to a small one "
        "that fails the same way (same exception type or mismatch kind)",
    )
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error(f"--cases must be >= 1 (got {args.cases})")
    torch.set_num_threads(1)
    seeds = [args.replay] if args.replay is not None else range(args.seed, args.seed + args.cases)
    counts: collections.Counter = collections.Counter()
    failures = []
    t0 = time.monotonic()
    for n, seed in enumerate(seeds, 1):
        out = run_case(draw(seed, known=not args.no_known, refusals=not args.no_refusals))
        counts[out.status] += 1
        counts["offloaded"] += out.offloaded > 0
        if out.status == "failed":
            counts["known" if out.known else "new"] += 1
            failures.append(out)
            tag = f"known: {out.known}" if out.known else "NEW"
            print(f"FAIL seed={seed} ({tag}): {out.message[:300]}", flush=True)
            if args.replay is not None:
                print(out.trace)
                if args.minimise:
                    kind = out.message.split(":")[0]
                    small = minimise(
                        out.case,
                        lambda o, kind=kind: o.status == "failed" and o.message.startswith(kind),
                    )
                    print(f"minimised: run_case({small!r})\n{run_case(small).message}")
        if n % args.every == 0 or n == len(seeds):
            print(f"[{n}/{len(seeds)}] {time.monotonic() - t0:.0f} s: "
                  f"passed {counts['passed']}, refused {counts['refused']}, "
                  f"failed {counts['failed']} (new {counts['new']}, known {counts['known']})",
                  flush=True)  # fmt: skip
    print(f"run {len(seeds)}, passed {counts['passed']}, refused {counts['refused']}, "
          f"failed {counts['failed']} (new {counts['new']}, known {counts['known']}); "
          f"{counts['offloaded']} ran with params offloaded; {time.monotonic() - t0:.0f} s")  # fmt: skip
    flags = " --no-known" * args.no_known + " --no-refusals" * args.no_refusals
    for out in failures:
        print(f"\nseed {out.case.seed}{' (known: ' + out.known + ')' if out.known else ''}: "
              f"{out.message[:500]}\n  reproduce: python tests/long/fuzz_loop.py --replay "
              f"{out.case.seed}{flags} (--minimise for a smaller case)\n"
              f"  or, in tests/: from fuzz import *; run_case({out.case!r})")  # fmt: skip
    return 1 if counts["new"] else 0


if __name__ == "__main__":
    sys.exit(main())
