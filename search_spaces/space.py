"""The search space of one (card, model, workload): define-by-run, valid configs only (docs/DESIGN.md §1, §3).

Parameters (optuna names) and how each maps onto :class:`HybridConfig`:

=========================  ======================================  =====================================
parameter                  distribution                            config field
=========================  ======================================  =====================================
``quantization_bits``      categorical over the bits that fit      ``quantization_bits``
``block_size``             categorical over powers of two          ``block_size``
``hot_tokens_log2``        int exponent                            ``hot_tokens = 2 ** e``
``sparse_blocks``          int multiplier (real weights only)      ``sparse_top_k = m * block_size``
``migration_throttling``   categorical (only when m > 0)           ``migration_throttling``
``migration_interval``     int, log scale (only when m > 0)        ``migration_interval``
``migration_threshold_ms`` float, log scale (only when m > 0)      ``migration_threshold_ms``
``max_num_batched_tokens`` categorical (GPU 2K-16K; CPU 64-512)    engine knob (not in the config)
``max_num_seqs_factor``    categorical 0.5, 1, 2                   engine knob: ``max_num_seqs`` =
                                                                   factor x what the budget holds
=========================  ======================================  =====================================

The engine knobs (:meth:`SearchSpace.suggest_knobs`) are asked after the config and travel beside it:
``max_num_seqs`` is the factor times the sequences of the workload's mean length that the config's cache
holds under the budget (:meth:`SearchSpace.auto_seqs`), capped at ``MAX_NUM_SEQS_CAP`` and at
``max_num_batched_tokens`` (vLLM's rule: an iteration must be able to batch one token per sequence): the
engine's own rule, :func:`kvtune.engine.options.max_num_seqs_for`.

Memory rule: every point of the space fits the KV budget for the workload, i.e. a cache of that budget
laid out for ``concurrency`` sequences (:func:`kvtune.cache_impl.layout.cache_layout`) holds that many
sequences of the workload's percentile length at once, and one laid out for a single sequence holds one of
its maximum length. Choices are narrowed at build time (costly bit widths dropped first, then large hot
zones, then block sizes) so that *every* combination fits; what was narrowed is stated in
:attr:`SearchSpace.notes`. Hot zones stop at half the percentile length (longer ones leave almost nothing
to quantize).
Tier parameters need real weights (random weights give meaningless attention): without them the tier is
off and stated as fixed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)

from kvtune.cache_impl.config import BITS, HOT_TOKENS_RANGE, HybridConfig
from kvtune.cache_impl.layout import ModelKVShape, cache_layout, hot_bytes_per_seq
from kvtune.engine.options import MAX_NUM_SEQS_CAP, max_num_seqs_for
from kvtune.search_spaces.cards import Card

SPACE_VERSION = 2  # 2: the engine knobs
BATCHED_TOKENS_GPU = (2048, 4096, 8192, 16384)
BATCHED_TOKENS_CPU = (64, 128, 256, 512)  # CPU lengths are scaled down 32x (docs/DESIGN.md §2.2)
SEQS_FACTORS = (0.5, 1.0, 2.0)
DEFAULT_SEQS_FACTOR = 1.0
BUDGET_FRACTION = 0.9  # of the card's memory, when the caller resolves no budget
MAX_SPARSE_BLOCKS = 8
MIGRATION_INTERVAL_RANGE = (25, 400)
MIGRATION_THRESHOLD_MS_RANGE = (300.0, 30000.0)
COST_ORDER = (0, 8, 4)  # bit widths from the most to the least memory per cold token
TIER_FIXED: dict[str, Any] = {
    "sparse_top_k": 0,
    "migration_throttling": False,
    "migration_interval": 100,
    "migration_threshold_ms": 3000.0,
}
MEANING = {"hot_tokens_log2": ": hot_tokens = 2**e", "sparse_blocks": ": sparse_top_k = m * block_size"}
DEFAULT_POINTS = ({"hot_tokens": 32, "block_size": 64, "quantization_bits": 8}, {"quantization_bits": 4})


@dataclass(frozen=True)
class WorkloadStats:
    """What the memory rule needs from a workload (lengths = prompt + output tokens)."""

    max_length: int
    length_pctl: int
    percentile: float
    concurrency: int
    mean_length: int = 0  # 0: unknown (the percentile length stands in)

    def __post_init__(self) -> None:
        if not 1 <= self.length_pctl <= self.max_length:
            raise ValueError(
                f"WorkloadStats: `1 <= length_pctl <= max_length` must hold, but got "
                f"length_pctl={self.length_pctl}, max_length={self.max_length}"
            )
        if self.concurrency < 1:
            raise ValueError(f"WorkloadStats: `concurrency >= 1` must hold, but got {self.concurrency}")

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], concurrency: int, percentile: float = 99.0
    ) -> WorkloadStats:
        """Stats of per-request total lengths; ``concurrency`` = sequences the engine runs at once."""
        if not lengths:
            raise ValueError("WorkloadStats.from_lengths: the workload has no requests")
        ordered = sorted(lengths)
        index = min(len(ordered) - 1, math.ceil(percentile / 100 * len(ordered)) - 1)
        mean = max(1, round(sum(ordered) / len(ordered)))
        return cls(ordered[-1], ordered[max(index, 0)], percentile, min(concurrency, len(ordered)), mean)


@dataclass(frozen=True)
class SearchSpace:
    """The valid configs for ``card`` × ``model`` × ``workload``; build with :meth:`build`."""

    card: str
    model: str
    workload: WorkloadStats
    kv_budget_bytes: int
    real_weights: bool
    bits: tuple[int, ...]
    block_sizes: tuple[int, ...]
    hot_tokens: tuple[int, ...]  # consecutive powers of two
    notes: tuple[str, ...] = ()
    shape: ModelKVShape | None = None  # needed by the engine knobs
    batched_tokens: tuple[int, ...] = ()  # max_num_batched_tokens choices; () = the knobs are not searched
    seqs_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        hot = self.hot_tokens
        if not (self.bits and self.block_sizes and hot):
            raise ValueError(f"SearchSpace {self.card}/{self.model}: empty choices {self}")
        if any(b != 2 * a for a, b in itertools.pairwise(hot)):
            raise ValueError(f"SearchSpace: hot_tokens={hot} must be consecutive powers of two")
        for point in self._corners():
            HybridConfig.validate_dict(point)

    # ---- building ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        card: Card,
        model: str,
        shape: ModelKVShape,
        workload: WorkloadStats,
        real_weights: bool,
        kv_budget_bytes: int | None = None,
        knobs: bool = True,
    ) -> SearchSpace:
        """Narrow the card's choices until every combination fits ``kv_budget_bytes`` (default: 0.9 of
        the card's memory) for ``workload``; raises ``ValueError`` when nothing fits. ``knobs``: search the
        engine knobs too."""
        budget = kv_budget_bytes if kv_budget_bytes is not None else int(BUDGET_FRACTION * card.memory_bytes)
        fit = _Fit(shape, workload, budget)
        bits, blocks, hot, notes = _narrow(card, workload, fit)
        tokens = (BATCHED_TOKENS_GPU if card.is_gpu else BATCHED_TOKENS_CPU) if knobs else ()
        factors = SEQS_FACTORS if knobs else ()
        return cls(card.id, model, workload, budget, real_weights, bits, blocks, hot, tuple(notes), shape,
                   tokens, factors)  # fmt: skip

    # ---- proposing ---------------------------------------------------------------------------------
    def suggest(self, trial: optuna.Trial) -> HybridConfig:
        """Ask ``trial`` for one point; every point it can return is a valid config that fits."""
        bits = trial.suggest_categorical("quantization_bits", self.bits)
        block = trial.suggest_categorical("block_size", self.block_sizes)
        lo, hi = _log2(self.hot_tokens[0]), _log2(self.hot_tokens[-1])
        hot = 2 ** trial.suggest_int("hot_tokens_log2", lo, hi)
        tier = self._suggest_tier(trial, int(block)) if self.real_weights else TIER_FIXED
        return HybridConfig("hybrid_v2", hot, int(block), int(bits), **tier)

    def _suggest_tier(self, trial: optuna.Trial, block: int) -> dict[str, Any]:
        blocks = trial.suggest_int("sparse_blocks", 0, MAX_SPARSE_BLOCKS)
        if blocks == 0:
            return TIER_FIXED
        return {
            "sparse_top_k": blocks * block,
            "migration_throttling": trial.suggest_categorical("migration_throttling", (False, True)),
            "migration_interval": trial.suggest_int(
                "migration_interval", *MIGRATION_INTERVAL_RANGE, log=True
            ),
            "migration_threshold_ms": trial.suggest_float(
                "migration_threshold_ms", *MIGRATION_THRESHOLD_MS_RANGE, log=True
            ),
        }

    # ---- engine knobs (beside the config, never in it) -----------------------------------------------
    def suggest_knobs(self, trial: optuna.Trial, config: HybridConfig) -> dict[str, Any] | None:
        """Ask ``trial`` for the engine knobs of ``config``: :meth:`knobs_for`'s dict, or None when this
        space does not search them."""
        if not self.batched_tokens:
            return None
        tokens = trial.suggest_categorical("max_num_batched_tokens", self.batched_tokens)
        factor = trial.suggest_categorical("max_num_seqs_factor", self.seqs_factors)
        return self.knobs_for(config, int(tokens), float(factor))

    def knobs_for(self, config: HybridConfig, batched_tokens: int, factor: float) -> dict[str, Any]:
        """``{max_num_batched_tokens, max_num_seqs, max_num_seqs_factor, max_num_seqs_auto}`` for
        ``config``: ``max_num_seqs`` = ``factor`` × :meth:`auto_seqs`, within [1, min(MAX_NUM_SEQS_CAP,
        max_num_batched_tokens)] (:func:`~kvtune.engine.options.max_num_seqs_for`)."""
        seqs, auto = self._max_num_seqs(config, batched_tokens, factor)
        return {"max_num_batched_tokens": batched_tokens, "max_num_seqs": seqs,
                "max_num_seqs_factor": factor, "max_num_seqs_auto": auto}  # fmt: skip

    def auto_seqs(self, config: HybridConfig) -> int:
        """The most sequences of the workload's mean length that ``config``'s cache holds at once under the
        budget, at most ``MAX_NUM_SEQS_CAP``: the engine's own default ``max_num_seqs``
        (:func:`~kvtune.engine.options.max_num_seqs_for`), so a config that stores more tokens per byte runs
        larger batches."""
        return self._max_num_seqs(config)[1]

    def _max_num_seqs(
        self, config: HybridConfig, batched_tokens: int | None = None, factor: float = 1.0
    ) -> tuple[int, int]:
        """:func:`~kvtune.engine.options.max_num_seqs_for` at the workload's mean length under the budget."""
        if self.shape is None:
            raise ValueError("SearchSpace: the engine knobs need the model's KV shape")
        length = self.workload.mean_length or self.workload.length_pctl
        budget = self.kv_budget_bytes
        return max_num_seqs_for(config, self.shape, budget, length, batched_tokens, factor=factor)

    def knob_params(self, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The parameters that make :meth:`suggest_knobs` return ``knobs`` (default: the default knobs);
        {} when the space does not search them."""
        if not self.batched_tokens:
            return {}
        default = self.batched_tokens[len(self.batched_tokens) // 2]  # 8192 on a GPU, vLLM's usual
        knobs = knobs or {}
        tokens = int(knobs.get("max_num_batched_tokens", default))
        factor = float(knobs.get("max_num_seqs_factor", DEFAULT_SEQS_FACTOR))
        if tokens not in self.batched_tokens or factor not in self.seqs_factors:
            raise ValueError(
                f"engine knobs {knobs} are outside the {self.card} space: max_num_batched_tokens one of "
                f"{list(self.batched_tokens)}, max_num_seqs_factor one of {list(self.seqs_factors)}"
            )
        return {"max_num_batched_tokens": tokens, "max_num_seqs_factor": factor}

    def distributions(self) -> dict[str, BaseDistribution]:
        """Every parameter the space can ask for (conditional ones included)."""
        d: dict[str, BaseDistribution] = {
            "quantization_bits": CategoricalDistribution(self.bits),
            "block_size": CategoricalDistribution(self.block_sizes),
            "hot_tokens_log2": IntDistribution(_log2(self.hot_tokens[0]), _log2(self.hot_tokens[-1])),
        }
        if self.batched_tokens:
            d["max_num_batched_tokens"] = CategoricalDistribution(self.batched_tokens)
            d["max_num_seqs_factor"] = CategoricalDistribution(self.seqs_factors)
        if self.real_weights:
            d["sparse_blocks"] = IntDistribution(0, MAX_SPARSE_BLOCKS)
            d["migration_throttling"] = CategoricalDistribution((False, True))
            d["migration_interval"] = IntDistribution(*MIGRATION_INTERVAL_RANGE, log=True)
            d["migration_threshold_ms"] = FloatDistribution(*MIGRATION_THRESHOLD_MS_RANGE, log=True)
        return d

    def fixed(self) -> dict[str, Any]:
        """Config fields the space does not search, with their values."""
        fixed: dict[str, Any] = {"kv_cache_debug": False, "max_migrations_per_step": None}
        return fixed if self.real_weights else {**TIER_FIXED, **fixed}

    def space_fingerprint(self) -> str:
        """A short hash of the distributions and fixed values: equal hashes ask the same questions."""
        payload = {
            "version": SPACE_VERSION,
            "distributions": {k: distribution_to_json(v) for k, v in sorted(self.distributions().items())},
            "fixed": self.fixed(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def check_fingerprint(self, stored: str | None, study: str) -> None:
        """Raise ``ValueError`` if a study created with another space (``stored``) is reused."""
        if stored is not None and stored != self.space_fingerprint():
            raise ValueError(
                f"study {study!r} was created with search space {stored}, but this run's space is "
                f"{self.space_fingerprint()} (its parameters or their ranges differ); use another --study"
            )

    # ---- known points ------------------------------------------------------------------------------
    def params_for(self, config: HybridConfig) -> dict[str, Any]:
        """The parameters that make :meth:`suggest` return ``config``; ``ValueError`` if it is outside."""
        self._check_inside(config)
        params: dict[str, Any] = {
            "quantization_bits": config.quantization_bits,
            "block_size": config.block_size,
            "hot_tokens_log2": _log2(config.hot_tokens),
        }
        if self.real_weights:
            params.update(_tier_params(config))
        return params

    def _check_inside(self, config: HybridConfig) -> None:
        checks = (
            ("quantization_bits", config.quantization_bits, self.bits),
            ("block_size", config.block_size, self.block_sizes),
            ("hot_tokens", config.hot_tokens, self.hot_tokens),
        )
        for field, value, allowed in checks:
            if value not in allowed:
                raise ValueError(
                    f"{field}={value} is outside the {self.card} space: must be one of {allowed}"
                )
        if config.max_migrations_per_step is not None:
            raise ValueError(
                f"max_migrations_per_step={config.max_migrations_per_step} is outside the space: "
                "fixed at null"
            )
        if self.real_weights and config.sparse_blocks:
            _check_tier(config)
            return
        for field, value in TIER_FIXED.items():
            if getattr(config, field) != value:
                why = "sparse_top_k=0" if self.real_weights else "random weights"
                raise ValueError(
                    f"{field}={getattr(config, field)} is outside the space: fixed at {value} ({why})"
                )

    def default_configs(self) -> list[HybridConfig]:
        """The contract's default points that lie in this space (enqueue them first)."""
        out: list[HybridConfig] = []
        base = dict(DEFAULT_POINTS[0])
        for change in DEFAULT_POINTS:
            base.update(change)
            config = HybridConfig.from_dict({"kv_cache_strategy": "hybrid_v2", **base, **TIER_FIXED})
            if _inside(self, config):
                out.append(config)
        return out or [self._middle()]

    def warm_configs(self) -> list[HybridConfig]:
        """A config for each choice that gives a cache other kernels, for compiling ahead
        (:mod:`kvtune.engine.warm`): the default points first, then every bit width × block size at the
        smallest hot zone and at the largest (a hot zone's size reaches a compile-time value only through
        the zone's tile, a power of two it rounds up to, so those two cover every size between), and with
        the sparse tier searched, each of those with one and with two sparse blocks (a count of 1
        specializes), throttled and not."""
        out = [c for c in self.default_configs() if _inside(self, c)]
        tiers = [TIER_FIXED]
        if self.real_weights:
            tiers += [
                {"sparse_top_k": 1, "migration_throttling": False},
                {"sparse_top_k": 2, "migration_throttling": True},
            ]
        for hot in dict.fromkeys((self.hot_tokens[0], self.hot_tokens[-1])):
            for tier in tiers:
                for block in self.block_sizes:
                    for bits in self.bits:
                        fields = {**TIER_FIXED, **tier, "sparse_top_k": tier["sparse_top_k"] * block}
                        out.append(HybridConfig("hybrid_v2", hot, block, bits, **fields))
        return list(dict.fromkeys(out))

    def _middle(self) -> HybridConfig:
        pick = lambda xs: xs[len(xs) // 2]
        return HybridConfig(
            "hybrid_v2", pick(self.hot_tokens), pick(self.block_sizes), self.bits[-1], **TIER_FIXED
        )

    def _corners(self) -> list[dict[str, Any]]:
        return [
            {"kv_cache_strategy": "hybrid_v2", "hot_tokens": h, "block_size": b, "quantization_bits": q}
            for h in (self.hot_tokens[0], self.hot_tokens[-1])
            for b in self.block_sizes
            for q in self.bits
        ]

    # ---- showing -----------------------------------------------------------------------------------
    def describe(self) -> str:
        """Several lines: each parameter with its choices, the fixed fields, and the narrowing notes."""
        w = self.workload
        lines = [
            f"space {self.space_fingerprint()} for {self.card} / {self.model}: KV budget "
            f"{self.kv_budget_bytes / 2**30:.2f} GiB for {w.concurrency} x {w.length_pctl} tokens "
            f"(p{w.percentile:g}), max {w.max_length}",
        ]
        lines += [
            f"  {name:<24} {_show(d)}{MEANING.get(name, '')}" for name, d in self.distributions().items()
        ]
        lines += [f"  {name:<24} fixed at {json.dumps(v)}" for name, v in self.fixed().items()]
        if self.batched_tokens:
            length = w.mean_length or w.length_pctl
            hot, block = self.hot_tokens[0], self.block_sizes[0]
            fits = [self.auto_seqs(HybridConfig("hybrid_v2", hot, block, q)) for q in self.bits]
            holds = ", ".join(f"{q}-bit {n}" for q, n in zip(self.bits, fits))
            lines.append(
                f"  engine knobs: max_num_seqs = factor x the sequences of {length} tokens (mean) the budget "
                f"holds (hot {hot}, block {block}: {holds}), at most {MAX_NUM_SEQS_CAP} and "
                "max_num_batched_tokens"
            )
        if not self.real_weights:
            lines.append("  tier parameters are fixed: random weights give meaningless attention")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---- the memory rule --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Fit:
    shape: ModelKVShape
    workload: WorkloadStats
    budget: int

    def __call__(self, bits: int, block: int, hot: int) -> bool:
        """Do ``concurrency`` sequences of the percentile length fit a cache of this budget with that many
        slots, and one of the maximum length alone?"""
        config = HybridConfig("hybrid_v2", hot, block, bits)
        w = self.workload
        if self.budget < hot_bytes_per_seq(config, self.shape):
            return False
        together = cache_layout(config, self.shape, self.budget, max_seqs=w.concurrency)
        alone = cache_layout(config, self.shape, self.budget, max_seqs=1)
        return (
            together.max_sequences(w.length_pctl) >= w.concurrency and alone.max_sequences(w.max_length) >= 1
        )


def _hot_choices(workload: WorkloadStats) -> list[int]:
    """Powers of two from 16 up to half the percentile length (a hot zone longer than that leaves almost
    nothing to quantize), within the contract's range."""
    lo, hi = HOT_TOKENS_RANGE
    cap = min(hi, max(lo, workload.length_pctl // 2))
    return [2**e for e in range(_log2(lo), _log2(cap) + 1) if 2**e <= cap]


Choices = tuple[int, ...]


def _narrow(card: Card, workload: WorkloadStats, fit: _Fit) -> tuple[Choices, Choices, Choices, list[str]]:
    hot, blocks = _hot_choices(workload), list(card.block_sizes)
    all_fit = lambda q, hs, bs: all(fit(q, b, h) for h in hs for b in bs)
    bits = [q for q in BITS if any(fit(q, b, h) for h in hot for b in blocks)]
    if not bits:
        raise ValueError(
            f"card {card.id}: {workload.concurrency} x {workload.length_pctl} tokens "
            f"(max {workload.max_length}) do not fit the KV budget of {fit.budget / 2**30:.2f} GiB at any "
            "bit width; lower the concurrency or raise the budget"
        )
    notes: list[str] = [f"bits {q} dropped: no point fits the budget" for q in BITS if q not in bits]
    for q in COST_ORDER:
        if q in bits and len(bits) > 1 and not all_fit(q, hot, blocks):
            bits.remove(q)
            notes.append(f"bits {q} dropped: not every hot/block choice fits the budget")
    while len(hot) > 1 and not all(all_fit(q, hot, blocks) for q in bits):
        notes.append(f"hot_tokens {hot.pop()} dropped: does not fit the budget")
    kept = [b for b in blocks if all(all_fit(q, hot, [b]) for q in bits)]
    notes += [f"block_size {b} dropped: does not fit the budget" for b in blocks if b not in kept]
    if not kept:
        raise ValueError(f"card {card.id}: no block size fits the KV budget with hot_tokens={hot}")
    return tuple(bits), tuple(kept), tuple(hot), notes


# ---- helpers ----------------------------------------------------------------------------------------
def _log2(n: int) -> int:
    return n.bit_length() - 1


def _tier_params(config: HybridConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"sparse_blocks": config.sparse_blocks}
    if config.sparse_blocks:
        params["migration_throttling"] = config.migration_throttling
        params["migration_interval"] = config.migration_interval
        params["migration_threshold_ms"] = float(config.migration_threshold_ms)
    return params


def _check_tier(config: HybridConfig) -> None:
    ranges = (
        ("sparse_blocks", config.sparse_blocks, (1, MAX_SPARSE_BLOCKS)),
        ("migration_interval", config.migration_interval, MIGRATION_INTERVAL_RANGE),
        ("migration_threshold_ms", config.migration_threshold_ms, MIGRATION_THRESHOLD_MS_RANGE),
    )
    for field, value, (lo, hi) in ranges:
        if not lo <= value <= hi:
            raise ValueError(f"{field}={value} is outside the space: must lie in [{lo}, {hi}]")


def _inside(space: SearchSpace, config: HybridConfig) -> bool:
    try:
        space.params_for(config)
    except ValueError:
        return False
    return True


def _show(d: BaseDistribution) -> str:
    if isinstance(d, CategoricalDistribution):
        return f"one of {list(d.choices)}"
    if isinstance(d, IntDistribution | FloatDistribution):
        return f"{type(d).__name__[:-12].lower()} in [{d.low}, {d.high}]{' (log)' if d.log else ''}"
    return repr(d)
