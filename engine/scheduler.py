"""Continuous batching under the KV budget: admission, preemption by recompute, refusal, prefix reuse.

The scheduler decides *which* sequences run; the engine runs them. An engine iteration is one forward
(:class:`SchedulerConfig`, ``mixed``): the decode token of every running sequence whose prompt is done, plus
prompt chunks filling the rest of ``max_num_batched_tokens``. In it:

1. the decode rows must have the blocks their step seals: while ``cache.blocks_needed_for_step`` exceeds
   ``cache.blocks_free``, :meth:`Scheduler.preempt_newest` preempts the newest running sequence (latest
   arrival): its cache entry is freed and it waits, at the front of the queue, to be recomputed (prompt +
   tokens generated so far, prefilled again, its shared blocks likely still cached).
2. :meth:`Scheduler.admit` takes waiting sequences in arrival order while the cache can hold their prompt
   besides the blocks the decode rows reserve (``cache.can_allocate``), fewer than ``max_num_seqs`` run and
   prompt tokens are left in the iteration's budget. A sequence whose whole life (prompt + output) could not
   fit even in an empty cache (``cache.fits_ever``) is refused, never retried. Admission registers the
   sequence with the cache (``cache.add_sequence``), which reuses shared prefix blocks and says how many
   prompt tokens are already cached; the engine prefills only the rest.
3. :meth:`Scheduler.prefill_chunks` hands out the iteration's prompt work: the budget left by the decode
   rows, in admission order, a long prompt split into chunks over several iterations (chunked prefill), so
   a decode token waits at most one iteration behind a prompt.

With ``mixed=False`` (the engine before mixed iterations) an iteration is: admit (a whole prompt must fit the
budget, except the first when nothing is pending), prefill each chunk in its own forward, then one decode
step of every running sequence whose prompt is done (:meth:`Scheduler.schedule_decode`, preempting first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtune.engine.traces import Request

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CLOCKS = ("wall", "device", "gated")  # what a replay's clock counts (SchedulerConfig.clock)


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's options: batching limits, iteration shape, CUDA graphs (every replay records them).

    max_num_seqs: most sequences running at once (decoding or prefilling). None (the default): derived per
    replay from the KV budget and the cache layout, the number of sequences of the workload's mean length
    (prompt + output) whose hot zone and blocks the budget holds, capped at
    :data:`~kvtune.engine.options.MAX_NUM_SEQS_CAP`, the number of requests and ``max_num_batched_tokens``
    (:func:`~kvtune.engine.options.max_num_seqs_for` decides it); so a config that stores more tokens runs
    bigger batches. The cache allocates exactly that many hot-zone slots; the rest of the budget is blocks.
    max_num_batched_tokens: tokens of one iteration, decode tokens and prompt chunks together (default
    8192, as vLLM's chunked prefill on large GPUs; with ``mixed=False``, the prompt tokens prefilled between
    two decode steps, what ``max_prefill_tokens`` was). A smaller budget bounds how long a decode token waits
    behind a prompt (P99 TPOT) at some prefill throughput.
    graphs: decode-only iterations run the static decode step (:mod:`kvtune.engine.graphs`), replayed as
    CUDA graphs on CUDA, run directly on a CPU; False: the eager step (``--no-graphs``; debugging).
    ``kv_cache_debug`` configs always run eagerly.
    mixed: decode tokens and prompt chunks share one forward per iteration; False: prompts are prefilled in
    forwards of their own before each decode step (the engine as it was).
    clock: what the replay's clock counts, which decides when requests arrive and when tokens come out.
    ``"wall"`` (the default): host time, less graph captures. ``"device"``: each iteration's time on the
    device, from its start mark to its end mark (CUDA events on a GPU), added when the iteration completes;
    the host's time between iterations does not count, so which requests an iteration takes no longer depends
    on the host's jitter (:class:`kvtune.engine.engine.EngineClock`). An iteration launched op by op (a
    prompt chunk, a mixed iteration) still counts the gaps in which the device waits for the host's next
    launch, and the host's work before an iteration that starts on an idle device. ``"gated"``: the device
    clock with those taken out: such an iteration starts behind a gate, a sleep on the device a little longer
    than the host took to enqueue recent iterations, so its kernels run back to back from its start mark; an
    iteration whose gate opened before the host had enqueued it is counted (``gate_leaks``). The gates cost
    wall time (``gate_ms``), not clock time.
    piecewise: a forward with prompt tokens of at most 2,048 tokens runs its dense parts (projections, norms,
    MLP, RoPE) as CUDA graphs captured per token-count bucket, its attention eagerly between them
    (:mod:`kvtune.engine.piecewise`; on a CPU the same pieces run directly). False (the default): op by op,
    since the buckets' padding raises the unloaded TTFT a study's limits come from (6 %, docs/RESULTS.md,
    run 44).
    mixed_graphs: a forward with prompt tokens whose shapes fit runs whole as one CUDA graph per shape bucket,
    its attention and cache writes captured with the rest, from the shape's second use on
    (:mod:`kvtune.engine.mixed_graphs`; on a CPU the same function runs directly); needs ``graphs``. False
    (the default): as with ``piecewise``, the padding raises the unloaded TTFT (5.5 %, run 44).

    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    graphs: bool = True
    mixed: bool = True
    clock: str = "wall"
    piecewise: bool = False
    mixed_graphs: bool = False

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {list(CLOCKS)}, but got clock={self.clock!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"`max_num_seqs >= 1` must hold, but got max_num_seqs={self.max_num_seqs}")
        if self.mixed_graphs and not self.graphs:
            raise ValueError(
                "`mixed_graphs` (--mixed-graphs) needs `graphs` (no --no-graphs): its decode rows are staged "
                "as a static step"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                "`max_num_batched_tokens >= 1` must hold, but got "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if self.mixed and self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "`max_num_batched_tokens >= max_num_seqs` must hold with mixed iterations (every decode "
                f"token fits one iteration), but got max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"max_num_seqs={self.max_num_seqs}"
            )

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "graphs": self.graphs,
                "mixed": self.mixed,
                "clock": self.clock,
            }
            | (  # a record made before them compares equal
                {"piecewise": True} if self.piecewise else {}
            )
            | ({"mixed_graphs": True} if self.mixed_graphs else {})
        )


@dataclass
class Sequence:
    """The engine's state of one request: its prompt, the tokens generated so far and when they came out.

    While a sequence runs in the engine, ``output`` and ``token_ms`` may be views of the engine's per-slot
    arrays (:class:`kvtune.engine.outputs.RowView`); they read like lists."""

    request: Request
    prompt: list[int]
    arrival_ms: float
    output: Any = field(default_factory=list)  # list[int], or a read-only view while running
    token_ms: Any = field(default_factory=list)  # list[float], likewise
    preemptions: int = 0
    prefill_target: int = 0  # tokens to prefill since the last admission (prompt + output so far)
    prefilled: int = 0  # of those, already in the cache
    slot: int = -1  # the cache's hot-zone slot while admitted (engine)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def seq_id(self) -> int:
        return self.request.rid

    @property
    def tokens(self) -> list[int]:
        """What a (re)computing prefill feeds: the prompt and every token generated so far."""
        return self.prompt + list(self.output)

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
    """Waiting queue + running batch over one cache (see the module docstring for the policy).

    ``on_preempt(seq)`` is called for a preempted sequence before its cache entry is freed (the engine saves
    its outputs)."""

    def __init__(
        self,
        cache: Any,
        config: SchedulerConfig | None = None,
        on_preempt: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # running sequences admitted with prompt tokens left to prefill
        self.refused: list[Sequence] = []
        self.preemptions = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        """A request arrived."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(
        self,
        now_ms: float | None = None,
        budget: int | None = None,
        reserved_blocks: int = 0,
        partial: bool = False,
    ) -> list[Admission]:
        """Register waiting sequences (FIFO) with the cache while they fit; refuse the ones that never can.

        ``now_ms`` (engine clock) is the ``last_access`` the cache gives the blocks their prefill seals.
        ``budget``: prompt tokens this iteration may prefill (default ``max_num_batched_tokens``); the prompt
        work still pending comes out of it first. ``reserved_blocks`` stay free (the decode step's seals).
        ``partial``: admit while any budget is left (the first chunk of a prompt may be shorter than it);
        otherwise a whole prompt must fit the budget (except the first one when nothing is pending).
        """
        admitted: list[Admission] = []
        self._prune_prefilling()
        pending = sum(s.prefill_target - s.prefilled for s in self.prefilling)
        budget = (self.config.max_num_batched_tokens if budget is None else budget) - pending
        most = self.config.max_num_seqs
        while self.waiting and (most is None or len(self.running) < most):
            seq = self.waiting[0]
            if not self.cache.fits_ever(seq.max_kv_tokens):
                self.refused.append(self.waiting.popleft())
                continue
            tokens = seq.tokens
            over = budget <= 0 if partial else bool(admitted or pending) and len(tokens) > budget
            if over or not self.cache.can_allocate(len(tokens), tokens, reserved_blocks=reserved_blocks):
                break
            self.waiting.popleft()
            cached = int(self.cache.add_sequence(seq.seq_id, tokens, now_ms=now_ms))
            assert 0 <= cached < len(tokens), f"prefix hit {cached} must be in [0, {len(tokens)})"
            seq.prefill_target, seq.prefilled = len(tokens), cached
            self.running.append(seq)
            self.prefilling.append(seq)
            self.prompt_tokens += len(tokens)
            self.prefix_hit_tokens += cached
            budget -= len(tokens) - cached
            admitted.append(Admission(seq, cached))
        if self.waiting and not self.running:
            # An empty cache that cannot take the head sequence never will: refuse it rather than wait.
            self.refused.append(self.waiting.popleft())
        return admitted

    def prefill_chunks(self, budget: int | None = None) -> list[tuple[Sequence, int]]:
        """This iteration's prefill work: (sequence, tokens) in admission order, ``budget`` (default
        ``max_num_batched_tokens``) in all."""
        self._prune_prefilling()
        budget = self.config.max_num_batched_tokens if budget is None else budget
        work = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, seq.prefill_target - seq.prefilled)
            work.append((seq, n))
            budget -= n
        return work

    def _prune_prefilling(self) -> None:
        if any(not s.prefilling for s in self.prefilling):
            self.prefilling = [s for s in self.prefilling if s.prefilling]

    def preempt_newest(self) -> Sequence | None:
        """Preempt the newest running sequence (latest arrival) to free its blocks; returns it, or None when
        it was the last one running (then it is refused: alone, its step still found no block)."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: (s.arrival_ms, s.seq_id))
        self.running.remove(victim)
        if victim in self.prefilling:
            self.prefilling.remove(victim)
        if self.on_preempt is not None:
            self.on_preempt(victim)
        self.cache.free_sequence(victim.seq_id)
        if not self.running:
            # Alone and still short of blocks: it can never finish here (fits_ever said otherwise only if the
            # cache's estimate was optimistic); refuse rather than loop.
            self.refused.append(victim)
            return None
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def schedule_decode(self) -> list[Sequence]:
        """The running sequences that decode next (their prefill is done), after preempting the newest running
        ones until the step fits."""
        while self.running:
            ready = [s for s in self.running if not s.prefilling]
            if self.cache.blocks_needed_for_step([s.seq_id for s in ready]) <= self.cache.blocks_free():
                return ready
            if self.preempt_newest() is None:
                return []
        return []

    def finish(self, seq: Sequence) -> None:
        """A sequence produced its last token: free its cache entry (shared blocks stay cached)."""
        self.running.remove(seq)
        self.cache.free_sequence(seq.seq_id)
