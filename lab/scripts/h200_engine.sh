#!/usr/bin/env bash
# The engine's GPU checks (CUDA-graph decode kept in flight, mixed iterations, capacity-bound batches, the
# cache kept between replays) in one call of at most 9 minutes on one H200:
#
#   bash lab/scripts/h200_engine.sh OUTDIR [stage ...]
#
# Stages (default: tests step azure baseline, in this order; each gets a timeout from what is left of
# LIMIT = 540 s, so the call ends in time and every stage that ran leaves its log and JSON in OUTDIR):
#   tests     the gpu-marked tests: graphs vs eager (logits, cache state), engine replays with graphs (the
#             second replay of one config captures nothing), the access update with a device clock, no
#             compilation inside a timed replay
#   step      benchmarks/decode_step.py: the graph step kept in flight (as the engine runs it) and the same
#             step waiting for its own tokens, wall vs device time, unquantized / INT8 / INT4 / INT8 +
#             sparse tier, Llama-3.1-8B shape 32 x 8K and SmolLM2 shape 64 x 2K (random weights, bf16)
#   azure     benchmarks/engine_replay.py, Llama-3.1-8B shape, Azure conv sample (AZURE_REQUESTS, seed 1),
#             saturation, each of AZURE_BUDGETS (4 GB, memory-bound, and the default budget): one unmeasured
#             replay, then REPEATS
#   baseline  the unquantized cache at the default budget, BASELINE_REQUESTS requests: the engine and the engine
#             as it was
#   mooncake  the Azure stage's replays on the Mooncake sample (prompts capped at 8K tokens), 8 GB and default
#   profile   where a saturation replay's device time goes (Azure, AZURE_REQUESTS, default budget, unquantized
#             and INT4, one profiled replay each after one repeat): OUTDIR/profile/<config>_default.txt
#   capacity  benchmarks/capacity_compare.py: capacity under the study's derived limits, Azure at 4 GB,
#             CAPACITY_REQUESTS requests, CAPACITY_REPEATS searches per config
# Sizes come from the environment: AZURE_REQUESTS (96), AZURE_BUDGETS ("4e9 default"), MOONCAKE_REQUESTS (24),
# REPEATS (3), MOONCAKE_REPEATS (REPEATS), BASELINE_REQUESTS (32), CLOCKS (the replays' clocks, "wall"; "wall,device"
# runs the repeats on each),
# CAPACITY_REQUESTS (64), CAPACITY_REPEATS (2), LIMIT (540).
set -u
OUT=${1:?usage: bash lab/scripts/h200_engine.sh OUTDIR [tests|step|azure|mooncake ...]}
shift
STAGES=${*:-tests step azure baseline}
mkdir -p "$OUT"
. lab/scripts/device_env.sh
T0=$(date +%s)
LIMIT=${LIMIT:-540}
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
AZURE_REQUESTS=${AZURE_REQUESTS:-96}
MOONCAKE_REQUESTS=${MOONCAKE_REQUESTS:-24}
REPEATS=${REPEATS:-3}
AZURE_BUDGETS=${AZURE_BUDGETS:-4e9 default}
CAPACITY_REQUESTS=${CAPACITY_REQUESTS:-64}
CAPACITY_REPEATS=${CAPACITY_REPEATS:-2}
BASELINE_REQUESTS=${BASELINE_REQUESTS:-32}
CLOCKS=${CLOCKS:-wall}

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
      --paths graph,graph_sync --json "$OUT/step_llama31_8b_32x8k.json" 2>&1 | grep -v USDT \
      | tee "$OUT/step_llama31_8b_32x8k.log" | tee -a "$OUT/summary.log"
    log "decode step: SmolLM2 shape, 64 x 2K"
    run 90 python3 benchmarks/decode_step.py --shape smollm2-135m --batch 64 --context 2048 \
      --paths graph,graph_sync --json "$OUT/step_smollm2_64x2k.json" 2>&1 | grep -v USDT \
      | tee "$OUT/step_smollm2_64x2k.log" | tee -a "$OUT/summary.log" ;;
  azure)
    for b in $AZURE_BUDGETS; do
      log "replays: Azure conv, $AZURE_REQUESTS requests, saturation, budget $b"
      run 240 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
        --workload examples/traces/azure_conv_sample.csv --requests "$AZURE_REQUESTS" --seed 1 --kv-budget "$b" \
        --repeats "$REPEATS" --clock "$CLOCKS" --json "$OUT/replay_azure_$b.json" $CONFIGS 2>&1 \
        | tee "$OUT/replay_azure_$b.log" | tee -a "$OUT/summary.log"
    done ;;
  baseline)
    log "replays: Azure conv, $BASELINE_REQUESTS requests, default budget, unquantized: the engine and the engine as it was"
    run 180 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload examples/traces/azure_conv_sample.csv --requests "$BASELINE_REQUESTS" --seed 1 --kv-budget default \
      --repeats 1 --baseline --clock "$CLOCKS" --json "$OUT/replay_azure_baseline.json" "$C/q_unquantized.json" 2>&1 \
      | tee "$OUT/replay_azure_baseline.log" | tee -a "$OUT/summary.log" ;;
  mooncake)
    log "replays: Mooncake, $MOONCAKE_REQUESTS requests capped at 8K tokens, saturation, 8 GB and default"
    run 200 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload examples/traces/mooncake_sample.jsonl --requests "$MOONCAKE_REQUESTS" --seed 0 --length-cap 8192 \
      --kv-budget 8e9 --kv-budget default --repeats "${MOONCAKE_REPEATS:-$REPEATS}" --clock "$CLOCKS" \
      --json "$OUT/replay_mooncake.json" $CONFIGS 2>&1 \
      | tee "$OUT/replay_mooncake.log" | tee -a "$OUT/summary.log" ;;
  profile)
    log "profile: Azure conv, $AZURE_REQUESTS requests, saturation, default budget"
    run 240 python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload examples/traces/azure_conv_sample.csv --requests "$AZURE_REQUESTS" --seed 1 --kv-budget default \
      --repeats 1 --profile "$OUT/profile" "$C/q_unquantized.json" "$C/q_int4.json" 2>&1 | grep -v USDT \
      | tee "$OUT/profile.log" | tee -a "$OUT/summary.log" ;;
  capacity)
    log "capacity: Azure conv, $CAPACITY_REQUESTS requests, 4 GB, $CAPACITY_REPEATS searches per config"
    run 300 python3 benchmarks/capacity_compare.py --model random:llama-3.1-8b \
      --workload examples/traces/azure_conv_sample.csv --requests "$CAPACITY_REQUESTS" --seed 1 --kv-budget 4e9 \
      --repeats "$CAPACITY_REPEATS" --json "$OUT/capacity_azure_4gb.json" $CONFIGS 2>&1 \
      | tee "$OUT/capacity_azure_4gb.log" | tee -a "$OUT/summary.log" ;;
  *) log "unknown stage $stage (tests, step, azure, baseline, mooncake, profile, capacity)" ;;
  esac
done
log "done"
