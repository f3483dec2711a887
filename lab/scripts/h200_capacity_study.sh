#!/usr/bin/env bash
# The capacity studies of the H200 (README "The objective: capacity"): at least 20 trials each, on the GPUs in
# CUDA_VISIBLE_DEVICES (one worker per GPU). On one H200 a study spent 5-6 minutes before its first trial (the
# baseline searched 3 times; NOTES runs 13a, 13c; about 3 minutes on the device clock, runs 14c, 14d), then 20
# trials took about 3 minutes and the validation 3: RESUME=1 continues a study kept in OUTDIR. The studies of
# runs 14c and 14d resume (and a finished one is validated again) from copies under their study names:
#   cp lab/studies/h200_capacity_llama31_8b_run14c.db OUTDIR/h200_capacity_llama31_8b.db
#   cp lab/studies/h200_capacity_smollm2_run14d.db OUTDIR/h200_capacity_smollm2.db
#
#   . lab/scripts/device_env.sh && lab/scripts/h200_capacity_study.sh OUTDIR [llama|smol|both]
#
# llama: random:llama-3.1-8b (bf16; byte-realistic weights, so the tier parameters are fixed) on the Azure
#        conversation sample, lengths x0.25, KV budget 1 GiB: memory-bound (the unquantized cache holds a few
#        dozen sequences of the mean length; INT8 and INT4 about 1.5x and 2x that; printed below).
# smol:  the real SmolLM2-135M weights (tier parameters searched too), same trace, lengths x0.5, KV budget
#        256 MiB: memory-bound the same way.
# Each study writes OUTDIR/<name>.db (the Optuna study), OUTDIR/preset_<name>.json and OUTDIR/<name>.log, then
# prints its trials per hour.
# Environment: TRACE (the workload, default the Azure sample; examples/traces/azure_conv_later.csv is the
# unseen one), MINUTES (--time-budget: the whole run, 6), TRIALS (20), REQUESTS (96 per window: the sample's
# first 75 % holds 121), RESUME=1, LLAMA_BUDGET (1GiB), SMOL_BUDGET (256MiB), the
# quality measurement QWINDOWS (2) x (QPREFILL 1024 + QDECODE tokens: 64 for llama, 128 for smol), CLOCK (kvtune --clock; unset: gated,
# kvtune's default for capacity), QMODEL (kvtune --quality-model; unset: the real SmolLM2, which needs the GGUF), SLO_PERCENTILE (kvtune --slo-percentile; unset: 90), SLO_TTFT_MS and SLO_TPOT_MS
# (kvtune --slo-ttft-ms / --slo-tpot-ms; unset: derived from the unloaded replay, whose P99 TTFT moves ±25 %).
# EXTRA: more kvtune options for every study (e.g. EXTRA=--piecewise). GPU: the card (kvtune --gpu; h200).
set -u
out=${1:?usage: lab/scripts/h200_capacity_study.sh OUTDIR [llama|smol|both]}
which=${2:-both}
mkdir -p "$out"
export TRACE=${TRACE:-examples/traces/azure_conv_sample.csv}
MINUTES=${MINUTES:-6}
TRIALS=${TRIALS:-20}
REQUESTS=${REQUESTS:-96}
log() { echo "== $(date +%T) $*"; }

holds() {  # model budget length-scale: sequences of the sample's mean length each bit width holds
  python3 - "$@" <<'EOF'
import sys, torch
from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, sequences_for_budget
from kvtune.engine.traces import read_trace
from kvtune.engine.weights import SHAPES
from kvtune.tuner.commands.tune import parse_bytes
model, budget, scale = sys.argv[1], parse_bytes(sys.argv[2]), float(sys.argv[3])
spec = SHAPES["smollm2-135m" if model == "smollm2" else model.removeprefix("random:")]  # no weights loaded
shape = ModelKVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads, torch.bfloat16)
import os
reqs = read_trace(os.environ.get("TRACE", "examples/traces/azure_conv_sample.csv")).requests
mean = scale * sum(r.input_length + r.output_length for r in reqs) / len(reqs)
fits = {b: sequences_for_budget(HybridConfig("hybrid_v2", 32, 64, b), shape, budget, mean) for b in (0, 8, 4)}
print(f"  KV budget {sys.argv[2]} at a mean length of {mean:.0f} tokens holds "
      + ", ".join(f"{n} sequences at {b or 16} bits" for b, n in fits.items()))
EOF
}

study() {  # name model budget length-scale [extra options]
  local name=$1 model=$2 budget=$3 scale=$4
  shift 4
  log "capacity study $name: $model, KV budget $budget, lengths x$scale, $TRIALS trials, $MINUTES min, GPUs ${CUDA_VISIBLE_DEVICES:-all}"
  holds "$model" "$budget" "$scale" 2>/dev/null
  local start=$SECONDS
  timeout "$(awk "BEGIN { print int($MINUTES * 60 + 420) }")" python3 -m kvtune --gpu ${GPU:-h200} --model "$model" --workload $TRACE \
    --objective capacity --kv-budget "$budget" --length-scale "$scale" --requests "$REQUESTS" --windows 1 \
    --trials "$TRIALS" --time-budget "$MINUTES" --quality-windows "${QWINDOWS:-2}" \
    --quality-prefill "${QPREFILL:-1024}" --quality-decode "${QDECODE:-128}" --no-passkey ${QMODEL:+--quality-model $QMODEL} ${CLOCK:+--clock $CLOCK} ${SLO_PERCENTILE:+--slo-percentile $SLO_PERCENTILE} \
    ${SLO_TTFT_MS:+--slo-ttft-ms $SLO_TTFT_MS} ${SLO_TPOT_MS:+--slo-tpot-ms $SLO_TPOT_MS} \
    ${RESUME:+--resume} ${EXTRA:-} "$@" \
    --study "$name" --storage "sqlite:///$out/$name.db" --out "$out/preset_$name.json" 2>&1 \
    | tee -a "$out/$name.log" | tail -40
  log "study $name: wall $(( SECONDS - start )) s"
  python3 - "$out/$name.db" "$name" <<'EOF' | tee -a "$out/$name.log"
import sys, optuna
from kvtune.tuner.export import describe_rate, search_rate
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=sys.argv[2], storage=f"sqlite:///{sys.argv[1]}")
rate = search_rate(study.get_trials(deepcopy=False))
print(f"  {describe_rate(rate)}" if rate else "  no finished trial")
noise = study.user_attrs.get("kvtune.noise") or {}
slo = study.user_attrs.get("kvtune.slo") or {}
if noise:
    print(f"  baseline capacity {noise['capacities']} (median {noise['median']:.3g}, spread "
          f"{100 * noise['spread']:.1f} %); limits TTFT {slo.get('ttft_ms', 0):.0f} ms, TPOT {slo.get('tpot_ms', 0):.1f} ms")
EOF
}

case "$which" in
  llama|both) study h200_capacity_llama31_8b random:llama-3.1-8b "${LLAMA_BUDGET:-1GiB}" 0.25 \
    --quality-decode "${QDECODE:-64}" ;;&
  smol|both) study h200_capacity_smollm2 smollm2 "${SMOL_BUDGET:-256MiB}" 0.5 ;;
  llama) ;;
  *) echo "unknown study $which (llama, smol or both)" >&2; exit 2 ;;
esac
