#!/usr/bin/env bash
# One GPU call's work, by step: tests | step | step-smol | sweep | pool-read | replays-llama | replays-smol |
# quality | study-llama | study-smol (several steps in order).
# Run from the checkout on the GPU machine after `. lab/scripts/device_env.sh`; logs and results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TRACE=examples/traces/mooncake_sample.jsonl
C=examples/configs
log() { echo "== $(date +%T) $*"; }
step_smol() {  # the SmolLM2-shape decode step at 32 x 2K, four configs; extra decode_step.py options
  timeout 150 python3 benchmarks/decode_step.py --model random:smollm2-135m --batch 32 --length 2048 \
    --json "$OUT/step_smollm2.json" "$@" $C/q_unquantized.json $C/q_int8.json $C/q_int4.json \
    $C/q_int8_sparse512_fast.json 2>&1 | grep -v USDT | tee "$OUT/step_smollm2.log" | tail -14
}

for step in "$@"; do
  case "$step" in
  tests)
    log "GPU tests"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
    # one process per file: a kernel that faults poisons its process's CUDA context for every later test
    for f in tests/test_triton_kernels.py tests/test_triton_step.py; do
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider "$f" 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -3
    done ;;
  step-smol)
    log "decode step, SmolLM2 shape only"
    step_smol ;;
  sweep)
    log "decode attention: variant sweep, then the table of all five shapes"
    timeout 540 python3 benchmarks/decode_attention.py --sweep --out "$OUT/decode_attention" 2>&1 \
      | tee "$OUT/decode_attention.log" | tail -30 ;;
  pool-read)
    log "decode attention: the pool's read ceiling, the attention; ring depths"
    timeout 260 python3 benchmarks/pool_read.py --out "$OUT/pool_read" 2>&1 | tee "$OUT/pool_read.log" | tail -7
    timeout 120 python3 benchmarks/pool_read.py --rings --out "$OUT/pool_read" 2>&1 | tee "$OUT/rings.log" \
      | tail -15 ;;
  step)
    log "decode step: Triton per-token kernels vs PyTorch (attention Triton in both)"
    step_smol --host-profile "$OUT/host_profile"
    timeout 150 python3 benchmarks/decode_step.py --model random:llama-3-8b --batch 16 --length 2048 \
      --json "$OUT/step_llama3_8b.json" $C/q_unquantized.json $C/q_int8.json $C/q_int4.json 2>&1 \
      | grep -v USDT | tee "$OUT/step_llama3_8b.log" | tail -10 ;;
  replays-llama)
    log "replay llama-3-8b shape (random weights, bf16), lengths x0.25"
    timeout 240 python3 benchmarks/replay_compare.py --model random:llama-3-8b --workload $TRACE --requests 48 \
      --budget-gb 40 --length-scale 0.25 --json "$OUT/replay_llama3_8b.json" \
      $C/q_unquantized.json $C/q_int8.json $C/q_int4.json 2>&1 | tee "$OUT/replay_llama3_8b.log" | tail -5 ;;
  replays-smol)
    log "replay SmolLM2-135M real weights (bf16), lengths x0.5"
    timeout 240 python3 benchmarks/replay_compare.py --model smollm2 --workload $TRACE --requests 128 \
      --budget-gb 40 --length-scale 0.5 --json "$OUT/replay_smollm2.json" \
      $C/q_unquantized.json $C/q_int8.json $C/q_int4.json $C/q_int8_sparse512.json 2>&1 \
      | tee "$OUT/replay_smollm2.log" | tail -6 ;;
  quality)
    log "quality: SmolLM2-135M real weights, 8 x (2048 + 512), passkey"
    for c in q_unquantized q_int8 q_int4 q_int4_hot16 q_int8_sparse512; do
      timeout 150 python3 -m kvtune quality --config $C/$c.json --json "$OUT/quality_$c.json" 2>&1 \
        | tail -16 | tee "$OUT/quality_$c.log"
    done ;;
  study-llama|study-smol)
    # MINUTES: time budget (then the best so far is validated); TRIALS (20); RESUME=1 continues the study
    # kept in lab/studies/; NAME: database and study name; one worker per GPU in CUDA_VISIBLE_DEVICES;
    # EXPORT=0: no validation or preset; TIME_SCALE: a fixed time scale (studies to compare);
    # KILL_AFTER: seconds after which one worker process is killed; REQUESTS, LENGTH_SCALE, QWINDOWS,
    # QPREFILL, QDECODE: the window and the quality measurement (defaults below).
    if [ "$step" = study-llama ]; then
      model=random:llama-3-8b name=${NAME:-h200_llama3_8b}
      extra="--requests ${REQUESTS:-24} --length-scale ${LENGTH_SCALE:-0.25}"
    else
      model=smollm2 name=${NAME:-h200_smollm2}
      extra="--requests ${REQUESTS:-32} --length-scale ${LENGTH_SCALE:-0.5}"
    fi
    [ "${EXPORT:-1}" = 0 ] && extra="$extra --no-export"
    [ -n "${TIME_SCALE:-}" ] && extra="$extra --time-scale $TIME_SCALE"  # the same pacing for studies compared
    log "study $name: $model (quality on SmolLM2), ${MINUTES:-6} min, GPUs ${CUDA_VISIBLE_DEVICES:-all}"
    [ -n "${RESUME:-}" ] && cp "lab/studies/$name.db" "$OUT/$name.db"
    if [ -n "${KILL_AFTER:-}" ]; then
      ( sleep "$KILL_AFTER"; pid=$(pgrep -f 'ray::TrialWorker' | head -1)
        log "killing worker process $pid"; [ -n "$pid" ] && kill -9 "$pid" ) >> "$OUT/$name.log" 2>&1 &
    fi
    ( start=$SECONDS
      timeout $(( ${MINUTES:-6} * 60 + 240 )) python3 -m kvtune --gpu h200 \
      --workload $TRACE --model $model --trials ${TRIALS:-20} $extra --windows 1 --kv-budget 40GB \
      --time-budget ${MINUTES:-6} --quality-windows ${QWINDOWS:-4} --quality-prefill ${QPREFILL:-1024} \
      --quality-decode ${QDECODE:-128} --no-passkey \
      ${RESUME:+--resume} --study "$name" --storage "sqlite:///$OUT/$name.db" --out "$OUT/preset_$name.json"
      log "study $name: exit $?, wall $(( SECONDS - start )) s" ) 2>&1 | tee -a "$OUT/$name.log" | tail -30 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
