"""The aggregation probe: recall of several key → value pairs spread over a long context.

A needle test (passkey) asks for one span of the context, and top-k attention passes it once the selection
finds that span. A task that aggregates many parts of the context needs another selection at almost every
step. The probe writes :data:`AGGREGATION_PAIRS` facts (``The code for apple is 4821.``) at depths spread
over real text, ``length`` tokens in all, then asks every one back in another order and feeds the answers
teacher-forced through the cache by decode steps (12 tokens a fact with SmolLM2's tokenizer: the recall
section is ~80 decode steps, the probe's cost). A pair is recalled when each token of its value is the
model's top-1 prediction (the value's earlier tokens given); the mean negative log-likelihood of the value
tokens is reported too. The config's cache and the unquantized one run in lockstep (the windows' pair of
caches), so the base rate is measured on the same prompts.

The prompts of a probe have equal lengths (the same names, values of one token count) and are decoded as
one batch. As for the passkey, the end of the context is fed by decode steps: with a sparse tier, enough of
them for the first tier plan after unattended blocks pass the demotion threshold, so the answers are read
through L1 + Quest-selected L2 blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

AGGREGATION_PAIRS = 6
AGGREGATION_PROMPTS = 2
NAMES = ("apple", "river", "candle", "tiger", "violin", "harbor", "maple", "rocket", "saddle", "meadow",
         "copper", "lantern", "falcon", "orchid", "pepper", "glacier")  # fmt: skip
FACT_HEAD = "The code for {name} is"
FACT_TAIL = ".\n"
RECALL = "\nThe codes again:\n"
Tokenize = Callable[[str], list[int]]


class CachePair(Protocol):
    """The config's cache and the unquantized one fed in lockstep (``engine.quality``'s windows pair)."""

    def prefill(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def decode(self, tokens: Sequence[int], position: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class AggregationPrompt:
    """One prompt: its tokens (context, then the recall section), where the recall section starts, and the
    ``[start, end)`` positions of each value in the recall section."""

    tokens: list[int]
    context: int
    values: list[tuple[int, int]]


@dataclass(frozen=True)
class AggregationScore:
    """Pairs recalled (share) and mean negative log-likelihood per value token, config and base."""

    rate: float
    base_rate: float
    nll: float
    base_nll: float


def _fact(tokenize: Tokenize, name: str, value: str) -> tuple[list[int], int, int]:
    """A fact's tokens, pieces tokenized apart (the same tokens in the context and in the recall section),
    and the value's ``[start, end)`` within them."""
    head, val = tokenize(FACT_HEAD.format(name=name)), tokenize(f" {value}")
    return head + val + tokenize(FACT_TAIL), len(head), len(head) + len(val)


