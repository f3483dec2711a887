"""``kvtune --gpu GPU --workload TRACE``: tune the hybrid KV cache for one card, one model and one workload.

Parses the options, builds a :class:`~kvtune.tuner.job.TuneJob` and runs it; shows progress and the best
trials. Defaults differ on a CPU (``--gpu cpu``) so that a study of 12 trials finishes in minutes on two
cores:
shorter requests (length scale and cap), fewer requests per window, and quality measured on fewer, shorter
text
windows without the passkey check. What was used is printed and stored with the study.

Every input is checked before Ray starts or a weight loads (:mod:`kvtune.tuner.preflight`): numbers, the
card, the storage (:mod:`kvtune.studies.storage`), the trace, both models; a bad one is one line, exit 2.
The local Ray it starts is private to this machine (:mod:`kvtune.tuner.local_ray`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtune.engine.options import CPU_BUDGET_CAP_BYTES, CPU_LENGTH_CAP, CPU_LENGTH_SCALE
from kvtune.engine.scheduler import CLOCKS, SchedulerConfig
from kvtune.search_spaces.cards import Card, resolve_gpu
from kvtune.studies.names import (
    ATTR_CONFIG,
    ATTR_ENGINE,
    ATTR_ERROR,
    ATTR_METRICS,
    ATTR_NOISE,
    ATTR_QUALITY,
    ATTR_SLO,
    CAPACITY_CLOCK,
    CAPACITY_PROBES,
    DEFAULT_OBJECTIVE,
    DEFAULT_STORAGE,
    MIN_REPEATS,
    NOISE_REPEATS,
    OBJECTIVE_METRICS,
    SLO_PERCENTILE,
)
from kvtune.studies.storage import check_storage, redact
from kvtune.studies.study import OBJECTIVES, StudyOptions, study_name
from kvtune.tuner.capacity import (
    DRAWS_BRACKET,
    SLO_PERCENTILES,
    STATISTICS,
    ProbeRule,
    Slo,
    at_saturation,
    within_noise,
)
from kvtune.tuner.commands import Limits, check_numbers
from kvtune.tuner.console import table_console
from kvtune.tuner.driver import Bounds, Event
from kvtune.tuner.export import describe_rate, paired_gain, recommendation, validated_metrics
from kvtune.tuner.job import CAPACITY, TuneJob, TuneReport, tune
from kvtune.tuner.local_ray import ADDRESS_ENV, init_ray
from kvtune.tuner.outcome import no_feasible_reasons
from kvtune.tuner.preflight import Preflight, preflight
from kvtune.tuner.protocol import QUALITY_DEVICES, QualitySettings, WorkerSpec
from kvtune.tuner.resources import CPU_WORKER_OVERHEAD_BYTES, check_ram, check_seed, raise_resource_error
from kvtune.tuner.workload import WorkloadSample, load_trace

NAME = "tune"
HELP = "run a tuning study: kvtune --gpu GPU --workload TRACE [options]"
TEXT = Path("examples") / "text" / "wikitext2_excerpt.txt"
BEST_ROWS = 10
CPU_WORKERS = 2


@dataclass(frozen=True)
class Defaults:
    """Defaults of one kind of device (every one is printed by ``--help``)."""

    trials: int
    requests: int
    windows: int
    length_scale: float
    length_cap: int | None
    dtype: str
    quality_windows: int
    quality_prefill: int
    quality_decode: int
    passkey: bool
    trial_timeout_min: float  # a trial running longer is ended and recorded infeasible (--trial-timeout)


GPU = Defaults(30, 100, 3, 1.0, None, "bfloat16", 8, 2048, 512, True, 30.0)
CPU = Defaults(12, 4, 2, CPU_LENGTH_SCALE, CPU_LENGTH_CAP, "float32", 2, 192, 16, False, 5.0)
# The capacity objective's window (requests, windows): one window of many requests, since a probe replays
# every window at each rate. 120 fits the examples' search part (Azure 121, Mooncake 144 requests); the
# CPU's is reduced and stated: 32, since with 16 of the Azure example the whole window at once still met the
# limits (the baseline's searches ended at the saturation rate).
CAPACITY_GPU = (120, 1)
CAPACITY_CPU = (32, 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--gpu", required=True, help="card to tune for: an id (h200, h100-sxm, l4, ...), a family, or cpu")
    add("--workload", required=True, help="trace: Mooncake/vLLM JSONL or Azure CSV")
    add("--model", default="smollm2", help="smollm2 (default), random:<shape>, a HF directory or a .gguf")
    add("--quality-model", default=None, help="model for quality (default: --model, or smollm2 if random)")
    add("--trials", type=int, default=None, help=f"finished trials to reach ({GPU.trials}; CPU {CPU.trials})")
    add(
        "--requests",
        type=int,
        default=None,
        help=f"requests per window ({GPU.requests}; CPU {CPU.requests}; capacity: {CAPACITY_GPU[0]}; CPU "
        f"{CAPACITY_CPU[0]})",
    )
    add(
        "--windows",
        type=int,
        default=None,
        help=f"replay windows per trial ({GPU.windows}; CPU {CPU.windows}; capacity: {CAPACITY_GPU[1]})",
    )
    add("--time-scale", type=float, default=None, help="factor on arrival gaps (default: calibrated, stored)")
    add("--kv-budget", default=None, help="KV budget, e.g. 40GiB (default: 0.9 of free memory; CPU <= 4 GiB)")
    add(
        "--objective",
        choices=list(OBJECTIVES),
        default=DEFAULT_OBJECTIVE,
        help=f"what to optimize ({DEFAULT_OBJECTIVE}: the highest load within the latency limits)",
    )
    add("--slo-ttft-ms", type=float, default=None, help="capacity: TTFT limit (5x the unloaded P99)")
    add("--slo-tpot-ms", type=float, default=None, help="capacity: TPOT limit (10x the unloaded median)")
    add(
        "--slo-percentile",
        type=float,
        choices=SLO_PERCENTILES,
        default=None,
        help="capacity: the percentile of a probe's requests the two limits apply to: 90 (default: "
        "DistServe's 90 %% attainment, steady over ~100 requests) or 99; stored, a resumed study keeps it",
    )
    add(
        "--probe-statistic",
        choices=STATISTICS,
        default=None,
        help="capacity: what a probe's verdict is decided on: each limit's percentile of the requests "
        "(percentile, default) or the share of requests within both limits (attainment); stored",
    )
    add(
        "--probe-pool", action="store_true", help="capacity: judge a probe's --windows as one set of requests"
    )
    add(
        "--probe-confirm",
        type=int,
        choices=(1, 3),
        default=1,
        help="capacity: draws of a rate whose probe lands within 10 %% of a limit (3: the majority decides)",
    )
    add(
        "--probe-draws",
        type=int,
        default=0,
        help="capacity: once a search's bracket is 10 %% wide, this many more probes, each at the estimated "
        "rate a replay passes half the time, which becomes the capacity (0: the highest rate that passed)",
    )
    add(
        "--clock",
        choices=CLOCKS,
        default=None,
        help="what a replay's clock counts: host time (wall), each iteration's device time (device: host "
        "jitter between iterations moves no arrival) or the device's time with the host's launches held off "
        "it (gated: an iteration on an idle GPU starts behind a sleep while the host enqueues it); default "
        "gated for the capacity objective, else wall; stored, a resumed study keeps it",
    )
    add(
        "--piecewise",
        action="store_true",
        help="the replays' forwards with prompt tokens (up to 2,048) run their projections, norms and MLP as "
        "CUDA graphs captured per token bucket, attention eagerly between them (default: op by op)",
    )
    add(
        "--mixed-graphs",
        action="store_true",
        help="the replays' forwards with prompt tokens whose shapes fit run whole as one CUDA graph per "
        "shape bucket, attention and cache writes inside, captured on a shape's second use",
    )
    add("--max-ppl-increase", type=float, default=2.0, help="quality bound: perplexity increase, %% (2.0)")
    add("--max-kl", type=float, default=None, help="quality bound: mean KL in nats (default: none)")
    add(
        "--min-aggregation",
        type=float,
        default=None,
        help="quality bound: share of the aggregation probe's key-value pairs recalled by the unquantized "
        "cache that the config recalls too, in (0, 1] (default: none; given, the probe runs per config)",
    )
    add("--storage", default=DEFAULT_STORAGE, help=f"study database URL ({DEFAULT_STORAGE})")
    add("--study", default=None, help="study name (default <card>-<model>-<workload>)")
    add("--resume", action="store_true", help="continue the study (settings must match)")
    add("--address", default=None, help="Ray cluster address (default: a local Ray)")
    add("--seed", type=int, default=0, help="seed of the workload sample and the sampler (0)")
    add("--pareto", action="store_true", help="two objectives (with throughput), no pruning")
    add("--out", default=None, help="preset path (default presets/<card>/<model>-<workload>.json)")
    _add_more(parser)


def _add_more(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workers", type=int, default=None, help="workers (one per GPU of the card; CPU min(2, cores))")
    add("--length-scale", type=float, default=None, help=f"factor on lengths (1; CPU {CPU.length_scale:g})")
    add("--length-cap", type=int, default=None, help=f"cap on prompt + output (none; CPU {CPU.length_cap})")
    add("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="bfloat16; CPU float32")
    add("--quality-text", default=None, help=f"text for quality (default {TEXT})")
    add("--quality-windows", type=int, default=None, help=f"{GPU.quality_windows}; CPU {CPU.quality_windows}")
    add("--quality-prefill", type=int, default=None, help=f"{GPU.quality_prefill}; CPU {CPU.quality_prefill}")
    add("--quality-decode", type=int, default=None, help=f"{GPU.quality_decode}; CPU {CPU.quality_decode}")
    add("--no-passkey", action="store_true", help="skip the passkey check (always skipped on CPU)")
    add(
        "--quality-device",
        choices=list(QUALITY_DEVICES),
        default="auto",
        help="where quality is measured: cpu (a process of its own, while the trial's probes run), worker "
        "(the worker's device, after them); auto (default): cpu on a GPU worker for a light measurement (a "
        "model of at most 1 B parameters, at most 8,192 window tokens, no passkey, no aggregation probe), "
        "else worker",
    )
    add("--repeats", type=int, default=3, help="validation repeats of best and baseline (3)")
    add(
        "--time-budget",
        type=float,
        default=None,
        help="minutes for the whole run (baseline, search, validation, export): the search stops early "
        "enough for validation to fit, and the preset says what was cut",
    )
    add("--no-export", action="store_true", help="do not write a preset")
    add(
        "--trial-timeout",
        type=float,
        default=None,
        help=f"minutes after which a trial is ended and recorded infeasible ({GPU.trial_timeout_min:g}; "
        f"CPU {CPU.trial_timeout_min:g})",
    )


# Numeric options, checked before anything starts (a bad one would otherwise surface trials or minutes later).
LIMITS: Limits = {
    "--trials": (1, True),
    "--requests": (2, True),
    "--windows": (1, True),
    "--workers": (1, True),
    "--length-cap": (1, True),
    "--quality-windows": (1, True),
    "--quality-prefill": (1, True),
    "--quality-decode": (1, True),
    "--repeats": (MIN_REPEATS, True),
    "--time-scale": (0, False),
    "--length-scale": (0, False),
    "--time-budget": (0, False),
    "--max-ppl-increase": (0, True),
    "--max-kl": (0, False),
    "--min-aggregation": (0, False),
    "--slo-ttft-ms": (0, False),
    "--slo-tpot-ms": (0, False),
    "--trial-timeout": (0, False),
    "--probe-draws": (0, True),
}


def run(args: argparse.Namespace) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_numbers(args, LIMITS)
    check_seed(args.seed)
    if args.probe_draws and args.probe_confirm > 1:
        raise ValueError("--probe-draws and --probe-confirm are two rules for the same probes: give one")
    if not Path(args.workload).is_file():
        load_trace(args.workload)  # a directory or a missing file: one line
    card = resolve_gpu(args.gpu, _present_gpus())
    defaults = GPU if card.is_gpu else CPU
    job = build_job(args, card, defaults)
    if not card.is_gpu and not (args.address or os.environ.get(ADDRESS_ENV)):
        check_ram(job.workers or 1, job.spec.budget_bytes)  # the local Ray's workers run on this machine
    checked = preflight(job)  # trace, models, study: all before Ray starts or a weight loads
    console = Console(stderr=True)
    _print_settings(console, job, defaults, checked)
    started_ray, notes = init_ray(args.address)
    for note in notes:
        console.print(f"  [yellow]{note}[/]")
    try:
        report = _run_with_progress(console, job, checked)
        study = _load(job)
    except Exception as e:  # memory or disk ran out: one line (ResourceError); any other error as it is
        raise_resource_error(e, job.options.storage)
        raise
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    table_console().print(best_table(study, job.options))
    _print_outcome(console, report, job)
    return _exit_code(console, report, job, study)


NO_FEASIBLE_EXIT = 1  # the study ran to its end but found nothing to validate (bad input exits 2)


def _exit_code(console: Console, report: TuneReport, job: TuneJob, study: Any) -> int:
    """0, or :data:`NO_FEASIBLE_EXIT` when the study ended with no feasible trial (each reason counted, with
    the flag that would change it)."""
    ended = report.finished >= report.target or report.budget_spent
    if report.validation is not None or not ended:
        return 0
    limit = job.trial_time_limit_s
    for line in no_feasible_reasons(study.get_trials(deepcopy=False), limit / 60 if limit else None):
        console.print(f"  [yellow]{line}[/]")
    return NO_FEASIBLE_EXIT


# ---- building the job ------------------------------------------------------------------------------------
def build_job(args: argparse.Namespace, card: Card, d: Defaults) -> TuneJob:
    """The job of ``args``: every unset option takes the default of ``d`` (GPU or CPU)."""
    pick = lambda value, default: default if value is None else value
    requests, windows = (d.requests, d.windows)
    if args.objective == "capacity":  # one long window (more requests, a finer P99)
        requests, windows = CAPACITY_GPU if d is GPU else CAPACITY_CPU
    sample = WorkloadSample(
        path=str(args.workload),
        requests=pick(args.requests, requests),
        windows=pick(args.windows, windows),
        seed=args.seed,
        length_scale=pick(args.length_scale, d.length_scale),
        length_cap=pick(args.length_cap, d.length_cap),
    )
    spec = WorkerSpec(
        model=args.model,
        device="cuda" if card.is_gpu else "cpu",
        quality=_quality(args, d),
        dtype=pick(args.dtype, d.dtype),
        budget_bytes=parse_bytes(args.kv_budget) if args.kv_budget else None,
        threads=None if card.is_gpu else _threads(args),
        scheduler=SchedulerConfig(
            clock=args.clock or _default_clock(args.objective),
            piecewise=args.piecewise,
            mixed_graphs=args.mixed_graphs,
        ),
    )
    name = args.study or study_name(card.id, args.model, args.workload)
    options = StudyOptions(
        check_storage(args.storage), name, args.objective, args.pareto, args.seed, args.resume
    )
    return TuneJob(
        options=options, trials=pick(args.trials, d.trials), card=card, sample=sample, spec=spec,
        bounds=Bounds(args.max_ppl_increase, args.max_kl, args.min_aggregation), workers=_workers(args, card),
        cpus_per_worker=float(_threads(args)), time_scale=args.time_scale,
        repeats=args.repeats, time_budget_s=None if args.time_budget is None else 60 * args.time_budget,
        write_preset=not args.no_export, out=args.out,
        trial_time_limit_s=60 * pick(args.trial_timeout, d.trial_timeout_min),
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_percentile=args.slo_percentile,
        clock=args.clock, probe=ProbeRule(args.probe_statistic or "percentile", args.probe_pool,
                                          args.probe_confirm, args.probe_draws),
    )  # fmt: skip


def _search_rule(job: TuneJob) -> str:
    """How a capacity search ends, for the settings line."""
    if job.probe.draws:
        return (
            f"bisected to {max(job.granularity, DRAWS_BRACKET):.0%}, then {job.probe.draws} probes at the "
            "estimated rate a replay passes half the time (the capacity)"
        )
    return f"searched to {job.granularity:.1%}, at most {CAPACITY_PROBES} probes a trial"


def _default_clock(objective: str) -> str:
    """A new study's clock: the gated device clock for the capacity objective (a probe's verdict must not move
    with the host's jitter or launch gaps), the wall's for the fixed-rate objectives (what a user of the
    engine waits)."""
    return CAPACITY_CLOCK if objective == CAPACITY else "wall"


def _workers(args: argparse.Namespace, card: Card) -> int | None:
    """--workers, else one per GPU (None: Ray counts them), else on a CPU min(2, cores) workers: a CPU replay
    is bound by Python overhead more than by math, so two single-thread trials beat one two-thread trial."""
    if args.workers is not None or card.is_gpu:
        return args.workers
    return min(CPU_WORKERS, os.cpu_count() or 1)


def _threads(args: argparse.Namespace) -> int:
    """CPU threads of each CPU worker: the machine's cores shared among the workers."""
    cores = os.cpu_count() or 1
    return max(1, cores // (args.workers or min(CPU_WORKERS, cores)))


def _quality(args: argparse.Namespace, d: Defaults) -> QualitySettings:
    model = args.quality_model or ("smollm2" if args.model.startswith("random:") else args.model)
    text = Path(args.quality_text) if args.quality_text else _default_text()
    if not text.is_file():
        raise FileNotFoundError(f"--quality-text {text}: no such file")
    pick = lambda value, default: default if value is None else value
    return QualitySettings(
        model=model,
        text_path=str(text.resolve()),
        windows=pick(args.quality_windows, d.quality_windows),
        prefill_tokens=pick(args.quality_prefill, d.quality_prefill),
        decode_tokens=pick(args.quality_decode, d.quality_decode),
        passkey=d.passkey and not args.no_passkey,
        aggregation=args.min_aggregation is not None,
        device=args.quality_device,
    )


def _default_text() -> Path:
    here = Path(__file__).resolve().parents[2] / TEXT
    return TEXT if TEXT.is_file() else here


def parse_bytes(text: str) -> int:
    """``40GiB``, ``512MB``, ``1.5G`` or a plain byte count, as bytes (K/M/G/T: powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"--kv-budget {text!r}: expected a size such as 40GiB, 512MB or 1073741824")
    value = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")
    if value < 1:
        raise ValueError(f"--kv-budget {text!r}: must be at least 1 byte")
    return int(value)


def _present_gpus() -> list[tuple[str, int]]:
    """GPUs this machine sees (NVML name, memory), for resolving a family such as ``h100``."""
    import torch

    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [(p.name, int(p.total_memory)) for p in props]


# ---- showing ---------------------------------------------------------------------------------------------
def _clock_text(job: TuneJob) -> str:
    if job.clock is None and job.options.resume:
        return "the study's clock"
    return f"{job.spec.scheduler.clock} clock"


def _print_settings(console: Console, job: TuneJob, d: Defaults, checked: Preflight | None = None) -> None:
    s, q = job.sample, job.spec.quality
    lengths = f"lengths x{s.length_scale:g}" + (f", capped at {s.length_cap} tokens" if s.length_cap else "")
    console.print(f"[bold]kvtune[/] study [cyan]{job.options.name}[/] in {redact(job.options.storage)}")
    console.print(
        f"  {job.card.id}, {job.spec.model} ({job.spec.dtype}); {s.windows} window(s) x {s.requests} "
        f"requests of {Path(s.path).name} (seed {s.seed}; {lengths}); objective {job.options.objective}"
        + (" + Pareto" if job.options.pareto else "")
        + f"; {_clock_text(job)}"
    )
    reduced = " [yellow](reduced for CPU; docs/DESIGN.md asks >= 8 x (2048 + 512))[/]" if d is CPU else ""
    console.print(
        f"  quality on {q.model}: {q.windows} x ({q.prefill_tokens} + {q.decode_tokens}) tokens of "
        f"{Path(q.text_path).name}, passkey {'on' if q.passkey else 'off'}{reduced}"
    )
    if job.capacity:
        show = lambda given, rule: f"{given:g} ms (given)" if given is not None else rule
        pct = f"P{job.slo_percentile or SLO_PERCENTILE:g}"
        if job.slo_percentile is None and job.options.resume:
            pct = "the study's percentile of"
        console.print(
            f"  capacity: the highest rate (x the trace's) with {pct} TTFT <= "
            f"{show(job.slo_ttft_ms, '5x the unloaded baseline')} and {pct} TPOT <= "
            f"{show(job.slo_tpot_ms, '10x its decode step')}; {_search_rule(job)}, from the baseline's "
            f"capacity (measured {NOISE_REPEATS} times when the study is created)"
        )
    limit = job.trial_time_limit_s
    console.print(
        "  a trial running over "
        + (f"{limit / 60:g} min is ended and recorded infeasible (--trial-timeout)" if limit else "no limit")
        + _cpu_memory(job)
    )
    if checked is not None:
        for name, counts in checked.lengths.items():
            console.print(f"  {name} sample: {counts.describe(s.length_cap, checked.max_context)}")
        for warning in checked.warnings:
            console.print(f"  [yellow]warning: {warning}[/]")


def _cpu_memory(job: TuneJob) -> str:
    """What a CPU study holds in RAM (each worker allocates its whole KV budget when a replay starts)."""
    if job.card.is_gpu:
        return ""
    workers = job.workers or 1
    budget = job.spec.budget_bytes or CPU_BUDGET_CAP_BYTES
    need = workers * (budget + CPU_WORKER_OVERHEAD_BYTES)
    return (
        f"; RAM: about {need / 2**30:.1f} GiB ({workers} worker(s) x (KV budget {budget / 2**30:.2g} GiB "
        "+ ~1 GiB); --kv-budget lowers it"
    )


def _run_with_progress(console: Console, job: TuneJob, checked: Preflight | None = None) -> TuneReport:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("trials", total=job.trials)
        status = bar.add_task("", total=None)

        def on_event(e: Event) -> None:
            if e.kind == "phase":  # a phase began or ended, with the time budget's estimates
                bar.console.print(f"  {e.message}")
                return
            if e.kind in ("complete", "pruned", "crash"):
                bar.advance(task)
            bar.update(status, description=_describe(e))

        return tune(job, on_event, checked)


def _interval(gain: dict[str, Any]) -> str:
    ci = gain.get("interval95")
    return f", 95 % interval {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""


def _describe(e: Event) -> str:
    if e.kind == "probe":
        rate = f"{e.value:.4g}x the trace's rate"
        return f"  trial {e.trial} on worker {e.worker}: probe {e.step} at {rate}: {e.message}"
    if e.kind == "pruned" and e.message:  # the capacity rule (a probe failed at or below the best)
        return f"  trial {e.trial} on worker {e.worker}: pruned after probe {e.step}: {e.message}"
    value = "" if math.isnan(e.value) else f" {e.value:.4g}"
    step = f" window {e.step}" if e.step >= 0 else ""
    return f"  trial {e.trial} on worker {e.worker}: {e.kind}{step}{value} {e.message}"[:160]


def _load(job: TuneJob) -> Any:
    import optuna

    return optuna.load_study(study_name=job.options.name, storage=job.options.storage)


def best_table(study: Any, options: StudyOptions, rows: int = BEST_ROWS) -> Table:
    """The best finished trials: feasible first, then by the primary objective."""
    from optuna.trial import TrialState

    if options.objective == "capacity":
        return capacity_table(study, rows)
    sign = 1.0 if OBJECTIVES[options.objective][1] == "minimize" else -1.0
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    ranked = sorted(done, key=lambda t: (any(c > 0 for c in t.constraints.values()), sign * t.values[0]))
    table = Table(title=f"best trials of {study.study_name} ({len(done)} complete)")
    for col in (
        "#",
        "bits",
        "hot",
        "block",
        "top-k",
        "P99 TPOT ms",
        "P99 TTFT ms",
        "tok/s",
        "ppl +%",
        "KL",
        "ok",
    ):
        table.add_column(col, justify="right")
    for t in ranked[:rows]:
        table.add_row(*_row(t))
    return table


def _row(t: Any) -> list[str]:
    c, m, q = (
        t.user_attrs.get(ATTR_CONFIG, {}),
        t.user_attrs.get(ATTR_METRICS, {}),
        t.user_attrs.get(ATTR_QUALITY),
    )
    fmt = lambda v, spec: "-" if not isinstance(v, int | float) else format(v, spec)
    ok = (
        "crash"
        if ATTR_ERROR in t.user_attrs
        else ("yes" if all(v <= 0 for v in t.constraints.values()) else "no")
    )
    return [
        str(t.number), str(c.get("quantization_bits", "?")), str(c.get("hot_tokens", "?")),
        str(c.get("block_size", "?")), str(c.get("sparse_top_k", "?")), fmt(m.get("tpot_p99_ms"), ".2f"),
        fmt(m.get("ttft_p99_ms"), ".1f"), fmt(m.get("tokens_per_s"), ".1f"),
        fmt((q or {}).get("ppl_change_pct"), ".3f"), fmt((q or {}).get("mean_kl"), ".2e"), ok,
    ]  # fmt: skip


def capacity_table(study: Any, rows: int = BEST_ROWS) -> Table:
    """The capacity objective's best trials (feasible first): the capacity (× the trace's own rate), the
    output tokens/s at it, the engine knobs and the quality; the title states the limits, the caption the
    noise floor, ``≈`` marks a capacity within the noise of the best and ``≥`` one at the saturation rate
    (a lower bound: the window never overloaded that config)."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    ranked = sorted(done, key=lambda t: (any(c > 0 for c in t.constraints.values()), -t.values[0]))
    attrs = study.user_attrs
    slo, noise = attrs.get(ATTR_SLO), attrs.get(ATTR_NOISE) or {}
    limits = Slo.from_record(slo).describe() if slo else "limits unknown"
    table = Table(title=f"best trials of {study.study_name} ({len(done)} complete): capacity within {limits}")
    threshold = float(noise.get("threshold", 0.0))
    if noise:
        errors = [s["stderr"] for s in noise.get("searches", ()) if s.get("stderr") is not None]
        each = f", each ± {100 * min(errors):.1f}-{100 * max(errors):.1f} %" if errors else ""
        table.caption = (
            f"unquantized baseline (hot 32, block 64): capacity {noise['median']:.3g}x, measured "
            f"{noise['repeats']} times (spread {100 * noise['spread']:.0f} %{each}); ≈: within the noise "
            f"(< {100 * threshold:.0f} %) of the best"
        )
    columns = ("#", "bits", "hot", "block", "top-k", "seqs", "batch tok", "capacity x", "tok/s at it",
               "vs best", "ppl +%", "KL", "ok")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    top = next((t.values[0] for t in ranked if ATTR_ERROR not in t.user_attrs), None)
    cap = noise.get("max_rate")  # a study stored before the saturation rate has none
    capped = lambda v: ("≥ " if at_saturation(v, cap) else "") + format(v, ".3g")
    if any(at_saturation(t.values[0], cap) for t in ranked[:rows]):
        table.caption = f"{table.caption or ''}; ≥: at the saturation rate ({cap:.3g}x), a lower bound"
    for t in ranked[:rows]:
        c, m, q = (t.user_attrs.get(k) or {} for k in (ATTR_CONFIG, ATTR_METRICS, ATTR_QUALITY))
        e = t.user_attrs.get(ATTR_ENGINE) or {}
        fmt = lambda v, spec: "-" if not isinstance(v, int | float) else format(v, spec)
        versus = "-"
        if top and ATTR_ERROR not in t.user_attrs:
            versus = f"{t.values[0] / top:.2f}" + (" ≈" if within_noise(t.values[0], top, threshold) else "")
        feasible = all(v <= 0 for v in t.constraints.values())
        ok = "crash" if ATTR_ERROR in t.user_attrs else ("yes" if feasible else "no")
        table.add_row(
            str(t.number), str(c.get("quantization_bits", "?")), str(c.get("hot_tokens", "?")),
            str(c.get("block_size", "?")), str(c.get("sparse_top_k", "?")), fmt(e.get("max_num_seqs"), "d"),
            fmt(e.get("max_num_batched_tokens"), "d"), capped(t.values[0]),
            fmt(m.get("capacity_tokens_per_s"), ".1f"), versus, fmt(q.get("ppl_change_pct"), ".3f"),
            fmt(q.get("mean_kl"), ".2e"), ok,
        )  # fmt: skip
    return table


