#!/usr/bin/env bash
# The host's launch time of a mixed iteration, the checkout against an older tree carried in .old/ (a `git
# archive` of it) and against itself with KVTUNE_FAST_LAUNCH=0, in one call: Llama-3.1-8B shape, INT8 (CFGS:
# the configs), 16 decode rows with one prompt chunk of 256 tokens op by op and in pieces, and with none in
# pieces (benchmarks/mixed_ops.py --host). Logs under $OUT/host/{old,nofast,new}/.
#   git archive <commit> | tar -x -C .old; bash lab/scripts/host_ab.sh     (on the GPU; HOST_N, HOST_S)
set -u
mkdir -p "$OUT/host"
for tree in old nofast new; do
  dir=$PWD; [ "$tree" = old ] && dir=$PWD/.old
  fastl=1; [ "$tree" = nofast ] && fastl=0
  mkdir -p "$OUT/host/$tree"
  for cfg in ${CFGS:-q_int8}; do
    for shape in "1 " "1 --piecewise" "0 --piecewise"; do
      read -r c pw <<< "$shape"
      name="${cfg}_${c}x256${pw:-}"
      (cd "$dir" && KVTUNE_FAST_LAUNCH=$fastl PYTHONPATH=$dir:${SITE:-/tmp/site} timeout ${HOST_S:-60} python3 \
        benchmarks/mixed_ops.py examples/configs/$cfg.json --model random:llama-3.1-8b --device cuda \
        --dtype bfloat16 --decode 16 --chunks $c --chunk 256 --context 512 --host ${HOST_N:-20} ${pw:-} \
        --json "$OUT/host/$tree/$name.json") > "$OUT/host/$tree/$name.log" 2>&1
      echo "$tree $name: $(head -1 "$OUT/host/$tree/$name.log" | grep -o 'host launch.*' || tail -2 "$OUT/host/$tree/$name.log")"
    done
  done
done
