#!/usr/bin/env bash
# Runs h200_run.sh steps in the background of a GPU machine, so that the calls which only carry files or read
# results back keep the GPU busy. Start it detached, from the checkout, after `. lab/scripts/device_env.sh`:
#   setsid nohup bash lab/scripts/h200_pipeline.sh 'STAGE' ... > /dev/null 2>&1 &
# A stage is `[VAR=VALUE ...] STEP ...` (h200_run.sh's steps with those variables, e.g. CUDA_VISIBLE_DEVICES=1),
# `A ;; B` (two such stages at once), or `after:NAME` (wait until the pipeline NAME has ended). PIPE_NAME names
# this pipeline (default main). It works on a copy of the checkout in /tmp/repo, so later calls may replace
# the checkout; logs and results go to /tmp/pipe (copy them to $OUT).
set -u
PIPE=/tmp/pipe name=${PIPE_NAME:-main}
mkdir -p "$PIPE" /tmp/repo
[ -f /tmp/repo/pyproject.toml ] || cp -a . /tmp/repo/
cd /tmp/repo || exit 1
export PYTHONPATH="/tmp/repo:/tmp/site"
one() {  # one stage: VAR=VALUE words go to the environment, the rest are steps
  local vars=() steps=()
  for w in $1; do case "$w" in *=*) vars+=("$w") ;; *) steps+=("$w") ;; esac; done
  env OUT="$PIPE" "${vars[@]}" bash lab/scripts/h200_run.sh "${steps[@]}" >> "$PIPE/pipeline_$name.log" 2>&1
}
for spec in "$@"; do
  echo "== $(date +%T) stage: $spec" >> "$PIPE/pipeline_$name.log"
  case "$spec" in
  after:*) until [ -f "$PIPE/${spec#after:}.done" ]; do sleep 2; done ;;
  *";;"*) one "${spec%%;;*}" & one "${spec#*;;}" & wait ;;
  *) one "$spec" ;;
  esac
done
echo "== $(date +%T) done" >> "$PIPE/pipeline_$name.log"
touch "$PIPE/$name.done"
