"""The tuner's shared vocabulary: every study and trial attribute name, and the shared constants.

Driver, job, validation, export and the dashboard import these names from here; nothing redefines them.

Study attributes (set when the study is created; ``kvtune.identity`` and ``kvtune.space`` are compared on
``--resume``)::

    kvtune.card, kvtune.model, kvtune.objective, kvtune.seed, kvtune.pareto
    kvtune.workload           {name, path, sha256, requests}
    kvtune.sample             how the windows were cut (requests, windows, seed, length scale and cap)
    kvtune.space              the search space fingerprint; kvtune.space_description its text
    kvtune.kv_budget_bytes    the workers' KV budget
    kvtune.time_scale         the replay time scale; kvtune.time_scale_source "calibrated" or "given"
    kvtune.quality_limits     {max_ppl_increase, max_kl}; kvtune.quality_settings how quality is measured
    kvtune.identity           what a resumed run must repeat (all of the above that shape results)
    kvtune.version, kvtune.created
    kvtune.validation         the re-measurement of the best config and its baseline (docs/DESIGN.md §3)
    kvtune.slo                capacity's latency limits {ttft_ms, tpot_ms, source, rule, unloaded,
                              percentile, statistic, pooled}
    kvtune.noise              the baseline's capacity searched NOISE_REPEATS times: {capacities, median,
                              spread, threshold, granularity, max_probes, searches (each with its
                              probes), search_s, confirm, ...} (warm start and noise floor)
    kvtune.validation_history every validation record, oldest first (re-validating appends one)
    kvtune.driver             the lease of the driver running it {host, pid, since, heartbeat, token}, null
                              once released (kvtune.studies.lease)

Trial attributes::

    kvtune.config             the resolved config dict        kvtune.seed, kvtune.versions, kvtune.device
    kvtune.metrics            the trial's mean replay metrics kvtune.window_metrics, one dict per window
    kvtune.quality            the quality dict                kvtune.error, one line when the config failed
    kvtune.quality_s          the quality call's seconds {wall_s, load_s, compile_s; measure_s: beside}
    kvtune.worker, kvtune.host  who ran it                    kvtune.reused_from, kvtune.retry_of,
    kvtune.lost_worker, kvtune.interrupted, kvtune.enqueued_from, kvtune.abandoned, kvtune.resume_of
    kvtune.engine             the engine knobs {max_num_batched_tokens, max_num_seqs, max_num_seqs_factor}
    kvtune.probes             capacity objective: each probe {rate, passed, aborted, ttft_p99_ms, ...,
                              step_ms, mixed_iterations, peak_running, ...} (tuner.capacity.probe_summary)
"""

from __future__ import annotations

# ---- study attributes --------------------------------------------------------------------------------
ATTR_CARD = "kvtune.card"
ATTR_MODEL = "kvtune.model"
ATTR_WORKLOAD = "kvtune.workload"
ATTR_OBJECTIVE = "kvtune.objective"
ATTR_SPACE = "kvtune.space"
ATTR_SPACE_TEXT = "kvtune.space_description"
ATTR_BUDGET = "kvtune.kv_budget_bytes"
ATTR_TIME_SCALE = "kvtune.time_scale"
ATTR_TIME_SCALE_SOURCE = "kvtune.time_scale_source"
ATTR_SEED = "kvtune.seed"
ATTR_PARETO = "kvtune.pareto"
ATTR_SAMPLE = "kvtune.sample"
ATTR_QUALITY_LIMITS = "kvtune.quality_limits"
ATTR_QUALITY_SETTINGS = "kvtune.quality_settings"
ATTR_VALIDATION = "kvtune.validation"  # the latest validation record (what export reads)
ATTR_VALIDATION_HISTORY = "kvtune.validation_history"  # every validation record, oldest first, latest last
ATTR_IDENTITY = "kvtune.identity"
ATTR_VERSION = "kvtune.version"
ATTR_CREATED = "kvtune.created"
ATTR_SLO = "kvtune.slo"
ATTR_NOISE = "kvtune.noise"
ATTR_DRIVER = "kvtune.driver"  # the running driver's lease (kvtune.studies.lease)
# ---- trial attributes --------------------------------------------------------------------------------
ATTR_CONFIG = "kvtune.config"
ATTR_VERSIONS = "kvtune.versions"
ATTR_DEVICE = "kvtune.device"
ATTR_METRICS = "kvtune.metrics"
ATTR_WINDOW_METRICS = "kvtune.window_metrics"
ATTR_QUALITY = "kvtune.quality"
ATTR_ERROR = "kvtune.error"
ATTR_WORKER = "kvtune.worker"  # which worker ran the trial (0, 1, ...)
ATTR_HOST = "kvtune.host"
ATTR_LOST = "kvtune.lost_worker"
ATTR_INTERRUPTED = "kvtune.interrupted"
ATTR_REUSED = "kvtune.reused_from"
ATTR_ENQUEUED_FROM = "kvtune.enqueued_from"
ATTR_ABANDONED = "kvtune.abandoned"
ATTR_RESUME_OF = "kvtune.resume_of"
ATTR_RETRY_OF = "kvtune.retry_of"
ATTR_ENGINE = "kvtune.engine"
ATTR_PROBES = "kvtune.probes"
# the quality call's seconds: {"wall_s", "load_s" (the model's load), "compile_s" (Triton's)}; measured beside
# the probes (tuner/quality_host.py): "wall_s" the call's wait, "measure_s" and "load_s" the CPU process's
ATTR_QUALITY_S = "kvtune.quality_s"

