#!/bin/bash
cd /tmp/beforefull
common="--device cpu --preset tiny --dtype bf16 --steps 400 --batch-size 8 --seq-len 128 --offload-fraction 1 --eval-batches 32 --seeds 3"
OFFLOADOPT_KERNEL_DIR=/tmp/beforefull/.kernel /work/venv/bin/python benchmarks/quality.py --out /tmp/qcpu/old $common \
  --settings int8-moments,bf16-sr+int8,bf16-sr --seeds-for int8-moments,bf16-sr+int8,bf16-sr > /tmp/qcpu/old.log 2>&1
echo done > /tmp/qcpu/DONE_OLD
