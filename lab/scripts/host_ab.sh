#!/usr/bin/env bash
# The host's launch time of a mixed iteration, the checkout against an older tree carried in .old/ (a `git
# archive` of it) and against itself with KVTUNE_FAST_LAUNCH=0, in one call: Llama-3.1-8B shape, INT8 (CFGS:
# the configs), 16 decode rows with one prompt chunk of 256 tokens op by op and in pieces, with four in pieces
# and with none in pieces (benchmarks/mixed_ops.py --host; SHAPES: "chunks [--piecewise]" separated by ";",
# in that order; four chunks are of 64 tokens). The
# trees take turns, ROUNDS (2) times over, so a host whose speed drifts during the call (run 36a: ±20 % within
# a run) moves every tree alike. Logs under $OUT/host/<tree>/<config>_<shape>.r<round>.log.
#   git archive <commit> | tar -x -C .old; bash lab/scripts/host_ab.sh     (on the GPU; HOST_N, HOST_S, ROUNDS)
set -u
mkdir -p "$OUT/host"
for cfg in ${CFGS:-q_int8}; do
  IFS=';' read -r -a shapes <<< "${SHAPES:-1 --piecewise;1 ;4 --piecewise;0 --piecewise}"
  for shape in "${shapes[@]}"; do
    read -r c pw <<< "$shape"
    n=256; [ "$c" = 4 ] && n=64
    name="${cfg}_${c}x${n}${pw:-}"
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for tree in old nofast new; do
        dir=$PWD; [ "$tree" = old ] && dir=$PWD/.old
        fastl=1; [ "$tree" = nofast ] && fastl=0
        mkdir -p "$OUT/host/$tree"
        log="$OUT/host/$tree/$name.r$round.log"
        (cd "$dir" && KVTUNE_FAST_LAUNCH=$fastl PYTHONPATH=$dir:${SITE:-/tmp/site} timeout ${HOST_S:-60} python3 \
          benchmarks/mixed_ops.py examples/configs/$cfg.json --model random:llama-3.1-8b --device cuda \
          --dtype bfloat16 --decode 16 --chunks $c --chunk $n --context 512 --host ${HOST_N:-20} ${pw:-} \
          --json "$OUT/host/$tree/$name.r$round.json") > "$log" 2>&1
        echo "r$round $tree $name: $(head -1 "$log" | grep -o 'host launch.*' || tail -2 "$log")"
      done
    done
  done
done
