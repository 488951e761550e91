#!/bin/bash
# interleaved A/B, AVX2, one thread, int8 modes
B=$1 A=$2 OUT=$3; shift 3
mkdir -p "$OUT"
cd /work/main
for round in 1 2 3 4; do
  for side in B A; do
    tree=$([ $side = B ] && echo "$B" || echo "$A")
    PYTHONPATH="$tree" OFFLOADOPT_KERNEL_DIR="$tree/.kernel" ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 \
      /work/venv/bin/python benchmarks/cpu_kernel.py --numel 2e7 --threads 1 --repeats 7 --triad-numel 2e7 --isa avx2 "$@" \
      > "$OUT/avx2_t1_${side}_r$round.txt" 2>&1
  done
done
