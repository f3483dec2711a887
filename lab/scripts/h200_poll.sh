#!/usr/bin/env bash
# Wait for a detached h200_pipeline.sh, then bring its results back: `bash lab/scripts/h200_poll.sh NAME [SECONDS]`
# waits until /tmp/pipe/NAME.done exists or SECONDS (default 540) have passed, packs the logs, databases and
# JSON of /tmp/pipe into $OUT/pipe.tgz (one file: a call brings back only a few) and prints the logs' tails.
# Poll again at once if the pipeline is still running: the machine is released when no call is in flight.
set -u
name=${1:-main} limit=${2:-540} OUT=${OUT:-/tmp/out}
for _ in $(seq 1 $(( limit / 5 ))); do [ -f "/tmp/pipe/$name.done" ] && break; sleep 5; done
cd /tmp/pipe 2>/dev/null || { echo "no /tmp/pipe: the pipeline never ran on this machine"; exit 1; }
tar czf "$OUT/pipe.tgz" --exclude='*/kernels*.txt' ./*.log ./*.db ./*.json ./*/ 2>/dev/null
[ -f "$name.done" ] && echo "== $name done" || echo "== $name still running"
for f in pipeline_*.log h200_*.log; do
  [ -f "$f" ] && { echo "## $f"; grep -v '━' "$f" | tail -15 | cut -c1-200; }
done
