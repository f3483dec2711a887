#!/usr/bin/env bash
# Source this at the start of a run on a GPU machine that has torch + triton but not kvtune, ray or optuna:
#   . lab/scripts/device_env.sh
# It installs the carried wheels in .whl/ (see README: device wheels) into /tmp/site and reassembles
# the SmolLM2 GGUF (98 MB) from two halves carried in .weights/a/part1 and .weights/b/part2 (one call each:
# a call carries at most 64 MiB) or left in /tmp/weights by earlier calls on the same machine.
# The checkout itself goes on PYTHONPATH: kvtune/ links the top-level folders into the namespace.
set -u
repo=$(pwd)
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then  # once per machine: a running pipeline may use /tmp/site
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && touch /tmp/site/.installed
fi
export PYTHONPATH="$repo:/tmp/site" RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
mkdir -p /tmp/weights
for p in a/part1 b/part2; do
  [ -f ".weights/$p" ] && cp ".weights/$p" "/tmp/weights/$(basename $p)"
done
if [ -f /tmp/weights/part1 ] && [ -f /tmp/weights/part2 ]; then
  cat /tmp/weights/part1 /tmp/weights/part2 > /tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "gguf sha256: $(sha256sum /tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16)"
  export KVTUNE_SMOLLM2_GGUF=/tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "import gguf" 2>/dev/null || echo "warning: no gguf package: add its wheel to .whl/ (README)" >&2
fi
kvtune() { python3 -m kvtune "$@"; }
