#!/usr/bin/env bash
# Source this at the start of a run on a GPU machine that has torch + triton but not kvtune, ray or optuna:
#   . lab/scripts/device_env.sh
# It installs the carried wheels in .whl/ (see README: device wheels) into /tmp/site and reassembles
# the SmolLM2 GGUF (98 MB) from parts carried in .weights/*/part<N> (one call each: a call carries at most
# 64 MiB, the wheels 52 MB of it, 47 MB after `python lab/scripts/slim_ray_wheel.py .whl`, which the tree
# needs since run 42) or left in /tmp/weights by earlier calls on the same machine; the first part's folder
# holds `parts`, the number of parts, and the whole file's sha256. The tree itself travels with every call
# (18 MB at run 48), so parts of 33 MB: `split -b 33000000 -d -a 1 GGUF` into .weights/a, b, c.
# The checkout itself goes on PYTHONPATH: kvtune/ links the top-level folders into the namespace.
set -u
repo=$(pwd)
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then  # once per machine: a running pipeline may use /tmp/site
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && touch /tmp/site/.installed
fi
export PYTHONPATH="$repo:/tmp/site" RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
mkdir -p /tmp/weights
for f in .weights/*/part* .weights/*/parts; do
  [ -f "$f" ] && cp "$f" "/tmp/weights/$(basename "$f")"
done
n=$(cut -d' ' -f1 /tmp/weights/parts 2>/dev/null || echo 0)
if [ "$n" -gt 0 ] && [ "$(ls /tmp/weights/part[0-9]* 2>/dev/null | wc -l)" -eq "$n" ]; then
  for i in $(seq 1 "$n"); do cat "/tmp/weights/part$i"; done > /tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf
  sum=$(sha256sum /tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
  [ "$sum" = "$(cut -d' ' -f2 /tmp/weights/parts)" ] && echo "gguf sha256 ${sum:0:16}: as carried" \
    || echo "warning: the reassembled gguf's sha256 ${sum:0:16} is not the carried one" >&2
  export KVTUNE_SMOLLM2_GGUF=/tmp/weights/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "import gguf" 2>/dev/null || echo "warning: no gguf package: add its wheel to .whl/ (README)" >&2
fi
kvtune() { python3 -m kvtune "$@"; }
