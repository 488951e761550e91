#!/bin/bash
# CPU quality check of the int8 format and the masters' shared draw: tiny GPT, 3 seeds, old kernel (369021f) vs new
cd /work/main
common="--device cpu --preset tiny --dtype bf16 --steps 400 --batch-size 8 --seq-len 128 --offload-fraction 1 --eval-batches 32 --seeds 3"
PYTHONPATH=/work/main OFFLOADOPT_KERNEL_DIR=/tmp/kdev2 /work/venv/bin/python benchmarks/quality.py --out /tmp/qcpu/new $common \
  --settings torch-adamw,int8-moments,bf16-sr+int8,bf16-sr --seeds-for torch-adamw,int8-moments,bf16-sr+int8,bf16-sr > /tmp/qcpu/new.log 2>&1
PYTHONPATH=/tmp/before OFFLOADOPT_KERNEL_DIR=/tmp/before/.kernel /work/venv/bin/python benchmarks/quality.py --out /tmp/qcpu/old $common \
  --settings torch-adamw,int8-moments,bf16-sr+int8,bf16-sr --seeds-for torch-adamw,int8-moments,bf16-sr+int8,bf16-sr > /tmp/qcpu/old.log 2>&1
echo done > /tmp/qcpu/DONE