def _clipped(lengths: dict[str, dict[str, int]]) -> str:
    """``clipped 3 of 8 search requests, 0 of 4 held-out ones (to the length cap or the model's context)``."""
    parts = []
    for name, c in lengths.items():
        most = " (most)" if 2 * c["shortened"] > c["total"] else ""
        what = "search requests" if name == "search" else "held-out ones"
        parts.append(f"{c['shortened']} of {c['total']} {what}{most}")
    return f"clipped {', '.join(parts)} (to the length cap or the model's context)"


def _print_outcome(console: Console, report: TuneReport, job: TuneJob) -> None:
    console.print(f"study {report.study}: {report.finished}/{report.target} trials finished")
    if report.rate is not None:
        console.print(f"  {describe_rate(report.rate)}")
    if report.budget_spent:
        console.print(
            "  the time budget ended the search: the best so far is validated; --resume continues it"
        )
    elif report.finished < report.target:
        console.print("  stopped before the target: run again with --resume to continue")
    if report.lengths:
        console.print("  " + _clipped(report.lengths))
    for warning in report.warnings:
        console.print(f"  [yellow]{warning}[/]")
    v = report.validation
    if v is None:
        if report.finished >= report.target or report.budget_spent:
            nothing = f"no feasible trial among {report.finished}: nothing validated, no preset written"
            console.print(f"  [yellow]{nothing}[/]")
        return
    metric = OBJECTIVES[job.options.objective][0]
    where = f"  validated on {v['window']['requests']} held-out requests x {v['repeats']}"
    same = v["config"] == v["baseline_config"]
    if same:
        console.print(f"{where}: trial {v['trial']} is unquantized, its own baseline (the spread is noise)")
    directions = dict(OBJECTIVE_METRICS.values())
    tokens = "capacity_tokens_per_s" if job.capacity else "tokens_per_s"
    for key in dict.fromkeys((metric, tokens)):
        try:
            g = paired_gain(key, directions.get(key, "maximize"), v["best"], v["baseline"], same)
        except ValueError:
            continue
        if g["ratio"] is not None:
            console.print(
                f"{where}: trial {v['trial']} against the unquantized baseline on {key}: {g['ratio']:.3f}x "
                f"(per repeat {g['range'][0]:.3f}-{g['range'][1]:.3f}{_interval(g)}; > 1 is better): "
                f"{g['verdict']}"
            )
    if report.validations > 1:
        console.print(
            f"  validation {report.validations} of this study: the earlier ones are kept in "
            "kvtune.validation_history"
        )
    try:
        metrics = validated_metrics(job.options.objective, v)
        advice = recommendation(metrics, v["trial"])
    except (ValueError, KeyError):
        metrics, advice = {}, None
    if metrics.get("claim"):
        console.print(f"  capacity: {metrics['claim']}")
    for problem in metrics.get("inconclusive") or []:
        console.print(f"  [yellow]inconclusive: {problem}[/]")
    if advice is not None:
        color = "green" if advice["use"] == "best" else "yellow"
        console.print(f"  [{color}]recommended: {advice['why']}[/]")
    if report.preset:
        console.print(f"  preset written: [green]{report.preset}[/]")
        vllm = json.loads(Path(report.preset).read_text(encoding="utf-8")).get("vllm") or {}
        if "engine" in vllm and "--max-num-seqs" not in vllm["args"]:
            console.print(f"  [yellow]{vllm['engine']}[/]")
