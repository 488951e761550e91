"""Instructions per element of the CPU kernel and of torch's fused AdamW, counted by callgrind.

A shared host moves a kernel's time by 30% from run to run; its instruction count does not
move at all (valgrind counts the instructions it executes, not seconds). For each mode of
``benchmarks/cpu_kernel.py`` this runs one process under ``valgrind --tool=callgrind`` that
steps ``--numel`` params (one tensor, one thread) once to warm up and twice more, then sums
the instructions in the kernel's own functions (offloadopt's ``isa_<isa>::...Kern<...>``,
torch's ``fused_adam``) and divides by the 3 x ``--numel`` elements stepped. Rows split the
kernel's functions (``span``: decode and update; ``encode``: the int8 codes).

valgrind runs AVX2 code but not AVX-512, so the default ISA is ``avx2`` for both kernels
(``ATEN_CPU_CAPABILITY=avx2`` for torch's). Each mode takes about a minute at 1e6 params.

    python benchmarks/kernel_icount.py                      # every mode and torch
    python benchmarks/kernel_icount.py --modes "bf16m int8 state" --numel 2e6
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ["ours fp32", "fp32m bf16 state", "fp32m int8 state", "bf16m bf16 state",
         "bf16m int8 state"]  # fmt: skip
CALLS = 3  # cpu_kernel's timed(): one warm-up call and --repeats 2


def child(mode: str, isa: str, numel: int) -> None:
    """Run inside valgrind: the kernel (or torch's) over ``numel`` params, CALLS times."""
    import torch

    sys.path.insert(0, str(HERE))
    import cpu_kernel

    from offloadopt import kernels

    torch.set_num_threads(1)
    if mode == "torch fused fp32":
        cpu_kernel.run_torch([numel], CALLS - 1)
        return
    mod = kernels.load()
    mod.set_isa(isa)
    cpu_kernel.run_ours(mod, [numel], cpu_kernel.MODES[mode], CALLS - 1)


def count(mode: str, isa: str, numel: int, workdir: str) -> dict[str, float]:
    """Instructions per element in each of the kernel's functions (name -> count)."""
    out = os.path.join(workdir, "callgrind." + re.sub(r"\W+", "_", mode))
    aten = "avx2" if isa == "avx2" else "default"  # torch's name for its plain build
    env = dict(os.environ, ATEN_CPU_CAPABILITY=aten, OMP_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
           __file__, "--child", mode, "--isa", isa, "--numel", str(numel)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"kernel_icount.py: {mode!r} failed under valgrind:\n{run.stderr[-2000:]}")
    text = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True).stdout
    # the kernel's own functions: Kern<...>'s and the int8 codes' (one process runs one mode)
    own = re.compile(
        r"fused_adam" if mode == "torch fused fp32" else rf"isa_{isa}::.*(Kern<|Int8Codes::)"
    )
    per: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*)$", line)
        if not m or not own.search(m.group(2)):
            continue
        fn = re.search(r"(?:>|Int8Codes)::(\w+)\(", m.group(2))
        name = fn.group(1) if fn else "fused_adam"
        per[name] = per.get(name, 0.0) + int(m.group(1).replace(",", "")) / (CALLS * numel)
    if not per:
        raise SystemExit(f"kernel_icount.py: no kernel function of {mode!r} in {out}")
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="*", default=None,
                    help=f"subset of {['torch fused fp32'] + MODES}")  # fmt: skip
    ap.add_argument("--numel", type=float, default=1e6, help="params (default 1e6)")
    ap.add_argument("--isa", default="avx2", choices=["avx2", "generic"],
                    help="the kernels' ISA (valgrind has no AVX-512; default avx2)")  # fmt: skip
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    numel = int(args.numel)
    if not 1024 <= numel <= 10**8:
        ap.error(f"--numel {args.numel:g}: must be in [1024, 1e8]")
    if args.child:
        child(args.child, args.isa, numel)
        return
    modes = args.modes or ["torch fused fp32"] + MODES
    for m in modes:
        if m not in ["torch fused fp32"] + MODES:
            ap.error(f"--modes {m!r}: not one of {['torch fused fp32'] + MODES}")
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} not found: install valgrind (Debian: apt install valgrind)")
    print(f"instructions per element, ISA {args.isa}, {numel:,} params, one thread, "
          f"{CALLS} calls counted", flush=True)  # fmt: skip
    print(f"{'mode':<20} {'total':>7}  by function")
    with tempfile.TemporaryDirectory() as tmp:
        for m in modes:
            per = count(m, args.isa, numel, tmp)
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            print(f"{m:<20} {sum(per.values()):>7.2f}  {parts}", flush=True)


if __name__ == "__main__":
    main()
