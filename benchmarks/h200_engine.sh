#!/usr/bin/env bash
# The engine's GPU checks (CUDA-graph decode, mixed iterations, capacity-bound batches) in one call of at
# most 9 minutes on one H200:
#
#   bash benchmarks/h200_engine.sh OUTDIR [stage ...]
#
# Stages (default: all, in this order; each gets a timeout from what is left of 525 s, so the call ends in
# time and every stage that ran leaves its log and JSON in OUTDIR):
#   tests     the gpu-marked tests: graphs vs eager (logits, cache state), an engine replay with graphs, the
#             access update with a device clock, no compilation inside a timed replay
#   step      benchmarks/decode_step.py: eager vs graph step, wall vs GPU time and launches per step,
#             unquantized / INT8 / INT4 / INT8 + sparse tier, at the Llama-3.1-8B shape 32 x 8K and the
#             SmolLM2 shape 64 x 2K (random weights, bf16)
#   azure     benchmarks/engine_replay.py, Llama-3.1-8B shape: Azure conv sample, saturation (time scale 0),
#             the default budget and 4 GB, 3 repeats + once the engine as it was (--baseline)
#   mooncake  the same on the Mooncake sample (prompts capped at 8K tokens), 8 GB budget
# Sizes can be changed from the environment: AZURE_REQUESTS (32; sample seed 1: outputs up to 428 tokens),
# MOONCAKE_REQUESTS (12; seed 0), REPEATS (3). Rough budget on an H200: tests 100 s, decode steps 100 s, Azure
# 170 s, Mooncake 100 s; a stage cut by the call's limit keeps the replays it finished (JSON after each).
set -u
OUT=${1:?usage: bash benchmarks/h200_engine.sh OUTDIR [tests|step|azure|mooncake ...]}
shift
STAGES=${*:-tests step azure mooncake}
mkdir -p "$OUT"
. benchmarks/device_env.sh
T0=$(date +%s)
LIMIT=${LIMIT:-525}
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*" | tee -a "$OUT/summary.log"; }
# run LIMIT_S cmd...: the command under a timeout of at most LIMIT_S and what is left of the call
run() {
  local want=$1; shift
  local left=$(( LIMIT - ($(date +%s) - T0) ))
  (( left < want )) && want=$left
  if (( want < 15 )); then log "skipped, no time left: $*"; return 0; fi
  timeout "$want" "$@"
  local rc=$?
  (( rc == 124 )) && log "timed out after $want s: $*"
  return 0
}
C=examples/configs
CONFIGS="$C/q_unquantized.json $C/q_int8.json $C/q_int4.json"
AZURE_REQUESTS=${AZURE_REQUESTS:-32}
MOONCAKE_REQUESTS=${MOONCAKE_REQUESTS:-12}
REPEATS=${REPEATS:-3}

for stage in $STAGES; do
  case "$stage" in
  tests)
    log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
      | tee -a "$OUT/summary.log"
    log "tests: graphs vs eager, engine with graphs"
    run 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs.py 2>&1 \
      | tee "$OUT/tests_graphs.log" | tail -4 | tee -a "$OUT/summary.log"
    log "tests: device clock, no compilation inside a timed replay"
    run 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_step.py \
      -k "update_access or no_kernel_compiles" 2>&1 | tee "$OUT/tests_step.log" | tail -4 \
      | tee -a "$OUT/summary.log" ;;
  step)
    log "decode step: Llama-3.1-8B shape, 32 x 8K"
    run 150 python3 benchmarks/decode_step.py --shape llama-3.1-8b --batch 32 --context 8192 \
      --json "$OUT/step_llama31_8b_32x8k.json" 2>&1 | grep -v USDT | tee "$OUT/step_llama31_8b_32x8k.log" \
      | tee -a "$OUT/summary.log"
    log "decode step: SmolLM2 shape, 64 x 2K"
    run 90 python3 benchmarks/decode_step.py --shape smollm2-135m --batch 64 --context 2048 \
      --json "$OUT/step_smollm2_64x2k.json" 2>&1 | grep -v USDT | tee "$OUT/step_smollm2_64x2k.log" \
      | tee -a "$OUT/summary.log" ;;
  azure)
    log "replays: Azure conv, $AZURE_REQUESTS requests, saturation, default and 4 GB budgets"
    run 200 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload examples/traces/azure_conv_sample.csv --requests "$AZURE_REQUESTS" --seed 1 --kv-budget 4e9 \
      --kv-budget default --repeats "$REPEATS" --baseline --json "$OUT/replay_azure.json" $CONFIGS 2>&1 \
      | tee "$OUT/replay_azure.log" | tee -a "$OUT/summary.log" ;;
  mooncake)
    log "replays: Mooncake, $MOONCAKE_REQUESTS requests capped at 8K tokens, saturation, 8 GB budget"
    run 170 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload examples/traces/mooncake_sample.jsonl --requests "$MOONCAKE_REQUESTS" --seed 0 --length-cap 8192 \
      --kv-budget 8e9 --repeats "$REPEATS" --baseline --json "$OUT/replay_mooncake.json" $CONFIGS 2>&1 \
      | tee "$OUT/replay_mooncake.log" | tee -a "$OUT/summary.log" ;;
  *) log "unknown stage $stage (tests, step, azure, mooncake)" ;;
  esac
done
log "done"
