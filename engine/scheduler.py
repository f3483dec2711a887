"""Continuous batching under the KV budget: admission, preemption by recompute, refusal, prefix reuse.

The scheduler decides *which* sequences run; the engine runs them. Every engine iteration:

1. :meth:`Scheduler.admit` takes waiting sequences in arrival order (a preempted sequence goes back to the
   front) while the cache can hold their prompt (``cache.can_allocate``), the batch has room and the prompt
   tokens still to prefill fit in ``max_prefill_tokens`` (the first one always may, when nothing is
   pending). A sequence whose whole life (prompt + output) could not fit even in an empty cache
   (``cache.fits_ever``) is refused, never retried. Admission registers the sequence with the cache
   (``cache.add_sequence``), which reuses shared prefix blocks and says how many prompt tokens are already
   cached; the engine prefills only the rest.
2. :meth:`Scheduler.prefill_chunks` hands out this iteration's prefill work: at most ``max_prefill_tokens``
   prompt tokens, in admission order, a long prompt split into chunks over several iterations (chunked
   prefill: decode steps go on between its chunks).
3. :meth:`Scheduler.schedule_decode` makes sure the next decode step (one token per running sequence) has
   the blocks it needs: while ``cache.blocks_needed_for_step`` exceeds ``cache.blocks_free``, the newest
   running sequence (latest arrival) is preempted: its cache entry is freed and it waits to be recomputed
   (prompt + tokens generated so far, prefilled again, its shared blocks likely still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvtune.engine.traces import Request


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: running sequences, and prompt tokens prefilled per engine iteration.

    ``max_prefill_tokens`` bounds the prefill work between two decode steps (prompts longer than that are
    prefilled in chunks), so neither a burst of arrivals nor one long prompt stalls the running sequences
    for long.
    """

    max_batch: int = 256
    max_prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"`max_batch >= 1` must hold, but got max_batch={self.max_batch}")
        if self.max_prefill_tokens < 1:
            raise ValueError(
                f"`max_prefill_tokens >= 1` must hold, but got max_prefill_tokens={self.max_prefill_tokens}"
            )


@dataclass
class Sequence:
    """The engine's state of one request: its prompt, the tokens generated so far and when they came out."""

    request: Request
    prompt: list[int]
    arrival_ms: float
    output: list[int] = field(default_factory=list)
    token_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    prefill_target: int = 0  # tokens to prefill since the last admission (prompt + output so far)
    prefilled: int = 0  # of those, already in the cache

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def seq_id(self) -> int:
        return self.request.rid

    @property
    def tokens(self) -> list[int]:
        """What a (re)computing prefill feeds: the prompt and every token generated so far."""
        return self.prompt + self.output

    @property
    def max_kv_tokens(self) -> int:
        """K/V entries the sequence holds at its end (the last output token is never fed back)."""
        return len(self.prompt) + self.request.output_length - 1

    @property
    def done(self) -> bool:
        return len(self.output) >= self.request.output_length

    @property
    def next_position(self) -> int:
        """Position of the token the next decode step feeds (the newest output token)."""
        return len(self.prompt) + len(self.output) - 1


@dataclass(frozen=True)
class Admission:
    """A sequence just registered with the cache; ``cached_tokens`` of its tokens need no prefill."""

    seq: Sequence
    cached_tokens: int


class Scheduler:
    """Waiting queue + running batch over one cache (see the module docstring for the policy)."""

    def __init__(self, cache: Any, config: SchedulerConfig | None = None) -> None:
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.refused: list[Sequence] = []
        self.preemptions = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        """A request arrived."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, now_ms: float | None = None) -> list[Admission]:
        """Register waiting sequences (FIFO) with the cache while they fit; refuse the ones that never can.

        ``now_ms`` (engine clock) is the ``last_access`` the cache gives the blocks their prefill seals.
        """
        admitted: list[Admission] = []
        pending = sum(s.prefill_target - s.prefilled for s in self.running)
        budget = self.config.max_prefill_tokens - pending
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            if not self.cache.fits_ever(seq.max_kv_tokens):
                self.refused.append(self.waiting.popleft())
                continue
            tokens = seq.tokens
            if ((admitted or pending) and len(tokens) > budget) or not self.cache.can_allocate(
                len(tokens), tokens
            ):
                break
            self.waiting.popleft()
            cached = int(self.cache.add_sequence(seq.seq_id, tokens, now_ms=now_ms))
            assert 0 <= cached < len(tokens), f"prefix hit {cached} must be in [0, {len(tokens)})"
            seq.prefill_target, seq.prefilled = len(tokens), cached
            self.running.append(seq)
            self.prompt_tokens += len(tokens)
            self.prefix_hit_tokens += cached
            budget -= len(tokens) - cached
            admitted.append(Admission(seq, cached))
        if self.waiting and not self.running:
            # An empty cache that cannot take the head sequence never will: refuse it rather than wait.
            self.refused.append(self.waiting.popleft())
        return admitted

    def prefill_chunks(self) -> list[tuple[Sequence, int]]:
        """This iteration's prefill work: (sequence, tokens) in admission order, ``max_prefill_tokens`` in
        all."""
        budget, work = self.config.max_prefill_tokens, []
        for seq in self.running:
            if seq.prefilling and budget > 0:
                n = min(budget, seq.prefill_target - seq.prefilled)
                work.append((seq, n))
                budget -= n
        return work

    def schedule_decode(self) -> list[Sequence]:
        """The running sequences that decode next (their prefill is done), after preempting the newest running
        ones until the step fits."""
        while self.running:
            ready = [s for s in self.running if not s.prefilling]
            if self.cache.blocks_needed_for_step([s.seq_id for s in ready]) <= self.cache.blocks_free():
                return ready
            victim = max(self.running, key=lambda s: (s.arrival_ms, s.seq_id))
            self.running.remove(victim)
            self.cache.free_sequence(victim.seq_id)
            if not self.running:
                # Alone and still short of blocks: it can never finish here (fits_ever said otherwise only
                # if the cache's estimate was optimistic); refuse rather than loop.
                self.refused.append(victim)
                return []
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
        return []

    def finish(self, seq: Sequence) -> None:
        """A sequence produced its last token: free its cache entry (shared blocks stay cached)."""
        self.running.remove(seq)
        self.cache.free_sequence(seq.seq_id)
