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

Trial attributes::

    kvtune.config             the resolved config dict        kvtune.seed, kvtune.versions, kvtune.device
    kvtune.metrics            the trial's mean replay metrics kvtune.window_metrics, one dict per window
    kvtune.quality            the quality dict                kvtune.error, one line when the config failed
    kvtune.worker, kvtune.host  who ran it                    kvtune.reused_from, kvtune.retry_of,
    kvtune.lost_worker, kvtune.interrupted, kvtune.enqueued_from, kvtune.abandoned, kvtune.resume_of
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
ATTR_VALIDATION = "kvtune.validation"
ATTR_IDENTITY = "kvtune.identity"
ATTR_VERSION = "kvtune.version"
ATTR_CREATED = "kvtune.created"
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

STUDY_ATTRS_REQUIRED = (ATTR_CARD, ATTR_MODEL, ATTR_WORKLOAD, ATTR_OBJECTIVE, ATTR_VALIDATION)
# ``kvtune.validation``: trial (best trial number), config and baseline_config (config dicts), window
# ({"start_fraction", "end_fraction", "requests"}), repeats, best and baseline (lists of replay metrics
# dicts, one per repeat), quality (quality dict of the best config or null), date (ISO 8601), versions,
# device.
VALIDATION_KEYS = ("trial", "config", "baseline_config", "window", "repeats", "best", "baseline", "date")

# ---- shared constants --------------------------------------------------------------------------------
DEFAULT_STORAGE = "sqlite:///studies/kvtune.db"
MIN_REPEATS = 3  # validation repeats of the best config and of its baseline, at least
# objective name -> (metric key, direction)
OBJECTIVE_METRICS: dict[str, tuple[str, str]] = {
    "tpot_p99": ("tpot_p99_ms", "minimize"),
    "ttft_p99": ("ttft_p99_ms", "minimize"),
    "e2e_p99": ("e2e_p99_ms", "minimize"),
    "throughput": ("tokens_per_s", "maximize"),
}
