#!/usr/bin/env bash
# The host's launch time of a mixed iteration, the checkout against an older tree carried in .old/ (a `git
# archive` of it), in one call: Llama-3.1-8B shape, INT8 (CFGS: the configs), 16 decode rows with no chunk and with one of
# 256 tokens, op by op and in pieces (benchmarks/mixed_ops.py --host). Logs under $OUT/host/{old,new}/.
#   git archive <commit> | tar -x -C .old; bash lab/scripts/host_ab.sh     (on the GPU; HOST_N, HOST_S)
set -u
mkdir -p "$OUT/host"
for tree in old new; do
  dir=$PWD; [ "$tree" = old ] && dir=$PWD/.old
  mkdir -p "$OUT/host/$tree"
  for cfg in ${CFGS:-q_int8}; do
    for c in 0 1; do
      for pw in "" --piecewise; do
        name="${cfg}_${c}x256$pw"
        (cd "$dir" && PYTHONPATH=$dir:${SITE:-/tmp/site} timeout ${HOST_S:-60} python3 benchmarks/mixed_ops.py \
          examples/configs/$cfg.json --model random:llama-3.1-8b --device cuda --dtype bfloat16 --decode 16 \
          --chunks $c --chunk 256 --context 512 --host ${HOST_N:-20} $pw --json "$OUT/host/$tree/$name.json") \
          > "$OUT/host/$tree/$name.log" 2>&1
        echo "$tree $name: $(head -1 "$OUT/host/$tree/$name.log" | grep -o 'host launch.*')"
      done
    done
  done
done
