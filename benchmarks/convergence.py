"""The delayed parameter update against the synchronous one on the main job: three seeds each,
the held-out loss after the same number of steps. Writes convergence.json and prints a table.

    python benchmarks/convergence.py [--device cpu|cuda] [--steps 300] [--delay-after N] [--out DIR]

``--delay-after N``: the delayed runs take N synchronous steps first (HybridAdamW's
``delay_after``).

Exit status 1 when a delayed seed's final held-out loss lies outside [min, max] of the
synchronous seeds' (widened by nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from offloadopt.harness.train import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--offload-fraction", type=float, default=1.0)
    ap.add_argument("--delay-after", type=int, default=0)
    ap.add_argument("--out", default="convergence-out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for overlap in ("step", "delayed"):
        for seed in args.seeds:
            cfg = TrainConfig(device=args.device, preset=args.preset, steps=args.steps, seed=seed,
                              overlap=overlap, offload_fraction=args.offload_fraction,
                              delay_after=args.delay_after if overlap == "delayed" else 0,
                              eval_every=args.steps, log_every=args.steps, progress=False)  # fmt: skip
            s = train(cfg)
            runs.append({"overlap": overlap, "seed": seed, **s})
            (out / "convergence.json").write_text(json.dumps(runs, indent=1))
    by = {
        m: [r["final_heldout_loss"] for r in runs if r["overlap"] == m] for m in ("step", "delayed")
    }
    lo, hi = min(by["step"]), max(by["step"])
    inside = all(lo <= v <= hi for v in by["delayed"])
    print(f"\n{args.preset} on {args.device}, {args.steps} steps, fraction {args.offload_fraction}; "
          "final held-out loss (nats/byte)")  # fmt: skip
    print(f"{'overlap':8} " + " ".join(f"seed {s:<6}" for s in args.seeds) + "  mean     step ms")
    for m in ("step", "delayed"):
        ms = statistics.median(r["median_step_ms"] for r in runs if r["overlap"] == m)
        print(f"{m:8} " + " ".join(f"{v:<11.4f}" for v in by[m])
              + f"  {statistics.mean(by[m]):.4f}  {ms:8.1f}")  # fmt: skip
    print(f"delayed within the synchronous spread [{lo:.4f}, {hi:.4f}]: {inside}")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
