"""What a cache configuration costs in quality, measured (docs/DESIGN.md §2).

A model runs teacher-forced over windows of real text: each window is a prefill of ``prefill_tokens``
tokens, then ``decode_tokens`` tokens decoded one by one through the hybrid cache; the baseline is the
unquantized cache (``config.unquantized()``: same hot zone and block size, nothing quantized, no sparse
tier), whose logits over a teacher-forced window are those of one dense causal forward over it: it keeps
every key and value in the model's precision, so its decode steps attend to exactly the keys and values a
causal forward does and differ from it only in the order of their sums (:func:`baseline_logits`, computed
once per model and windows, so a study's trials share it). Every prompt a cache is given here (the windows',
the passkey prompts, the aggregation probe's) is prefilled from a dense forward's keys and values, which a
one-chunk prefill through any config's cache computes alike (a prompt attends only to its own keys and
values, unquantized): each cache takes them as its prefill would (sealed, quantized) without the model
running over the prompt again (:func:`prompt_kv`). Per decoded token: KL(base ‖ config) of the
next-token distributions, whether the top-1 tokens agree, and the negative log likelihood of the true next
token under each (→ perplexities). The cache's debug statistics give the share of attention on cold (L1 +
L2) and on L2 blocks. Time is virtual: decode step ``i`` happens at ``i × step_ms``, so tier decisions, and
hence the result, depend only on the inputs (memo-friendly).

The passkey check hides a 5-digit number at 10 depths in filler text of ``prefill_tokens / 2`` to
``2 × prefill_tokens`` tokens (1-4K at the default 2,048), then greedy-decodes the answer; the unquantized
cache's pass rate is reported beside the config's. The end of each prompt is fed by decode steps: with a
sparse tier, enough of them (virtual time) for the first tier plan after unattended blocks pass the demotion
threshold (``1.5 × threshold``), so the answer is read through L1 + Quest-selected L2 blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtune.cache_impl.config import HybridConfig
from kvtune.cache_impl.hybrid_cache import HybridCache
from kvtune.cache_impl.layout import hot_bytes_per_seq, kv_bytes_for
from kvtune.cache_impl.tiers import threshold_ms
from kvtune.engine.aggregation import (
    AGGREGATION_PAIRS,
    AGGREGATION_PROMPTS,
    AggregationPrompt,
    aggregation_prompts,
    min_aggregation_length,
    probe_steps,
    run_probe,
)
from kvtune.engine.options import check_quality_args

Progress = Callable[[int, int], None]
PASSKEY_DEPTHS = 10
PASSKEY_ANSWER_TOKENS = 8
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
_SEQ = 0  # the one sequence id of each single-sequence cache
KV = list[tuple[torch.Tensor, torch.Tensor]]  # a prompt's keys and values, per layer
# each model's baseline logits by windows (baseline_logits); a few settings at most
_BASELINES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)
_BASELINES_KEPT = 4
# each model's prompts' keys and values (prompt_kv), on the CPU; the least recently used go past the bound
_PROMPT_KV: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[int, ...], KV]] = weakref.WeakKeyDictionary()
PROMPT_KV_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class QualityResult:
    """The quality of one configuration on one text (see the module docstring)."""

    mean_kl: float
    max_kl: float
    top1_agreement: float
    ppl: float
    ppl_base: float
    ppl_change_pct: float
    cold_attention_share: float
    l2_attention_share: float
    passkey_rate: float | None
    passkey_base_rate: float | None
    windows: int
    prefill_tokens: int
    decode_tokens: int
    step_ms: float
    text_sha256: str
    config: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    # the aggregation probe (engine/aggregation.py), None where skipped: pairs recalled, NLL per value token
    aggregation_rate: float | None = None
    aggregation_base_rate: float | None = None
    aggregation_nll: float | None = None
    aggregation_base_nll: float | None = None
    aggregation_facts: int | None = None  # pairs asked back: prompts × AGGREGATION_PAIRS

    def to_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


@dataclass
class _Totals:
    """Sums over every decoded token of every window."""

    tokens: int = 0
    kl: float = 0.0
    max_kl: float = 0.0
    agree: int = 0
    nll: float = 0.0
    nll_base: float = 0.0
    cold_share: list[float] = field(default_factory=list)
    l2_share: list[float] = field(default_factory=list)

    def add_step(self, logits: torch.Tensor, base: torch.Tensor, target: int) -> None:
        """logits, base [V] float32: one decoded token's next-token logits under the config and the base."""
        lp, lq = base.double().log_softmax(-1), logits.double().log_softmax(-1)
        kl = float((lp.exp() * (lp - lq)).sum())
        self.tokens += 1
        self.kl += kl
        self.max_kl = max(self.max_kl, kl)
        self.agree += int(int(logits.argmax()) == int(base.argmax()))
        self.nll -= float(lq[target])
        self.nll_base -= float(lp[target])


