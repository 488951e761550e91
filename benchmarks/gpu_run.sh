#!/usr/bin/env bash
# One device call: CUDA tests, the audit fixture, the benchmark and the audits, results to $OUT.
# Usage on the GPU host (repo root, anchor wheels in .whl/): bash benchmarks/gpu_run.sh [tests|ctests|spec|spec3|spec4|streamed|prof8|kprobe|linktests|audit8|sweep8|ab8|delayed8|compressed|quality|launches|targets|timeline|amp|auditmodes|modes|modes2|bench|audit|ab|ab-backward|overlap|delayed|auto|largest|largest0|kernelab|steprows|buckets|updthread|steptl|spin|hold|conv|frameworks|endurance|fsdp|all]...
# "ab" times this tree's step against a baseline package in .baseline/offloadopt_base, made here with
#   git archive <commit> offloadopt | tar -x -C .baseline && mv .baseline/offloadopt .baseline/offloadopt_base
#   grep -rl offloadopt .baseline/offloadopt_base | xargs sed -i 's/\boffloadopt\b\([.a-z_]*\)/offloadopt_base\1/g'
# and carried (it is git-ignored through .git/info/exclude).
set -uo pipefail
OUT=${OUT:-/tmp/offloadopt-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::SyntaxWarning
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'threads', torch.get_num_threads())"
for part in "${@:-all}"; do
  if [[ $part == tests || $part == all ]]; then
    timeout 540 python3 -m pytest tests/cuda -m cuda -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
    python3 tests/cuda/record_fixture.py "$OUT/audit_trace_h200.json" 2>&1 | tail -3
  fi
  if [[ $part == ctests ]]; then
    # compressed optimizer state, correctness: the kernel's build, the CUDA tests of the
    # compressed modes and of the flat device path
    python3 -c "import time; from offloadopt import kernels; t = time.time(); kernels.load(); print(f'kernel build {time.time() - t:.1f} s')"
    timeout 150 python3 -m pytest tests/cuda/test_compressed_cuda.py tests/cuda/test_device_path_cuda.py \
      -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_compressed.log" | tail -6
  fi
  if [[ $part == linktests ]]; then
    # the transfer path after bf16 over the link: every CUDA test of the pipeline and the scaler
    timeout 300 python3 -m pytest tests/cuda/test_optim_cuda.py tests/cuda/test_amp_cuda.py \
      -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_link.log" | tail -6
  fi
  if [[ $part == streamed ]]; then
    # streamed checkpoints of the main job: a 6-step run saves at step 3 (bytes, seconds) and is
    # interrupted (SIGINT) once that save is in place; a fresh process resumes it from the disk
    # (page cache dropped where allowed) and runs steps 4-6. Host peak RSS of each process.
    # Default GPT-2 1.5B, int8 state, fraction 0.5; STREAMED_ARGS replaces the model and state
    # arguments (the disk is 64 GiB, and a save beside an older checkpoint needs both).
    ck=${STREAMED_DIR:-/tmp/ck-xl}; rm -rf "$ck"; df -h "$(dirname "$ck")" | tail -1
    T=""; [[ -x /usr/bin/time ]] && T="/usr/bin/time -f peak_RSS_%M_KB"
    margs=${STREAMED_ARGS:---preset gpt2-xl --state-dtype int8 --offload-fraction 0.5 --batch-size 4 --seq-len 1024}
    common="--device ${STREAMED_DEVICE:-cuda} --dtype bf16 $margs --steps 6 --eval-every 100 --eval-batches 1 --log-every 1 --no-progress"
    $T timeout 280 python3 -m offloadopt train $common --checkpoint-format streamed --save-every 3 --save "$ck" > "$OUT/streamed_save.log" 2>&1 &
    pid=$!
    for _ in $(seq 560); do
      grep -q "^saved:\|saved: " "$OUT/streamed_save.log" && { pkill -INT -f "offloadopt train" || true; break; }
      sleep 0.5
    done
    wait $pid; echo "save run exit $?" >> "$OUT/streamed_save.log"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" >> "$OUT/streamed_save.log"
    $T timeout 280 python3 -m offloadopt train $common --resume "$ck" > "$OUT/streamed_resume.log" 2>&1
    echo "resume run exit $?" >> "$OUT/streamed_resume.log"
    du -sb "$ck" >> "$OUT/streamed_resume.log"; echo "files: $(ls "$ck" | wc -l)" >> "$OUT/streamed_resume.log"
    cat "$OUT/streamed_save.log" "$OUT/streamed_resume.log" | grep -E "saved|loaded|resumed|step +[0-9]+/|RSS|exit|cache|/tmp|files|rror" | cut -c1-200
  fi
  if [[ $part == spec ]]; then
    # issue 31: speculative updates. CUDA tests (bitwise against the run without speculation),
    # then one sweep: unclipped, clipped (1.0), clipped + speculative at fractions 0.1-0.3 with a
    # max_grad_norm of 100 (above the norm: nothing clips, the speculation stands) and 1.0, and
    # one of 0.001 (every step clips: the redo's cost); each row prints the last norm
    timeout 150 python3 -m pytest tests/cuda/test_speculate_cuda.py \
      -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_spec.log" | grep -E "passed|failed|Error|scaler" | tail -8
    timeout 330 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 --out "$OUT/spec" \
      --only f0 "backward f0.1" "backward f0.2" "backward f0.3" "backward f0.2 clip" \
      "backward f0.1 clip spec maxnorm100" "backward f0.2 clip spec maxnorm100" \
      "backward f0.3 clip spec maxnorm100" "backward f0.2 clip spec" \
      "backward f0.2 clip spec maxnorm0.001" 2>&1 | tee "$OUT/spec.log" | tail -14
  fi
  if [[ $part == spec2 ]]; then
    # issue 31, after the backup became one copy per arena buffer: fraction 0.2 only
    timeout 240 python3 -m pytest tests/cuda/test_speculate_cuda.py -q -rs -p no:cacheprovider 2>&1 | tail -3
    timeout 120 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 --out "$OUT/spec2" \
      --only "backward f0.2" "backward f0.2 clip" "backward f0.2 clip spec maxnorm100" 2>&1 | tee "$OUT/spec2.log" | tail -5
  fi
  if [[ $part == spec3 ]]; then
    # issue 31, the backup written by the CPU kernel as it updates (2026-12-04): the kernel's
    # parity with torch's fused AdamW on this torch, the backup's cost in the kernel at
    # fraction 0.2's size (0.2 x 1.558e9 params), the CUDA tests of speculation
    timeout 150 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider -k "fp32_mode or backups" 2>&1 | tail -2 | tee "$OUT/pytest_kernels.log"
    timeout 100 python3 benchmarks/cpu_kernel.py --numel 3.1e8 --repeats 5 --backup --modes "ours fp32" 2>&1 | tee "$OUT/cpu_kernel.log"
    timeout 240 python3 -m pytest tests/cuda/test_speculate_cuda.py -q -rs -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest_spec.log"
  fi
  if [[ $part == spec4 ]]; then
    # issue 31's sweep with the kernel's backup; "copybk" is the copy before the update (before)
    timeout 560 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 --out "$OUT/spec4" \
      --only f0 "backward f0.1" "backward f0.2" "backward f0.1 clip" "backward f0.2 clip" \
      "backward f0.1 clip spec maxnorm100" "backward f0.2 clip spec maxnorm100" \
      "backward f0.3 clip spec maxnorm100" "backward f0.2 clip spec maxnorm100 copybk" \
      "backward f0.2 clip spec" 2>&1 | tee "$OUT/spec4.log" | tail -14
  fi
  if [[ $part == prof8 ]]; then
    # where fraction 0's step goes with int8 state against fp32 (the device-resident update)
    timeout 240 python3 benchmarks/profile_modes.py --configs "step:0" "step:0:state_dtype='int8'" \
      --warmup 3 --steps 2 --top 14 --out "$OUT/prof8" 2>&1 | tee "$OUT/prof8.log" | cut -c1-150 | tail -60
  fi
  if [[ $part == kprobe ]]; then
    # the CPU kernel's scaling with threads (2e8 params): compute- or bandwidth-bound per thread?
    lscpu | grep -E "Model name|Socket|Core|Thread|NUMA node|MHz|L2|L3" | tee "$OUT/lscpu.txt"
    for t in 1 2 4 8 16; do
      timeout 60 python3 benchmarks/cpu_kernel.py --numel 2e8 --threads $t --repeats 3 \
        --modes "fp32m int8 state" "bf16m int8 state" 2>&1 | tail -3 | tee -a "$OUT/kprobe.log"
    done
  fi
  if [[ $part == audit8 ]]; then
    # the audit with int8 moments (fp32 masters): link bytes per param and pageable copies
    timeout 200 python3 -m offloadopt audit --device cuda --preset gpt2-xl --batch-size 4 --seq-len 1024 \
      --offload-fraction 1 --overlap backward --state-dtype int8 --json "$OUT/audit8.json" 2>&1 | tee "$OUT/audit8.log" | tail -12
  fi
  if [[ $part == sweep8 ]]; then
    # issue 29's sweep: int8 moments against fp32 in one process, fraction 0 of each, backward
    # mode unclipped and clipped in the optimizer
    timeout 560 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 8 --out "$OUT/sweep8" \
      --only f0 "f0 int8" "backward f0.2" "backward f0.3" "backward f0.1 int8" "backward f0.2 int8" \
      "backward f0.3 int8" "backward f0.4 int8" "backward f0.5 int8" "backward f0.1 clip int8" \
      "backward f0.2 clip int8" "backward f0.3 clip int8" 2>&1 | tee "$OUT/sweep8.log" | tail -16
  fi
  if [[ $part == ab8 ]]; then
    # the step at fraction 1 (backward), fp32 against int8 (bf16 over the link) and bf16-sr + int8
    timeout 240 python3 benchmarks/ab_step.py --settings fp32 int8-moments bf16-sr+int8 --overlap backward \
      --fraction 1 --inits gpt2-init --warmup 3 --steps 6 --rounds 2 --out "$OUT/ab" 2>&1 | tee "$OUT/ab.log" | tail -8
  fi
  if [[ $part == delayed8 ]]; then
    # issue 29: the delayed update at batch 16 with int8 moments against torchao, one process
    timeout 420 python3 benchmarks/overlap_bench.py --batch-size 16 --no-memory --no-probe --out "$OUT/delayed8" \
      --only f0 "delayed f1" "delayed f1 int8" "delayed f1 sr8" torchao 2>&1 | tee "$OUT/delayed8.log" | tail -10
  fi
  if [[ $part == compressed ]]; then
    # compressed optimizer state, speed: the kernel against torch's fused fp32 AdamW over GPT-2
    # 1.5B's 1.558e9 params, the device path (device-resident params), and the step at
    # fraction 1 (backward)
    python3 -c "from offloadopt import kernels; kernels.load()"
    timeout 60 python3 benchmarks/device_path.py 2>&1 | tee "$OUT/device_path.log" | tail -8
    timeout 200 python3 benchmarks/cpu_kernel.py --repeats 5 2>&1 | tee "$OUT/cpu_kernel.log" | tail -12
    timeout 240 python3 benchmarks/ab_step.py --settings fp32 int8-moments bf16-sr+int8 --overlap backward \
      --fraction 1 --inits gpt2-init --warmup 3 --steps 6 --rounds 2 --out "$OUT/ab" 2>&1 | tee "$OUT/ab.log" | tail -8
  fi
  if [[ $part == quality ]]; then
    # the quality table: GPT-2 124M on the standard library's sources, 2,000 steps; fraction 0
    # (every update the flat torch-ops pass on the GPU: the representation and rounding of the
    # CPU kernel, tests/cuda/test_device_path_cuda.py) so that seven runs share the GPU. The
    # runs go to $QUALITY_DIR (in the tree: a later call carries the done runs and continues)
    # and come back as $OUT/quality.tgz (file names with "+" do not come back one by one).
    q=${QUALITY_DIR:-quality-h200}
    python3 -c "from offloadopt import kernels; kernels.load()"
    timeout "${QUALITY_TIMEOUT:-540}" python3 benchmarks/quality.py --out "$q" --parallel "${QUALITY_PARALLEL:-7}" --steps 2000 \
      --batch-size 8 --seq-len 256 --offload-fraction 0 \
      --settings int8-moments,bf16-sr+int8,fp32,torch-adamw,bf16-moments,bf16-sr 2>&1 | tail -16
    tar -czf "$OUT/quality.tgz" --exclude corpus.txt "$q"
  fi
  if [[ $part == launches ]]; then
    # the worker's copy launches: each piece on an idle process, then per iteration in the step
    timeout 120 python3 benchmarks/launch_probe.py --preset gpt2-large --rounds 3 --out "$OUT" 2>&1 | tail -17
    timeout 200 python3 benchmarks/profile_modes.py --configs step:1 backward:1 --launches --steps 2 \
      --out "$OUT/prof" 2>&1 | grep -A3 "offloadopt.launch\|^==" | tee "$OUT/launches.log" | head -30
  fi
  if [[ $part == bench || $part == all ]]; then
    timeout 540 python3 -m offloadopt bench --preset gpt2-xl --batch-size 4 --seq-len 1024 \
      --warmup 3 --steps 10 --slow-steps 2 --no-progress --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -16
  fi
  if [[ $part == ab ]]; then
    base=""; [[ -d .baseline/offloadopt_base ]] && base="--baseline-dir .baseline"
    timeout 480 python3 benchmarks/ab_step.py $base --warmup 2 --steps 6 --out "$OUT" 2>&1 | tee "$OUT/ab.log" | tail -20
  fi
  if [[ $part == ab-backward ]]; then
    # a library change against a baseline commit: backward mode at fractions 1 and 0.2, four
    # rounds in one process (one configuration moves by up to 16 % between rounds)
    base=""; [[ -d .baseline/offloadopt_base ]] && base="--baseline-dir .baseline"
    timeout 420 python3 benchmarks/ab_step.py $base --overlap backward --fraction 1 0.2 \
      --inits gpt2-init --warmup 3 --steps 8 --rounds 4 --out "$OUT/ab" 2>&1 | tee "$OUT/ab.log" | tail -16
  fi
  if [[ $part == overlap || $part == all ]]; then
    timeout 480 python3 benchmarks/overlap_bench.py --out "$OUT" 2>&1 | tee "$OUT/overlap.log" | tail -42
  fi
  if [[ $part == delayed || $part == all ]]; then
    timeout 420 python3 benchmarks/overlap_bench.py --batch-size 16 --no-memory --out "$OUT/delayed" \
      --only f0 "step f1" "delayed f1" "delayed f1 clip" "delayed f1 torch-clip" torchao 2>&1 | tee "$OUT/delayed.log" | tail -14
  fi
  if [[ $part == auto || $part == all ]]; then
    # issue 14: offload_fraction="auto" (alone, and with a budget) against the sweep, one run
    timeout 420 python3 benchmarks/overlap_bench.py --no-memory --no-probe --out "$OUT/auto" \
      --only f0 "backward f0.05" "backward f0.1" "backward f0.15" "backward f0.2" "backward f0.25" \
      "backward f0.3" "backward f1" "backward auto" "backward auto budget" \
      "backward f0.5 moved to f0.15" 2>&1 | tee "$OUT/auto.log" | tail -16
  fi
  if [[ $part == largest ]]; then
    # issue 14: the largest GPT with the automatic fraction (a budget) on one H200, 20 steps;
    # issue 30: LARGEST_PRESET=gpt-25b LARGEST_EXTRA="--state-dtype int8 --checkpoint-format streamed --save /tmp/ck"
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 560 python3 -m offloadopt train \
      --device cuda --preset "${LARGEST_PRESET:-gpt-17.5b}" --checkpointing --overlap backward \
      --release-grads --grad-clip 0 --offload-fraction auto --max-gpu-memory "${LARGEST_BUDGET:-140GB}" ${LARGEST_EXTRA:-} \
      --steps 20 --warmup-steps 10 --eval-every 10 --eval-batches 2 --log-every 1 --no-progress \
      2>&1 | tee "$OUT/largest.log" | grep -v '^{' | tail -26
  fi
  if [[ $part == kernelab ]]; then
    # issue 43: the CPU kernel before and after a change, side by side on one host, twice
    # interleaved; KERNEL_BASE holds the old package (several: space-separated), made here with
    #   mkdir -p .kbase && git archive <commit> offloadopt | tar -x -C .kbase   (and carried)
    # KERNEL_NUMEL (default 1.558e9) and KERNEL_MODES (one mode a line) replace the defaults
    modes=("fp32m int8 state" "bf16m int8 state")
    [[ -n ${KERNEL_MODES:-} ]] && mapfile -t modes <<< "$KERNEL_MODES"
    for r in 1 2; do for v in new ${KERNEL_BASE:-.kbase}; do
      if [[ $v == new ]]; then pp=$PWD; else pp=$PWD/$v; fi
      echo "== $v round $r" | tee -a "$OUT/kernelab.txt"
      PYTHONPATH=$pp OFFLOADOPT_KERNEL_DIR=/tmp/k-${v//[^a-z0-9]/} timeout 150 python3 benchmarks/cpu_kernel.py --repeats 3 \
        --numel "${KERNEL_NUMEL:-1.558e9}" --modes "${modes[@]}" 2>&1 | tee -a "$OUT/kernelab.txt" | tail -$((${#modes[@]} + 1))
    done; done
  fi
  if [[ $part == steprows ]]; then
    # issue 43's step rows, three processes, torchao first and last in each (its own step moves
    # 390-576 ms within one process: state the ratio against each); then batch 16, delayed
    for r in 1 2 3; do
      timeout 150 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 \
        --out "$OUT/steprows$r" --only torchao "backward f1 sr8" "backward f1 int8" torchao 2>&1 \
        | tee "$OUT/steprows$r.log" | grep " step "
    done
    timeout 200 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 --batch-size 16 \
      --out "$OUT/steprows16" --only f0 "delayed f1 sr8" torchao 2>&1 | tee "$OUT/steprows16.log" | grep -E " step |fwd"
  fi
  if [[ $part == buckets ]]; then
    # issue 43: the step at fraction 1 against the bucket size (the default 128 MiB took 5-17%
    # longer than 256 MiB with the kernel's fixed shares; with its chunks 256 gained nothing: 2026-12-07,
    # results/2026-12-07-kernel-dynamic-chunks-h100) and, with KERNEL_BASE set (a package carried as in
    # kernelab), the same rows on that package's kernel: torchao first and last
    # BUCKET_ROWS (one row per line) replaces the rows
    rows=(torchao "backward f1 sr8" "backward f1 sr8 bucket128" "backward f1 sr8 bucket256"
          "backward f1 sr8 bucket512" "backward f1 int8" "backward f1 int8 bucket256" torchao)
    [[ -n ${BUCKET_ROWS:-} ]] && mapfile -t rows <<< "$BUCKET_ROWS"
    for v in new ${KERNEL_BASE:+base}; do
      if [[ $v == base ]]; then pp=$PWD/$KERNEL_BASE; kd=/tmp/k-${KERNEL_BASE//[^a-z0-9]/}; else pp=$PWD; kd=/tmp/k-new; fi
      PYTHONPATH=$([[ -d /tmp/site ]] && echo /tmp/site:)$pp OFFLOADOPT_KERNEL_DIR=$kd timeout ${BUCKET_TIMEOUT:-240} python3 benchmarks/overlap_bench.py \
        --no-memory --no-probe --warmup 3 --steps 6 --out "$OUT/buckets-$v" --only "${rows[@]}" 2>&1 \
        | tee "$OUT/buckets-$v.log" | grep " step "
    done
  fi
  if [[ $part == updthread ]]; then
    # issue 43: the worker's update thread (each bucket's update runs there while the worker
    # launches the copies around it; "updthread", OFFLOADOPT_UPDATE_THREAD=link) against the
    # rows without it (the default), in one process each time, in both orders; torchao first
    # and last in each. Then the CUDA tests of the pipeline with the update thread on.
    for order in new old; do
      if [[ $order == new ]]; then
        rows=(torchao "backward f1 int8 updthread" "backward f1 int8" "backward f1 sr8 updthread" "backward f1 sr8" "backward f1 updthread" "backward f1" torchao)
      else
        rows=(torchao "backward f1 int8" "backward f1 int8 updthread" "backward f1 sr8" "backward f1 sr8 updthread" "backward f1" "backward f1 updthread" torchao)
      fi
      timeout ${UPD_TIMEOUT:-200} python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 --steps 6 \
        --out "$OUT/updthread-$order" --only "${rows[@]}" 2>&1 | tee "$OUT/updthread-$order.log" | grep " step "
    done
    OFFLOADOPT_UPDATE_THREAD=link timeout ${UPD_TESTS_TIMEOUT:-300} python3 -m pytest tests/cuda/test_optim_cuda.py \
      tests/cuda/test_amp_cuda.py tests/cuda/test_speculate_cuda.py -m cuda -q -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest_updthread.log" | tail -6
  fi
  if [[ $part == steptl ]]; then
    # issue 43: where the fraction-1 step of bf16-sr + int8 goes (batch 4, backward mode), at the
    # default buckets and at TL_BUCKETS MiB (small ones: are the grads and weights still in L3?)
    for mib in "" ${TL_BUCKETS:-16}; do
      timeout 150 python3 benchmarks/timeline.py --mode backward --batch-size 4 --steps 6 --state-dtype int8 \
        --master-weights bf16-sr ${mib:+--bucket-mib $mib} --out "$OUT/steptl${mib}" 2>&1 | tail -10
    done
  fi
  if [[ $part == spin ]]; then
    # issue 43: the kernel's fixed cost per call inside the step (1.2-2.5 ms a bucket on the
    # H100 host, 2026-12-07, results/2026-12-07-small-buckets-h100). Two suspects: the worker's
    # OpenMP threads sleep between buckets (the same rows with libgomp's threads left spinning,
    # OMP_WAIT_POLICY=ACTIVE, read when libgomp starts: a process each), or a thread of the
    # team is preempted holding a chunk by another runnable thread (the training thread or
    # a driver thread on CPUs 1-15) and the call waits for it (threads14: a CPU to spare).
    # torchao first and last in each process (SPIN_POLICIES: which, default both); then the
    # per-call probe (SPIN_PERCALL=0: not). At the default 128 MiB buckets neither changed a
    # row (2026-12-07, results/2026-12-07-two-pass-step-h100)
    for pol in ${SPIN_POLICIES:-passive active}; do
      OMP_WAIT_POLICY=${pol^^} timeout 280 python3 benchmarks/overlap_bench.py --no-memory --no-probe --warmup 3 \
        --steps 6 --out "$OUT/spin-$pol" --only torchao "backward f1 sr8" "backward f1 sr8 threads14" \
        "backward f1 int8" "backward f1 int8 threads14" torchao 2>&1 | tee "$OUT/spin-$pol.log" | grep " step "
    done
    [[ ${SPIN_PERCALL:-1} == 0 ]] || timeout 60 python3 benchmarks/results/2026-12-07-small-buckets-h100/percall.py 15 2>&1 \
      | tee "$OUT/percall.log" | tail -8
  fi
  if [[ $part == hold ]]; then
    # issue 46: speculation's held-back steps (FOLLOW_CLIP) against the clipped path, interleaved
    timeout 300 python3 benchmarks/overlap_bench.py --out "$OUT/hold" --warmup 3 --steps 6 --no-probe --no-memory \
      --only f0 "backward f0.1 clip" "backward f0.1 clip spec" "backward f0.2 clip" "backward f0.2 clip spec" \
      "backward f0.2 clip spec maxnorm100" "backward f0.2 clip" "backward f0.2 clip spec" 2>&1 | tee "$OUT/hold.log" | grep " step "
  fi
  if [[ $part == largest0 ]]; then
    # issue 14: the largest GPT at fraction 0 (every state on the GPU), for the table
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 -m offloadopt train \
      --device cuda --preset "${LARGEST0_PRESET:-gpt-9b}" --checkpointing --offload-fraction 0 \
      --steps 20 --warmup-steps 10 --eval-every 20 --eval-batches 2 --log-every 5 --no-progress \
      2>&1 | tee "$OUT/largest0.log" | tail -8
  fi
  if [[ $part == conv || $part == all ]]; then
    timeout 300 python3 benchmarks/convergence.py --device cuda --out "$OUT/conv" 2>&1 | tail -6
  fi
  if [[ $part == frameworks || $part == all ]]; then
    timeout 200 python3 examples/lightning_resume.py --device cuda 2>&1 | tail -1 | tee "$OUT/lightning_cuda.log"
    timeout 200 python3 examples/delayed_resume.py --device cuda 2>&1 | tail -1 | tee "$OUT/delayed_resume_cuda.log"
  fi
  if [[ $part == endurance || $part == all ]]; then
    timeout 300 python3 tests/long/endurance.py --device cuda --no-progress --out "$OUT/endurance" 2>&1 | tail -24
  fi
  if [[ $part == fsdp || $part == all ]]; then
    # FSDP2 of one rank: ours beside FSDP2's CPUOffloadPolicy, the same model and batch, one run.
    timeout 480 python3 -m offloadopt bench --preset gpt2-xl --batch-size 4 --seq-len 1024 \
      --warmup 2 --steps 6 --fractions 1 --no-kernel --no-progress --out "$OUT/fsdp" \
      --anchors fsdp2-cpuoffload hybrid-fsdp2:1 hybrid-fsdp2-backward:1 hybrid-fsdp2-delayed:1 hybrid-fsdp2:0.5 2>&1 | tee "$OUT/fsdp.log" | tail -14
    timeout 150 torchrun --standalone --nproc-per-node 1 -m offloadopt train --fsdp --device cuda \
      --preset gpt2 --steps 30 --eval-every 30 --log-every 10 --no-progress 2>&1 | tee "$OUT/train_fsdp.log" | tail -4
  fi
  if [[ $part == amp ]]; then
    # issue 8: the GradScaler on the GPU and the audit's backward view (new tests only)
    timeout 300 python3 -m pytest tests/cuda/test_amp_cuda.py \
      "tests/cuda/test_audit_cuda.py::test_the_audit_shows_backward_modes_d2h_beside_backward_kernels" \
      -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_amp.log" | tail -12
  fi
  if [[ $part == auditmodes ]]; then
    # issue 8 item 7: the audit's view of each overlap mode, GPT-2 1.5B, fraction 1
    for run in "step 1.0" "backward 1.0" "backward 0.2" "backward-clip 0.2"; do
      set -- $run
      timeout 200 python3 -m offloadopt audit --device cuda --preset gpt2-xl --batch-size 4 --seq-len 1024 \
        --offload-fraction $2 --overlap $1 2>&1 | tee -a "$OUT/auditmodes.log" | tail -6
    done
  fi
  if [[ $part == modes ]]; then
    # issue 8 item 7: bench --overlap, the issue's sweep, each mode against its own fraction 0
    timeout 560 python3 -m offloadopt bench --preset gpt2-xl --batch-size 4 --seq-len 1024 \
      --warmup 3 --steps 6 --no-kernel --no-audit --no-progress --anchors \
      --overlap step backward backward-clip backward-torch-clip \
      --fractions 0 0.05 0.1 0.15 0.2 0.25 0.3 --out "$OUT/modes" 2>&1 | tee "$OUT/modes.log" | tail -12
  fi
  if [[ $part == modes2 ]]; then
    # issue 8: the same sweep again with 10 timed steps, no torch-clip, to 0.25
    timeout 560 python3 -m offloadopt bench --preset gpt2-xl --batch-size 4 --seq-len 1024 \
      --warmup 3 --steps 10 --no-kernel --no-audit --no-progress --anchors \
      --overlap step backward backward-clip --fractions 0 0.05 0.1 0.15 0.2 0.25 \
      --out "$OUT/modes2" 2>&1 | tee "$OUT/modes2.log" | tail -8
  fi
  if [[ $part == targets ]]; then
    # issues 8 and 9 at one commit: the audit of each mode at fraction 1, then each target's rows
    for m in step backward delayed; do
      timeout 150 python3 -m offloadopt audit --device cuda --preset gpt2-xl --batch-size 4 --seq-len 1024 \
        --offload-fraction 1.0 --overlap $m 2>&1 | tee -a "$OUT/targets-audit.log" | grep "copies,"
    done
    timeout 250 python3 benchmarks/overlap_bench.py --steps 8 --no-memory --out "$OUT/targets4" \
      --only f0 "backward f0.1" "backward f0.15" "backward f0.2" "f0 clip" "backward f0.1 clip" \
      "backward f1" torchao 2>&1 | tee "$OUT/targets4.log" | tail -14
    timeout 170 python3 benchmarks/overlap_bench.py --batch-size 16 --steps 6 --no-memory \
      --out "$OUT/targets16" --only f0 "delayed f1" torchao 2>&1 | tee "$OUT/targets16.log" | tail -8
  fi
  if [[ $part == timeline ]]; then
    # one axis for the training thread, the worker and the GPU (delayed batch 16, backward batch 4)
    timeout 200 python3 benchmarks/timeline.py --mode delayed --batch-size 16 --out "$OUT" 2>&1 | tail -8
    timeout 150 python3 benchmarks/timeline.py --mode backward --batch-size 4 --steps 6 --out "$OUT" 2>&1 | tail -10
  fi
  if [[ $part == audit || $part == all ]]; then
    for opt in "hybrid" "hybrid --no-pin-memory" "megatron"; do
      timeout 200 python3 -m offloadopt audit --device cuda --preset gpt2-xl --batch-size 4 --seq-len 1024 \
        --offload-fraction 1.0 --optimizer $opt 2>&1 | tee -a "$OUT/audit.log" | tail -12 \
        || echo "AUDIT FAILED: --optimizer $opt (see audit.log)" | tee -a "$OUT/audit.log"
    done
  fi
done
