#!/usr/bin/env bash
# One device call: CUDA tests, the audit fixture, the benchmark and the audits, results to $OUT.
# Usage on the GPU host (repo root, wheels in .whl/): bash benchmarks/gpu_run.sh [quick|full]
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/offloadopt-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'threads', torch.get_num_threads())"
git rev-parse --short HEAD 2>/dev/null || true
if [[ $MODE != bench ]]; then
  timeout 300 python3 -m pytest tests/cuda -m cuda -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
  python3 tests/cuda/record_fixture.py "$OUT/audit_trace_h200.json" 2>&1 | tail -3
fi
if [[ $MODE == quick ]]; then exit 0; fi
timeout 420 python3 -m offloadopt bench --preset gpt2-xl --batch-size 4 --seq-len 1024 \
  --warmup 3 --steps 10 --slow-steps 2 --no-progress --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -25