# ------------------------------------------------------------------------------------------------ public


def measure_quality(
    loaded: Any,
    config: HybridConfig,
    text: str,
    windows: int = 8,
    prefill_tokens: int = 2048,
    decode_tokens: int = 512,
    step_ms: float = 50.0,
    passkey: bool = True,
    progress: Progress | None = None,
    aggregation: bool = False,
    aggregation_prompts: int = AGGREGATION_PROMPTS,
) -> QualityResult:
    """Measure ``config`` against ``config.unquantized()`` on ``text`` (see the module docstring);
    ``aggregation``: also the aggregation probe (:mod:`kvtune.engine.aggregation`) on the same text, with
    ``aggregation_prompts`` prompts of :data:`~kvtune.engine.aggregation.AGGREGATION_PAIRS` pairs each."""
    check_quality_args(windows, prefill_tokens, decode_tokens, step_ms)
    ids = text_token_ids(loaded, text)
    starts = window_starts(len(ids), windows, prefill_tokens + decode_tokens + 1)
    trials = []
    if passkey:
        min_length = passkey_min_length(loaded)
        trials = passkey_trials(config, prefill_tokens, loaded.spec.max_context, step_ms, min_length)
    probe = (
        aggregation_probe(loaded, config, ids, prefill_tokens, step_ms, aggregation_prompts)
        if aggregation
        else None
    )
    probe_total = probe_steps(*probe) if probe else 0
    ticker = _Ticker(progress, windows * decode_tokens + sum(t.steps for t in trials) + probe_total)
    totals = _Totals()
    windows_ids = [_window_ids(loaded, ids, s, prefill_tokens + decode_tokens + 1) for s in starts]
    _measure_windows(loaded, config, windows_ids, prefill_tokens, step_ms, totals, ticker)
    rates = _passkey_rates(loaded, config, trials, step_ms, ticker) if passkey else (None, None)
    shape = (windows, prefill_tokens, decode_tokens, step_ms)
    result = _result(loaded, config, text, totals, rates, shape)
    if probe is None:
        return result
    pair = _Pair(loaded, config, len(probe[0][0].tokens), step_ms, num_seqs=len(probe[0]))
    score = run_probe(pair, probe[0], probe[1], ticker.tick)
    return dataclasses.replace(
        result,
        aggregation_rate=score.rate,
        aggregation_base_rate=score.base_rate,
        aggregation_nll=score.nll,
        aggregation_base_nll=score.base_nll,
        aggregation_facts=len(probe[0]) * AGGREGATION_PAIRS,
    )


def aggregation_probe(
    loaded: Any,
    config: HybridConfig,
    text_ids: Sequence[int],
    prefill_tokens: int,
    step_ms: float,
    prompts: int = AGGREGATION_PROMPTS,
) -> tuple[list[AggregationPrompt], int]:
    """The aggregation probe's prompts (contexts of ``prefill_tokens`` tokens, at least
    :func:`~kvtune.engine.aggregation.min_aggregation_length`, filler from ``text_ids``) and how many of the
    context's last tokens are fed by decode steps (as for the passkey: :func:`passkey_forced_steps`)."""
    tokenize = lambda s: text_token_ids(loaded, s)
    length = max(prefill_tokens, min_aggregation_length(tokenize))
    if prompts < 1:
        raise ValueError(f"`aggregation_prompts >= 1` must hold, but got aggregation_prompts={prompts}")
    built = aggregation_prompts(
        tokenize, text_ids, loaded.spec.bos_token_id, length, prompts, AGGREGATION_PAIRS
    )
    if len(built[0].tokens) > loaded.spec.max_context:
        raise ValueError(
            f"the aggregation probe needs {len(built[0].tokens)} tokens, but the model's context allows "
            f"{loaded.spec.max_context}: use a smaller prefill"
        )
    return built, passkey_forced_steps(config, length, step_ms)


