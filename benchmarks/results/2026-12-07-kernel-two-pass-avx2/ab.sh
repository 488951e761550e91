#!/usr/bin/env bash
# The kernel before and after, alternating process by process, each mode's calls paired with
# torch's fused AdamW call by call (benchmarks/cpu_kernel.py --paired): 3 rounds.
# Usage (repo root): bash benchmarks/results/2026-12-07-kernel-two-pass-avx2/ab.sh OLD_TREE ISA THREADS [ROUNDS]
#   OLD_TREE: a checkout of the commit before (git worktree add /tmp/oldtree <commit>)
#   ISA: avx2 | avx512 | generic (torch's row runs with the matching ATEN_CPU_CAPABILITY)
# Kernels build once into /tmp/k-ab-old and /tmp/k-ab-new (about 45 s each).
set -uo pipefail
old=$1; isa=$2; th=$3; rounds=${4:-3}
new=$PWD
cap=$isa; [[ $isa == generic ]] && cap=default
modes=("fp32m bf16 state" "fp32m int8 state" "bf16m bf16 state" "bf16m int8 state")
for r in $(seq "$rounds"); do
  for side in old new; do
    root=$new; [[ $side == old ]] && root=$old
    echo "== round $r $side ($(git -C "$root" rev-parse --short HEAD))"
    (cd "$root" && PYTHONPATH=$root OFFLOADOPT_KERNEL_DIR=/tmp/k-ab-$side ATEN_CPU_CAPABILITY=$cap \
      OMP_NUM_THREADS=$th python3 "$new/benchmarks/cpu_kernel.py" --numel 2e7 --isa "$isa" --repeats 21 \
      --paired --modes "${modes[@]}" 2>&1 | grep -v "^offloadopt: buil")
  done
done