def _values(tokenize: Tokenize, rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct 4-digit values with as many tokens each as `` 1000``."""
    want, out = len(tokenize(" 1000")), list[str]()
    while len(out) < n:
        v = str(int(rng.integers(1000, 10_000)))
        if v not in out and len(tokenize(f" {v}")) == want:
            out.append(v)
    return out


def aggregation_prompt(
    tokenize: Tokenize, filler: Sequence[int], bos: int | None, length: int, pairs: int, seed: int
) -> AggregationPrompt:
    """A context of exactly ``length`` tokens (BOS, ``filler`` with ``pairs`` facts at spread depths), then
    the recall section (:data:`RECALL`, the facts in a shuffled order)."""
    if not 1 <= pairs <= len(NAMES):
        raise ValueError(f"`1 <= pairs <= {len(NAMES)}` must hold, but got pairs={pairs}")
    rng = np.random.default_rng(seed)
    facts = [_fact(tokenize, n, v) for n, v in zip(NAMES[:pairs], _values(tokenize, rng, pairs), strict=True)]
    head = [] if bos is None else [bos]
    room = length - len(head) - sum(len(f[0]) for f in facts)
    if room < pairs:
        raise ValueError(f"an aggregation prompt of {length} tokens has no room for {pairs} facts and filler")
    text = (list(filler) * (room // max(1, len(filler)) + 1))[:room]
    jitter = rng.uniform(-0.25, 0.25, pairs)
    cuts = [min(room, max(0, round(room * (k + 0.5 + jitter[k]) / pairs))) for k in range(pairs)]
    tokens, at = list(head), 0
    for (ids, _, _), cut in zip(facts, cuts, strict=True):
        tokens += text[at:cut] + ids
        at = cut
    tokens += text[at:]
    context = len(tokens)
    tokens += tokenize(RECALL)
    values = []
    for k in rng.permutation(pairs).tolist():
        ids, lo, hi = facts[k]
        values.append((len(tokens) + lo, len(tokens) + hi))
        tokens += ids
    return AggregationPrompt(tokens, context, values)


def min_aggregation_length(tokenize: Tokenize, pairs: int = AGGREGATION_PAIRS) -> int:
    """The shortest context worth the name: twice the facts' tokens (as much filler as facts)."""
    facts = [_fact(tokenize, n, "1000")[0] for n in NAMES[:pairs]]
    return 2 * sum(len(f) for f in facts) + 1


class _Tally:
    """Per prompt: each value token's top-1 hit and negative log-likelihood, config and base."""

    def __init__(self, prompts: Sequence[AggregationPrompt]) -> None:
        self.prompts = prompts
        self.hits: list[list[dict[int, bool]]] = [[{}, {}] for _ in prompts]
        self.nll: list[float] = [0.0, 0.0]
        self.count = 0

    def add(self, pos: int, logits: torch.Tensor, base: torch.Tensor) -> None:
        """The logits [num_prompts, V] after feeding position ``pos`` (they predict position ``pos + 1``)."""
        for i, p in enumerate(self.prompts):
            target = p.tokens[pos + 1]
            if not any(lo <= pos + 1 < hi for lo, hi in p.values):
                continue
            for side, rows in enumerate((logits, base)):
                row = rows[i].double()
                self.hits[i][side][pos + 1] = int(row.argmax()) == target
                self.nll[side] -= float(row.log_softmax(-1)[target])
            self.count += 1

    def score(self) -> AggregationScore:
        rates = [
            float(np.mean([all(h[side][t] for t in range(lo, hi)) for p, h in zip(self.prompts, self.hits)
                           for lo, hi in p.values]))
            for side in (0, 1)
        ]  # fmt: skip
        n = max(1, self.count)
        return AggregationScore(rates[0], rates[1], self.nll[0] / n, self.nll[1] / n)


def aggregation_prompts(
    tokenize: Tokenize, text_ids: Sequence[int], bos: int | None, length: int, prompts: int, pairs: int
) -> list[AggregationPrompt]:
    """``prompts`` prompts of ``length`` context tokens, each with filler from another part of the text."""
    stride = max(1, len(text_ids) // prompts)
    return [
        aggregation_prompt(tokenize, list(text_ids[i * stride :]) + list(text_ids[: i * stride]), bos, length,
                           pairs, seed=i)
        for i in range(prompts)
    ]  # fmt: skip


def run_probe(
    pair: CachePair, prompts: Sequence[AggregationPrompt], forced: int, tick: Callable[[], None]
) -> AggregationScore:
    """Feed ``prompts`` (one batch) through ``pair`` (the quality module's pair of caches): prefill the
    context but its last ``forced`` tokens, decode the rest teacher-forced, score the values."""
    tokens = [p.tokens for p in prompts]
    split = prompts[0].context - forced
    shapes = {(len(t), p.context) for t, p in zip(tokens, prompts, strict=True)}
    assert len(shapes) == 1, f"the prompts of one batch differ in (length, context): {shapes}"
    pair.prefill([t[:split] for t in tokens])
    tally = _Tally(prompts)
    for pos in range(split, len(tokens[0]) - 1):
        logits, base = pair.decode([t[pos] for t in tokens], pos)
        tally.add(pos, logits, base)
        tick()
    return tally.score()


def probe_steps(prompts: Sequence[AggregationPrompt], forced: int) -> int:
    """Decode steps :func:`run_probe` takes."""
    return len(prompts[0].tokens) - 1 - (prompts[0].context - forced)


__all__ = [
    "AGGREGATION_PAIRS",
    "AGGREGATION_PROMPTS",
    "AggregationPrompt",
    "AggregationScore",
    "CachePair",
    "aggregation_prompt",
    "aggregation_prompts",
    "min_aggregation_length",
    "probe_steps",
    "run_probe",
]