def text_token_ids(loaded: Any, text: str) -> list[int]:
    """The model's tokens of ``text``; without a tokenizer (random weights): UTF-8 bytes modulo the vocab."""
    if loaded.tokenizer is not None:
        return list(loaded.tokenizer.encode(text))
    vocab = loaded.spec.vocab_size
    return [b % vocab for b in text.encode("utf-8")]


def window_starts(num_tokens: int, windows: int, window_tokens: int) -> list[int]:
    """Start offsets of ``windows`` non-overlapping windows spread evenly over ``num_tokens`` tokens."""
    if num_tokens < windows * window_tokens:
        raise ValueError(
            f"the text has {num_tokens} tokens, but windows × (prefill_tokens + decode_tokens + 1) = "
            f"{windows} × {window_tokens} = {windows * window_tokens} are needed: give a longer text or "
            "smaller windows"
        )
    stride = num_tokens // windows
    return [i * stride for i in range(windows)]


# ------------------------------------------------------------------------------------------------ windows


def _window_ids(loaded: Any, ids: Sequence[int], start: int, length: int) -> list[int]:
    """``length`` tokens from ``start``, the first replaced by BOS when the model has one."""
    window = list(ids[start : start + length])
    bos = loaded.spec.bos_token_id
    return window if bos is None else [bos, *window[1:]]


def baseline_logits(loaded: Any, windows: Sequence[Sequence[int]], prefill_tokens: int) -> list[torch.Tensor]:
    """The unquantized cache's logits at each decoded position of each teacher-forced window, [decode_tokens,
    V] float32 per window: one dense causal forward over the window (see the module docstring), kept per
    model and windows. The same forward's keys and values of each window's prompt are kept for
    :func:`prompt_kv`."""
    model = loaded.model
    key = (prefill_tokens, tuple(tuple(w) for w in windows))
    kept = _BASELINES.setdefault(model, {})
    if key not in kept:
        rows = torch.arange(prefill_tokens, len(windows[0]) - 1, device=model.device)
        out = []
        for w in windows:
            layers: KV = []
            out.append(model.forward_dense(torch.tensor(list(w[:-1]), dtype=torch.long), rows, kv=layers))
            _keep_kv(model, tuple(w[:prefill_tokens]), layers)
        if len(kept) >= _BASELINES_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = out
    return kept[key]


def prompt_kv(loaded: Any, ids: Sequence[int]) -> KV:
    """The keys and values a prefill of ``ids`` writes to a cache, per layer ([len(ids), H, D], on the
    CPU): a dense causal forward's, kept per model (the most recently used, up to
    :data:`PROMPT_KV_MAX_BYTES`); a kept prompt that starts with ``ids`` serves them (causal: its first
    rows are theirs).

    A prompt prefilled in one chunk attends only to its own keys and values, in the model's precision,
    whatever the config, so they are the same for every config (up to the order of the attention's sums):
    each config's cache takes them as its prefill would (sealed into blocks, quantized, the rest in the hot
    zone) instead of the model running over the prompt again, and the config shows from the first decoded
    token on."""
    model, key = loaded.model, tuple(ids)
    kept = _PROMPT_KV.setdefault(model, OrderedDict())
    for other, layers in kept.items():
        if len(other) >= len(key) and other[: len(key)] == key:
            kept.move_to_end(other)
            return [(k[: len(key)], v[: len(key)]) for k, v in layers]
    layers = []
    none = torch.zeros(0, dtype=torch.long, device=model.device)  # no logits wanted
    model.forward_dense(torch.tensor(list(key), dtype=torch.long), none, kv=layers)
    return _keep_kv(model, key, layers)


