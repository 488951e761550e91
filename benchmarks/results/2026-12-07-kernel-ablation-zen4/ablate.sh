. /work/venv/bin/activate
cd /work/main
for v in nostream noenc nodec nodiv; do OFFLOADOPT_KERNEL_DIR=/tmp/kvd-$v PYTHONPATH=/tmp/kv-$v python -c "from offloadopt import kernels; kernels.load()"; done
for r in 1 2 3; do for v in base nostream noenc nodec nodiv; do
  if [[ $v == base ]]; then pp=/work/main; kd=/tmp/k1; else pp=/tmp/kv-$v; kd=/tmp/kvd-$v; fi
  echo "== $v $r"
  OFFLOADOPT_KERNEL_DIR=$kd OMP_NUM_THREADS=1 PYTHONPATH=$pp python $pp/benchmarks/cpu_kernel.py --numel 2e7 --threads 1 --repeats 5 --isa ${ISA:-avx2} --triad-numel 33554432 --modes "fp32m int8 state" "bf16m int8 state" 2>&1 | tail -3
done; done
