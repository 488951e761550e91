#!/bin/bash
# Interleaved rounds over several trees (each a folder holding an offloadopt package and its
# kernel build in .kernel), AVX2, one thread:
#   run_rounds.sh OUT tree1 tree2 ... -- cpu_kernel.py args (e.g. --modes "fp32m int8 state")
OUT=$1; shift; trees=(); while [ "$1" != "--" ]; do trees+=("$1"); shift; done; shift
mkdir -p "$OUT"; cd /work/main
for round in 1 2 3 4; do for t in "${trees[@]}"; do
  PYTHONPATH="$t" OFFLOADOPT_KERNEL_DIR="$t/.kernel" ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 \
    /work/venv/bin/python benchmarks/cpu_kernel.py --numel 2e7 --threads 1 --repeats 7 --triad-numel 2e7 --isa avx2 "$@" \
    > "$OUT/$(basename "$t")_r$round.txt" 2>&1
done; done