def _keep_kv(model: Any, key: tuple[int, ...], layers: KV) -> KV:
    """CPU copies of a prompt's first ``len(key)`` keys and values, kept for :func:`prompt_kv`."""
    n = len(key)
    copies = [(k[:n].to("cpu", copy=True), v[:n].to("cpu", copy=True)) for k, v in layers]
    kept = _PROMPT_KV.setdefault(model, OrderedDict())
    kept[key] = copies
    size = lambda kv: sum(2 * k.numel() * k.element_size() for k, _ in kv)
    while len(kept) > 1 and sum(size(kv) for kv in kept.values()) > PROMPT_KV_MAX_BYTES:
        kept.popitem(last=False)
    if sum(size(kv) for kv in kept.values()) > PROMPT_KV_MAX_BYTES:
        kept.clear()  # one prompt above the bound: used once, not kept
    return copies


def single_sequence_cache(
    loaded: Any, config: HybridConfig, num_tokens: int, num_seqs: int = 1
) -> HybridCache:
    """A cache whose budget holds ``num_seqs`` sequences of ``num_tokens`` tokens (+ a spare block each).

    The layout lets hot zones take at most half the budget, so the budget is at least twice theirs.
    """
    shape = loaded.model.kv_shape
    needed = kv_bytes_for(config, shape, [num_tokens + config.block_size] * num_seqs)
    budget = max(needed, 2 * num_seqs * hot_bytes_per_seq(config, shape))
    return HybridCache(config, shape, budget, loaded.model.device, max_seqs=num_seqs)