STUDY_ATTRS_REQUIRED = (ATTR_CARD, ATTR_MODEL, ATTR_WORKLOAD, ATTR_OBJECTIVE, ATTR_VALIDATION)
# ``kvtune.validation``: trial (best trial number), config and baseline_config (config dicts), window
# ({"start_fraction", "end_fraction", "requests"}), repeats, best and baseline (lists of replay metrics
# dicts, one per repeat), quality (quality dict of the best config or null), date (ISO 8601), versions,
# device; interval (the repeats towards INTERVAL_GOAL: {goal, half_width, repeats, first, reached, why}),
# budget (with --time-budget: {budget_s, phases_s, cut}); capacity: ties (trials within the best's noise).
VALIDATION_KEYS = ("trial", "config", "baseline_config", "window", "repeats", "best", "baseline", "date")

# ---- shared constants --------------------------------------------------------------------------------
DEFAULT_STORAGE = "sqlite:///studies/kvtune.db"
MIN_REPEATS = 3  # validation repeats of the best config and of its baseline, at least
INTERVAL_GOAL = 0.15  # validation adds repeats until the gain's 95 % interval is within ±15 % (relative)
MAX_REPEATS = 12  # ... but never beyond this many repeats
# objective name -> (metric key, direction)
OBJECTIVE_METRICS: dict[str, tuple[str, str]] = {
    "capacity": ("capacity", "maximize"),  # highest arrival rate (x the trace's own) within the limits
    "tpot_p99": ("tpot_p99_ms", "minimize"),
    "ttft_p99": ("ttft_p99_ms", "minimize"),
    "e2e_p99": ("e2e_p99_ms", "minimize"),
    "throughput": ("tokens_per_s", "maximize"),
}
DEFAULT_OBJECTIVE = "capacity"
# ---- the capacity objective (docs/DESIGN.md §3.7; README "The objective") ------------------------------
CAPACITY_GRANULARITY = 0.025  # a search stops once hi / lo - 1 <= this (Vidur's 2.5 %: half the noise goal)
CAPACITY_PROBES = 8  # probes per trial at most (warm-started: bracket, then about 4 bisections)
CAPACITY_PROBES_COLD = 12  # probes of a search that is not warm-started (the baseline's own)
NOISE_REPEATS = 3  # the baseline's capacity is searched this often when a study starts
SLO_TTFT_FACTOR = 5.0  # default TTFT limit: this x the unloaded baseline's P99 TTFT
# default TPOT limit: this x the unloaded baseline's median TPOT (its decode step). Sarathi-Serve's strict
# limit is 5x, its relaxed one 25x; 10x because a short output's TPOT includes whole prompt chunks of a mixed
# iteration (up to max_num_batched_tokens), and at 5x one 2K-token chunk fails a P99 whatever the KV cache.
SLO_TPOT_FACTOR = 10.0
# the percentile of a probe's requests the limits apply to in a new study: DistServe's 90 % attainment.
# Over ~100 requests a P99 is the second-slowest request, and a probe's verdict turned on one or two short
# outputs that a prompt chunk happened to stall (docs/RESULTS.md, "Why the P90 and the device clock": the
# baseline's capacity searched three times spread 111 %); the P90 needs 11 of 96 requests over a limit (runs
# 14c, 14d: 4.4 %, 8.9 %).
SLO_PERCENTILE = 90.0
# the engine's clock for a new capacity study (kvtune.engine.scheduler.SchedulerConfig.clock): each
# iteration's device time, so the host's jitter between iterations moves no arrival and no verdict; gated,
# so the host's launch gaps inside an op-by-op iteration (a prompt) move none either. On an H200 the
# baseline's capacity searched three times on an unseen window spread 2.8 % and 1.4 % gated (two windows),
# 4.2-23.6 % on the device clock (docs/RESULTS.md, "The gates between layers on the GPU"). On a CPU the
# gated clock is the device clock.
CAPACITY_CLOCK = "gated"
