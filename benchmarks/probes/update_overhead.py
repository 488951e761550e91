"""How long the CPU worker spends in a bucket's update outside the kernel (its Python: the
argument lists, views and step values), per step: ``opt.stats["cpu_update_ms"]`` less
``opt.stats["cpu_kernel_ms"]``, the medians over --steps steps after --warmup. During that
time the kernel's threads wait, so it adds to a step at fraction 1 where the CPU update bounds
it. Runs on the CPU (no GPU needed): --tensors params of --numel bf16 elements each, offload
fraction 1, one row per setting (the fp32 row, torch's own kernel, is the whole update: that kernel is not
timed apart). GPT-2 1.5B has about 580 tensors.

Usage: python benchmarks/probes/update_overhead.py [--tensors 600] [--numel 4096]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import offloadopt

SETTINGS = {
    "bf16-sr + int8": dict(state_dtype="int8", master_weights="bf16-sr"),
    "int8 (fp32 masters)": dict(state_dtype="int8"),
    "bf16 moments (fp32 masters)": dict(state_dtype="bf16"),
    "fp32, whole update": dict(),  # torch's kernel: not timed apart (cpu_kernel_ms is 0)
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=600, help="params (default 600)")
    ap.add_argument("--numel", type=int, default=4096, help="elements per param (default 4096)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    args = ap.parse_args()
    if min(args.tensors, args.numel, args.steps) < 1 or args.warmup < 0:
        ap.error("--tensors, --numel and --steps must be >= 1, --warmup >= 0")
    print(f"{args.tensors} params of {args.numel} bf16 elements, offload fraction 1, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'setting':<30} {'outside the kernel ms':>22} {'kernel ms':>10}")
    for name, kwargs in SETTINGS.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(args.numel, dtype=torch.bfloat16))
                  for _ in range(args.tensors)]  # fmt: skip
        opt = offloadopt.HybridAdamW(params, lr=1e-3, offload_fraction=1.0, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        outside, kernel = [], []
        for s in range(args.warmup + args.steps):
            opt.step()
            opt.synchronize()
            if s >= args.warmup:
                st = opt.stats
                outside.append(st["cpu_update_ms"] - st["cpu_kernel_ms"])
                kernel.append(st["cpu_kernel_ms"])
        print(f"{name:<30} {statistics.median(outside):>22.2f} {statistics.median(kernel):>10.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