class _Pair:
    """The config's cache and the unquantized one, fed the same tokens in lockstep on the virtual clock.

    Holds ``num_seqs`` sequences of equal length decoded as one batch (the text windows): each sequence only
    attends its own blocks and the load factor is the same for all, so batching changes no decision.
    ``base=False``: the config's cache alone (its baseline's logits come from :func:`baseline_logits`; the
    methods return None in their place).
    """

    def __init__(
        self,
        loaded: Any,
        config: HybridConfig,
        num_tokens: int,
        step_ms: float,
        num_seqs: int = 1,
        base: bool = True,
    ) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.device = loaded.model.device
        self.step_ms = step_ms
        self.steps = 0
        self.seqs = list(range(num_seqs))
        debug = config.replace(kv_cache_debug=True)
        self.cache = single_sequence_cache(loaded, debug, num_tokens, num_seqs)
        unquantized = config.unquantized()
        self.base = single_sequence_cache(loaded, unquantized, num_tokens, num_seqs) if base else None

    def _caches(self) -> list[HybridCache]:
        return [self.cache] if self.base is None else [self.cache, self.base]

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill each prompt into both caches, from its keys and values (:func:`prompt_kv`): what a prefill
        through the model leaves in them, without the model's pass."""
        for seq, ids in zip(self.seqs, prompts, strict=True):
            layers = [(k.to(self.device), v.to(self.device)) for k, v in prompt_kv(self.loaded, ids)]
            for cache in self._caches():
                cache.add_sequence(seq, list(ids))
                for layer, (k, v) in enumerate(layers):
                    cache.prefill(layer, seq, None, k, v)

    def prefill_through_model(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill each prompt into both caches through the model (what :meth:`prefill` stands for)."""
        for cache in self._caches():
            for seq, ids in zip(self.seqs, prompts, strict=True):
                cache.add_sequence(seq, list(ids))
                t = torch.tensor(list(ids), dtype=torch.long, device=self.device)
                self.model.prefill(cache, seq, t, 0, last_only=True)

    def decode(
        self, tokens: Sequence[int], position: int, base_tokens: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Feed ``tokens`` (the base: ``base_tokens``, default: the same) at ``position``.

        Returns the logits [num_seqs, V] under the config and the base.
        """
        self.steps += 1
        now = self.steps * self.step_ms
        pos = torch.full((len(self.seqs),), position, dtype=torch.long, device=self.device)
        out = []
        fed = (tokens, tokens if base_tokens is None else base_tokens)
        for cache, toks in zip(self._caches(), fed):
            plan = cache.begin_step(self.seqs, now)
            ids = torch.tensor(list(toks), dtype=torch.long, device=self.device)
            out.append(self.model.decode(cache, plan, ids, pos))
            cache.end_step(plan)
        return out[0], (out[1] if len(out) > 1 else None)

    def attention_shares(self) -> tuple[float, float]:
        """Mean share of attention on cold (L1 + L2) and on L2 blocks over the config's decode steps."""
        return attention_shares(self.cache.debug_stats())


def attention_shares(debug: dict[str, Any]) -> tuple[float, float]:
    """(cold, L2) attention shares from a cache's ``debug_stats()``."""
    l1, l2 = float(debug["l1_attention_share"]), float(debug["l2_attention_share"])
    return l1 + l2, l2


def _measure_windows(
    loaded: Any,
    config: HybridConfig,
    windows: Sequence[Sequence[int]],
    prefill_tokens: int,
    step_ms: float,
    totals: _Totals,
    ticker: _Ticker,
) -> None:
    """All windows (equal lengths) prefilled, then decoded teacher-forced as one batch through the config's
    cache; the baseline's logits from :func:`baseline_logits` (whose forward also gives the prompts' keys and
    values the prefill writes)."""
    base = baseline_logits(loaded, windows, prefill_tokens)
    pair = _Pair(loaded, config, len(windows[0]), step_ms, num_seqs=len(windows), base=False)
    pair.prefill([w[:prefill_tokens] for w in windows])
    for step, pos in enumerate(range(prefill_tokens, len(windows[0]) - 1)):
        logits, _ = pair.decode([w[pos] for w in windows], pos)
        for row, window in enumerate(windows):
            totals.add_step(logits[row], base[row][step], window[pos + 1])
        ticker.tick(len(windows))
    cold, l2 = pair.attention_shares()
    totals.cold_share.append(cold)
    totals.l2_share.append(l2)


# ------------------------------------------------------------------------------------------------ passkey


@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt: total length in tokens, depth of the key in [0, 1], the key, and how many of the
    prompt's last tokens are fed by decode steps (the rest is prefilled)."""

    length: int
    depth: float
    key: str
    forced: int

    @property
    def steps(self) -> int:
        return self.forced + PASSKEY_ANSWER_TOKENS


def passkey_trials(
    config: HybridConfig, prefill_tokens: int, max_context: int, step_ms: float, min_length: int = 64
) -> list[PasskeyTrial]:
    """10 depths × lengths spread over [prefill/2, 2·prefill] tokens (at least ``min_length``, at most the
    context less the answer), shuffled so depth and length are not tied."""
    limit = max_context - PASSKEY_ANSWER_TOKENS - 1
    lo = max(prefill_tokens // 2, min_length)
    if lo > limit:
        raise ValueError(f"a passkey prompt needs {lo} tokens, but the model's context allows {limit}")
    hi = max(min(2 * prefill_tokens, limit), lo)
    rng = np.random.default_rng(0)
    trials = []
    for i in range(PASSKEY_DEPTHS):
        length = lo + (hi - lo) * ((3 * i) % PASSKEY_DEPTHS) // (PASSKEY_DEPTHS - 1)
        key = str(int(rng.integers(10_000, 100_000)))
        forced = passkey_forced_steps(config, length, step_ms)
        trials.append(PasskeyTrial(length, i / (PASSKEY_DEPTHS - 1), key, forced))
    return trials


def passkey_forced_steps(config: HybridConfig, length: int, step_ms: float) -> int:
    """Prompt tokens fed by decode steps: 8 without a sparse tier; with one, up to the first tier plan after
    ``1.5 × threshold`` ms of virtual time (when unattended blocks become L2). At most half the prompt."""
    if not config.sparse_top_k:
        return min(8, length // 4)
    demote_steps = math.ceil(1.5 * threshold_ms(config, [length]) / step_ms)
    interval = config.migration_interval
    return min(length // 2, math.ceil(demote_steps / interval) * interval + 1)


def passkey_min_length(loaded: Any) -> int:
    """Shortest passkey prompt: BOS, the key sentence, the question and as much filler again."""
    key = len(text_token_ids(loaded, KEY_SENTENCE.format(key="12345")))
    return 1 + 2 * (key + len(text_token_ids(loaded, QUESTION)))


def passkey_prompt(loaded: Any, trial: PasskeyTrial) -> list[int]:
    """BOS + filler with the key sentence at ``depth`` + the question, ``trial.length`` tokens in all."""
    key_ids = text_token_ids(loaded, KEY_SENTENCE.format(key=trial.key))
    question = text_token_ids(loaded, QUESTION)
    bos = [] if loaded.spec.bos_token_id is None else [loaded.spec.bos_token_id]
    room = trial.length - len(bos) - len(key_ids) - len(question)
    if room < 0:
        raise ValueError(f"passkey length {trial.length} is too short for the key and the question")
    filler = text_token_ids(loaded, FILLER)
    filler = (filler * (room // len(filler) + 1))[:room]
    at = round(trial.depth * room)
    return bos + filler[:at] + key_ids + filler[at:] + question


def passkey_passed(loaded: Any, key: str, answer: Sequence[int]) -> bool:
    """Whether the greedy answer contains the key (as text, or as the key's token ids without a tokenizer)."""
    if loaded.tokenizer is not None:
        return key in loaded.tokenizer.decode(list(answer))
    want, got = text_token_ids(loaded, key), list(answer)
    return any(got[i : i + len(want)] == want for i in range(len(got) - len(want) + 1))


def _passkey_rates(
    loaded: Any, config: HybridConfig, trials: Sequence[PasskeyTrial], step_ms: float, ticker: _Ticker
) -> tuple[float, float]:
    passed = np.array([_passkey_trial(loaded, config, t, step_ms, ticker) for t in trials], dtype=np.float64)
    return float(passed[:, 0].mean()), float(passed[:, 1].mean())


def _passkey_trial(
    loaded: Any, config: HybridConfig, trial: PasskeyTrial, step_ms: float, ticker: _Ticker
) -> tuple[bool, bool]:
    prompt = passkey_prompt(loaded, trial)
    pair = _Pair(loaded, config, len(prompt) + PASSKEY_ANSWER_TOKENS, step_ms)
    split = len(prompt) - trial.forced
    assert trial.forced >= 1, "the answer's first token comes from a decode step"
    prompt_kv(loaded, prompt)  # the whole prompt's, so that every config's split is served from it
    pair.prefill([prompt[:split]])
    logits: tuple[torch.Tensor, Any] = (torch.zeros(0), None)
    for pos in range(split, len(prompt)):
        logits = pair.decode([prompt[pos]], pos)
        ticker.tick()
    answer, base_answer = [int(logits[0][0].argmax())], [int(logits[1][0].argmax())]
    for pos in range(len(prompt), len(prompt) + PASSKEY_ANSWER_TOKENS - 1):
        cfg, base = pair.decode([answer[-1]], pos, [base_answer[-1]])
        answer.append(int(cfg[0].argmax()))
        base_answer.append(int(base[0].argmax()))
        ticker.tick()
    ticker.tick()
    return passkey_passed(loaded, trial.key, answer), passkey_passed(loaded, trial.key, base_answer)


# ------------------------------------------------------------------------------------------------ result


class _Ticker:
    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def tick(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _result(
    loaded: Any,
    config: HybridConfig,
    text: str,
    t: _Totals,
    rates: tuple[float | None, float | None],
    shape: tuple[int, int, int, float],
) -> QualityResult:
    ppl, ppl_base = math.exp(t.nll / t.tokens), math.exp(t.nll_base / t.tokens)
    return QualityResult(
        mean_kl=t.kl / t.tokens,
        max_kl=t.max_kl,
        top1_agreement=t.agree / t.tokens,
        ppl=ppl,
        ppl_base=ppl_base,
        ppl_change_pct=(ppl / ppl_base - 1.0) * 100.0,
        cold_attention_share=float(np.mean(t.cold_share)),
        l2_attention_share=float(np.mean(t.l2_share)),
        passkey_rate=rates[0],
        passkey_base_rate=rates[1],
        windows=shape[0],
        prefill_tokens=shape[1],
        decode_tokens=shape[2],
        step_ms=shape[3],
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        config=config.to_dict(),
        model=loaded.spec.name,
    )
