#!/usr/bin/env bash
# One GPU call, in stages, each under its own time limit, logs under $OUT:
#   bash lab/scripts/gpu_call.sh STAGE...   (stages: env tests kernels ring ringtests launches engine noise grid mixed precision sparsekernels quest pieces host plugin busy bound step sparse collapse forward launch hostab warm whole wholeengine leaks)
# kernels: the decode-attention table, graph replays (KERNELS_S); launches: the same as launches (LAUNCHES_S)
# ring: the cold ring's A/Bs in one process each: tensor copies (tma_ring.py: the ring alone and the attention
#   on it; TMA_S), the busy blocks of the one-launch builds (merge_tile.py --busy; MT_S), the selection's L1
#   step ahead (select_warps.py; SW_S), the sparse INT8 step's builds on tensor copies and launched beside
#   the selection's merge (sparse_kernels.py; SKT_S)
# ringtests: GPU tests of the tensor-copy builds and of the warm-up's selection builds (RINGTESTS_S)
# noise: ROUTES (p90,attainment,confirm,pooled3,all,draws8,draws12), NOISE_REPEATS, NOISE_ONLY (windows, e.g. 0,1), NOISE_TAG
# sparse: SPARSE_SHAPES (batch:context ...), SPARSE_HOLD=1 (tiers held as set up: decode_step.py --hold-tiers), SPARSE_S
# pieces: PIECES_TESTS_S, PIECES_S (each replay), PIECES_BUDGET (4e9), PIECES_REPEATS (3)
# host: HOST_N (20 iterations), HOST_S (each run); the host's launch time of a mixed iteration, op by op and in pieces
# forward: FORWARD_LENGTHS, FORWARD_S; launch: LAUNCH_S; hostab: HOSTAB_S, ROUNDS (needs .old/, a git archive)
# warm: WARM_CONFIGS (bits:block, default 4:32,8:64,0:32,4:256), WARM_S; kernels compiled ahead, then the prime
# whole: WHOLE_TESTS_S, HOST_N, HOST_S: mixed iterations as one graph against pieces (tests, host time);
# wholeengine: WHOLE_S, WHOLE_BUDGET, WHOLE_MODES (comma-separated flags, op: none), WHOLE_CONFIGS (config
#   files; default unquantized and INT8), WHOLE_REQUESTS (96), WHOLE_REPEATS (3): saturation replays op by
#   op, in pieces and as whole graphs
# leaks: LEAKS_RUNS (8), LEAKS_S (seconds for the loop, 240): the gated-clock, mixed-graph and pinned-pool GPU
#   tests in a loop, with LEAKS_AB (an option's variable, e.g. KVTUNE_GC_PAUSE) set to 0 on even runs; their
#   leaked gates' records in leaks.log; then gate_syncs.py (GATE_SYNCS_S, 120): the calls inside each gate
# engine compares today's tree with the engine of 70b9c8a, carried in .old/ (git archive of that commit).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then  # once per machine (device_env.sh's flag too)
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && touch /tmp/site/.installed
fi
[ -f /tmp/site/.installed ] && export PYTHONPATH=$PWD:/tmp/site  # a later call on a warm machine, no .whl
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*" | tee -a "$OUT/summary.log"; }
C=examples/configs; CFG="$C/q_unquantized.json $C/q_int8.json $C/q_int4.json"
AZ=examples/traces/azure_conv_sample.csv
for stage in "$@"; do
  case "$stage" in
  env)
    log "$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader)"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.log"
    git log --oneline -1 2>/dev/null | tee -a "$OUT/summary.log" ;;
  tests)
    log "gpu tests"
    timeout ${TESTS_S:-170} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_graphs.py tests/test_triton_kernels.py \
      tests/test_triton_step.py tests/test_cache_attention.py tests/test_triton_compile.py 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  kernels)
    log "decode attention"
    timeout ${KERNELS_S:-150} python3 benchmarks/decode_attention.py --quick --graphs --out "$OUT/attn" > "$OUT/attn.log" 2>&1
    tail -40 "$OUT/attn.log" ;;
  ring)
    log "the cold ring on tensor copies: the ring alone and the attention on it, beside the shipped kernel and SDPA"
    timeout ${TMA_S:-110} python3 lab/scripts/tma_ring.py --out "$OUT/tma" > "$OUT/tma.log" 2>&1; tail -8 "$OUT/tma.log"
    log "the one-launch builds' busy blocks (attention alone over a fixed table)"
    timeout ${MT_S:-80} python3 lab/scripts/merge_tile.py --busy 24:4,32:4,32:8,32:8:2 --out "$OUT/mt" > "$OUT/mt.log" 2>&1
    tail -12 "$OUT/mt.log"
    log "the selection with its split by bits, the merge's first L1 step ahead or not"
    timeout ${SW_S:-60} python3 lab/scripts/select_warps.py --tokens 2048 --variants s0:16:0,s0:16:0p,s0:16:0pa \
      --rounds 2 --out "$OUT/sw" > "$OUT/sw.log" 2>&1; tail -6 "$OUT/sw.log"
    log "the sparse INT8 step: its builds on cp.async or tensor copies, after the selection or beside its merge (e4m3)"
    KVTUNE_QUEST_SUMMARY=1 timeout ${SKT_S:-120} python3 lab/scripts/sparse_kernels.py --summary --bits 8 \
      --ways default,default+tma,default+tma2,default+after,default+tma+after --rounds 2 --steps 10 \
      --out "$OUT/skt" > "$OUT/skt.log" 2>&1
    grep -E "^[0-9]+x" "$OUT/skt.log" | tail -20 ;;
  ringtests)
    log "gpu tests: the tensor-copy builds, the warm-up's selection builds, the split by bits"
    timeout ${RINGTESTS_S:-120} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_triton_kernels.py \
      tests/test_gluon_mixed.py tests/test_triton_step.py -k "tma or tensor_copies or after_the_selection or no_kernel_compiles or split" \
      2>&1 | tee "$OUT/ringtests.log" | tail -8 ;;
  launches)
    log "decode attention as launches"
    timeout ${LAUNCHES_S:-90} python3 benchmarks/decode_attention.py --quick --out "$OUT/launches" > "$OUT/launches.log" 2>&1
    tail -14 "$OUT/launches.log" ;;
  engine)
    log "engine of 70b9c8a"
    (cd .old && PYTHONPATH=$PWD timeout ${OLD_S:-120} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b \
      --workload $AZ --requests 96 --kv-budget default --repeats 2 --json "$OUT/old.json" $CFG) > "$OUT/old.log" 2>&1
    tail -12 "$OUT/old.log"
    log "engine now"
    timeout ${NEW_S:-200} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b --workload $AZ --requests 96 \
      --kv-budget default --kv-budget 4e9 --repeats 3 --versus "$OUT/old.json" --json "$OUT/new.json" $CFG > "$OUT/new.log" 2>&1
    tail -30 "$OUT/new.log" ;;
  graphs)
    log "gpu tests: graphs against eager"
    timeout ${GRAPHS_S:-90} python3 -m pytest -m gpu -q -p no:cacheprovider -rfP tests/test_graphs.py 2>&1 | tee "$OUT/graphs.log" \
      | grep -E "^_+ test_captured.*bf16|bf16 summary|^E .*(step [0-9]+:|selection differs|values differ)|passed|failed|FAILED|Error" \
      | tail -30 ;;
  mixed)
    log "gpu tests: sparse INT8 on the mixed Gluon path (gluon_mixed)"
    timeout ${MIXED_TESTS_S:-70} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_gluon_mixed.py 2>&1 \
      | tee "$OUT/mixed_tests.log" | tail -8
    log "sparse INT8 split kernel vs gluon_mixed, INT4, unquantized, SDPA (graphs, launches)"
    timeout ${MIXED_BENCH_S:-80} python3 benchmarks/decode_attention.py --mixed --out "$OUT/mixed" > "$OUT/mixed.log" 2>&1
    grep -E "rel err|Traceback|Error" "$OUT/mixed.log" | tail -6; cat "$OUT/mixed/mixed.md" 2>/dev/null || tail -5 "$OUT/mixed.log" ;;
  precision)
    log "the cold kernels' error against the blocks a program reads, then the Gluon kernels' GPU tests"
    timeout ${PRECISION_S:-150} python3 lab/scripts/split_error.py --out "$OUT" --planned 16:32768,4:131072 2>&1 \
      | grep -v -i warn \
      | tee "$OUT/split_error.log" | tail -42
    timeout ${GLUON_TESTS_S:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=line \
      tests/test_triton_kernels.py tests/test_gluon_mixed.py 2>&1 | tee "$OUT/gluon_tests.log" \
      | grep -E "^FAILED|^E  |passed|failed" | tail -20 ;;
  sparsekernels)
    log "the sparse step's kernels on the device clock (profiled graph replays), fp16 bounds then the e4m3 summary"
    timeout ${SK_S:-70} python3 lab/scripts/sparse_kernels.py --out /tmp/sk > "$OUT/sk.log" 2>&1; tail -40 "$OUT/sk.log"
    KVTUNE_QUEST_SUMMARY=1 timeout ${SK_S:-70} python3 lab/scripts/sparse_kernels.py --summary --out /tmp/sk8 \
      > "$OUT/sk_e4m3.log" 2>&1; tail -40 "$OUT/sk_e4m3.log" ;;
  quest)
    log "gpu tests: the split Quest selection against the single kernel and the reference, ties, a captured graph"
    timeout ${QUEST_TESTS_S:-55} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_triton_step.py \
      -k "split_selection or ties" 2>&1 | tee "$OUT/quest_tests.log" | tail -8
    log "Quest selection: single-program kernel vs split (graphs, launches), 16x32K and 4x128K"
    timeout ${QUEST_BENCH_S:-65} python3 benchmarks/decode_attention.py --quest --out "$OUT/quest" > "$OUT/quest.log" 2>&1
    grep -E "Traceback|Error" "$OUT/quest.log" | tail -4; cat "$OUT/quest/quest.md" 2>/dev/null || tail -5 "$OUT/quest.log" ;;
  pieces)
    log "gpu tests: one attention for every prompt chunk, piecewise forwards"
    timeout ${PIECES_TESTS_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_piecewise.py \
      tests/test_graphs.py -k "chunk or pieces" 2>&1 | tee "$OUT/pieces_tests.log" | tail -8
    for pw in "" --piecewise; do
      log "INT8, ${PIECES_BUDGET:-4e9} B, op by op or piecewise: '$pw'"
      timeout ${PIECES_S:-150} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b --workload $AZ \
        --requests 96 --kv-budget ${PIECES_BUDGET:-4e9} --repeats ${PIECES_REPEATS:-3} --forwards $pw \
        --json "$OUT/pieces$pw.json" $C/q_int8.json > "$OUT/pieces$pw.log" 2>&1
      tail -10 "$OUT/pieces$pw.log"
    done ;;
  host)
    for shape in "1 256" "4 64"; do
      read -r n t <<< "$shape"
      for pw in "" --piecewise; do
        log "host time of a mixed iteration: Llama-3.1-8B shape, INT8, 16 decode rows + $n chunks of $t '$pw'"
        timeout ${HOST_S:-120} python3 benchmarks/mixed_ops.py $C/q_int8.json --model random:llama-3.1-8b --device cuda \
          --dtype bfloat16 --decode 16 --chunks $n --chunk $t --context 512 --host ${HOST_N:-20} $pw \
          --json "$OUT/host_${n}x$t$pw.json" > "$OUT/host_${n}x$t$pw.log" 2>&1
        head -22 "$OUT/host_${n}x$t$pw.log"
      done
    done ;;
  plugin)
    log "gpu tests: the vLLM plugin's CUDA step and kvtune's kernels over its pages"
    timeout ${PLUGIN_S:-300} python3 -m pytest tests/test_vllm_plugin.py -m gpu -q -p no:cacheprovider -rf 2>&1 | tail -5 ;;
  busy)
    log "engine: profiled kernel time against the unprofiled wall, default budget"
    timeout ${BUSY_S:-130} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b --workload $AZ --requests 96 \
      --kv-budget default --repeats 2 --profile "$OUT/prof" --json "$OUT/busy.json" $C/q_unquantized.json $C/q_int4.json \
      > "$OUT/busy.log" 2>&1; grep -E "profile:|largest distance" "$OUT/busy.log" ;;
  bound)
    log "engine: memory-bound budget, 4 GB"
    timeout ${BOUND_S:-130} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b --workload $AZ --requests 96 \
      --kv-budget 4e9 --repeats 2 --json "$OUT/bound.json" $CFG > "$OUT/bound.log" 2>&1; grep -E "largest distance|vs q_" "$OUT/bound.log" ;;
  noise)
    log "capacity noise per route on unseen windows"
    timeout ${NOISE_S:-200} python3 benchmarks/capacity_noise.py --model random:llama-3.1-8b --kv-budget 1073741824 \
      --length-scale 0.25 --requests 96 --windows 3 --repeats ${NOISE_REPEATS:-3} --routes ${ROUTES:-p90,attainment} \
      ${NOISE_ONLY:+--only $NOISE_ONLY} --json "$OUT/noise${NOISE_TAG:-}.json" > "$OUT/noise${NOISE_TAG:-}.log" 2>&1
    grep -v -i warn "$OUT/noise${NOISE_TAG:-}.log" | tail -25 ;;
  grid)
    log "every probe rule's noise from one set of replays: 3 windows x ${GRID_REPEATS:-2} repeats x ${GRID_RATES:-9} rates"
    timeout ${GRID_S:-540} python3 benchmarks/capacity_noise.py --grid --grid-center ${GRID_CENTER:-3.0} \
      --grid-rates ${GRID_RATES:-9} --grid-step ${GRID_STEP:-0.06} --model random:llama-3.1-8b --kv-budget 1073741824 \
      --length-scale 0.25 --requests 96 --windows 3 --repeats ${GRID_REPEATS:-2} --json "$OUT/grid.json" \
      > "$OUT/grid.log" 2>&1; grep -E "^(grid|planned|after|GRID|resolution)|^  [a-z0-9+]+ +window|Error" "$OUT/grid.log" | tail -26 ;;
  step)
    log "decode step, Llama-3.1-8B shape 32x8K: unquantized, INT8, INT4, INT8 + sparse top-512 (graphs)"
    timeout ${STEP_S:-200} python3 benchmarks/decode_step.py --shape llama-3.1-8b --batch 32 --context 8192 \
      --paths graph,graph_sync --json "$OUT/step.json" > "$OUT/step.log" 2>&1; grep -v -i warn "$OUT/step.log" | tail -12 ;;
  sparse)
    log "decode step, dense INT8 against INT8 + sparse top-512 with 7/8 of the blocks in L2: 32x8K, 16x32K, 4x128K (graphs)"
    for bl in ${SPARSE_SHAPES:-32:8192 16:32768 4:131072}; do
      timeout ${SPARSE_S:-110} python3 benchmarks/decode_step.py --shape llama-3.1-8b --batch ${bl%%:*} --context ${bl##*:} \
        --paths graph ${SPARSE_HOLD:+--hold-tiers} --json "$OUT/sparse_${bl%%:*}.json" $C/q_int8.json $C/q_int8_sparse512.json $C/q_int8_sparse512_fast.json \
        > "$OUT/sparse_${bl%%:*}.log" 2>&1; grep -v -i "warn\|USDT" "$OUT/sparse_${bl%%:*}.log" | tail -3
    done ;;
  collapse)
    log "whole replays near capacity, the first on each new cache primed (window:rate, repeated)"
    timeout ${COLLAPSE_S:-200} python3 lab/scripts/collapse.py --replays ${COLLAPSE_REPEATS:-3} --at 1:2.376 --at 0:2.830 \
      2>&1 | grep -v -i warn | tee "$OUT/collapse.log" | tail -8 ;;
  forward)
    log "a prompt forward's device time: op by op, pieces uncaptured, pieces as graphs (busy, then after 0.5 s idle)"
    for idle in 0 0.5; do
      timeout ${FORWARD_S:-120} python3 benchmarks/prompt_forward.py --lengths ${FORWARD_LENGTHS:-254,328,573,1018} \
        --repeats 10 --idle $idle --json "$OUT/forward_idle$idle.json" 2>&1 | grep -v -i warn | tee "$OUT/forward_idle$idle.log"
    done ;;
  launch)
    log "gpu tests with kept launches (kernels/launch.py)"
    timeout ${LAUNCH_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_launch.py \
      tests/test_triton_kernels.py tests/test_triton_step.py tests/test_graphs.py tests/test_chunk_kv.py 2>&1 | tee "$OUT/launch_tests.log" | tail -8 ;;
  hostab)
    log "host launch time: .old/ against this tree, kept launches off and on, the trees taking turns"
    SITE=/tmp/site timeout ${HOSTAB_S:-420} bash lab/scripts/host_ab.sh 2>&1 | tee "$OUT/hostab.log" ;;
  whole)
    log "gpu tests: mixed iterations replayed whole as graphs (padded chunk plans, the runner, the engine)"
    timeout ${WHOLE_TESTS_S:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_graphs.py \
      -k "padded or mixed_iteration or mixed_graph or gated_clock_keeps" 2>&1 | tee "$OUT/whole_tests.log" | tail -8
    for shape in "1 256" "4 64"; do
      read -r n t <<< "$shape"
      for round in $(seq ${ROUNDS:-2}); do
        for mode in --piecewise --mixed-graphs; do
          log "host time, Llama-3.1-8B shape, INT8, 16 decode rows + $n chunks of $t, $mode (round $round)"
          timeout ${HOST_S:-120} python3 benchmarks/mixed_ops.py $C/q_int8.json --model random:llama-3.1-8b \
            --device cuda --dtype bfloat16 --decode 16 --chunks $n --chunk $t --context 512 --host ${HOST_N:-20} \
            $mode --json "$OUT/whole_${n}x$t$mode.r$round.json" > "$OUT/whole_${n}x$t$mode.r$round.log" 2>&1
          head -1 "$OUT/whole_${n}x$t$mode.r$round.log"
        done
      done
    done ;;
  wholeengine)
    IFS=',' read -r -a modes <<< "${WHOLE_MODES:-op,--piecewise,--mixed-graphs}"
    for mode in "${modes[@]}"; do
      [ "$mode" = op ] && mode=""
      tag=$(echo "$mode" | tr -d ' =')
      configs=${WHOLE_CONFIGS:-$C/q_unquantized.json $C/q_int8.json}
      log "engine: $configs, ${WHOLE_BUDGET:-4e9} B, op by op / pieces / whole graphs: '$mode'"
      timeout ${WHOLE_S:-150} python3 benchmarks/engine_replay.py --model random:llama-3.1-8b --workload $AZ \
        --requests ${WHOLE_REQUESTS:-96} --kv-budget ${WHOLE_BUDGET:-4e9} --repeats ${WHOLE_REPEATS:-3} $mode \
        --json "$OUT/whole$tag.json" \
        $configs > "$OUT/whole$tag.log" 2>&1
      tail -8 "$OUT/whole$tag.log"
    done ;;
  leaks)
    log "leaked gates: the gated-clock and mixed-graph tests, up to ${LEAKS_RUNS:-8} runs in ${LEAKS_S:-240} s"
    t=$(date +%s); i=0
    while [ $i -lt ${LEAKS_RUNS:-8} ] && [ $(( $(date +%s) - t )) -lt ${LEAKS_S:-240} ]; do
      i=$((i + 1)); on=1; ab=${LEAKS_AB:-}
      [ -n "$ab" ] && on=$((i % 2))
      env ${ab:+$ab=$on} timeout 90 python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider \
        tests/test_graphs.py -k "mixed_graph_replays or gated_clock or pinned_memory" > "$OUT/leaks_$i.log" 2>&1
      echo "run $i (${ab:-defaults}${ab:+=$on}): $(tail -1 "$OUT/leaks_$i.log")" | tee -a "$OUT/summary.log"
      grep -h "^E  *AssertionError" "$OUT/leaks_$i.log" | sed "s/^/run $i ${ab:+$ab=$on} /" >> "$OUT/leaks.log"
    done
    log "gate_syncs.py: the calls inside each gate, the first that found it open"
    timeout ${GATE_SYNCS_S:-120} python3 lab/scripts/gate_syncs.py --repeats 1 > "$OUT/gate_syncs.log" 2>&1
    tail -30 "$OUT/gate_syncs.log" ;;
  warm)
    log "a new config's prime: empty Triton cache against one the planning processes filled (engine/warm.py)"
    timeout ${WARM_S:-420} python3 benchmarks/warm_ahead.py --configs ${WARM_CONFIGS:-4:32,8:64,0:32,4:256} --check \
      --json "$OUT/warm.json" 2>&1 | grep -v -i warn | tee "$OUT/warm.log" ;;
  esac
done
log done
