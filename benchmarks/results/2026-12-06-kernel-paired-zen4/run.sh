#!/bin/bash
# The kernel before (B: the tree at bf17582) and after (A: 58f038c) the paired lane order, built side
# by side (each its own copy and OFFLOADOPT_KERNEL_DIR), run interleaved on one machine:
#   run.sh BEFORE_TREE AFTER_TREE OUTDIR
# BEFORE_TREE / AFTER_TREE: folders holding an offloadopt/ package (git archive <commit> offloadopt).
set -eu
B=$1 A=$2 OUT=$3
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")/../../.." && pwd)
for round in 1 2 3 4; do
  for isa in avx2 avx512; do
    for side in B A; do
      tree=$([ $side = B ] && echo "$B" || echo "$A")
      (cd "$here" && PYTHONPATH="$tree" OFFLOADOPT_KERNEL_DIR="$tree/.kernel" ATEN_CPU_CAPABILITY=$isa \
        OMP_NUM_THREADS=1 python benchmarks/cpu_kernel.py --numel 2e7 --threads 1 --repeats 7 \
        --triad-numel 2e7 --isa $isa) > "$OUT/${isa}_t1_${side}_r$round.txt" 2>&1
    done
  done
done
for round in 1 2; do
  for side in B A; do
    tree=$([ $side = B ] && echo "$B" || echo "$A")
    (cd "$here" && PYTHONPATH="$tree" OFFLOADOPT_KERNEL_DIR="$tree/.kernel" ATEN_CPU_CAPABILITY=avx2 \
      python benchmarks/cpu_kernel.py --numel 2e7 --threads 2 --repeats 7 --triad-numel 2e7 --isa avx2) \
      > "$OUT/avx2_t2_${side}_r$round.txt" 2>&1
  done
done
