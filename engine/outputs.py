"""The output tokens of running sequences and when they came out, in arrays indexed by hot-zone slot.

A decode step's emission is a few array operations whatever the batch (:meth:`SlotOutputs.record`): the
tokens and the clock go into each row's next column, the counts advance, and the rows that reached their
output length come back. A step whose tokens are still on the device is counted when it is launched
(:meth:`SlotOutputs.launch`: the rows it completes stop decoding) and filled in when they arrive
(:meth:`SlotOutputs.fill`); meanwhile its rows are ``pending`` and their last token reads as -1 (the next
step takes it from the device). The next step may be launched before this one lands, so a row can have two
steps pending: ``pending`` counts them, and a step that lands fills the oldest pending column of each row.
While a sequence is admitted, its ``output`` and ``token_ms`` are :class:`RowView`\\ s of its row (they read
like lists, so a stop predicate or a test can look at them at any time); when it leaves (finished,
preempted) they become lists again and the row is free.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as AbcSequence
from typing import Any, overload

import numpy as np

from kvtune.engine.scheduler import Sequence


class RowView(AbcSequence[Any]):
    """The first ``count[slot]`` entries of ``data[slot]`` less the pending ones, read-only, as Python
    numbers."""

    def __init__(self, data: np.ndarray, slot: int, count: np.ndarray, pending: np.ndarray) -> None:
        self._data, self._slot, self._count, self._pending = data, slot, count, pending

    def __len__(self) -> int:
        return int(self._count[self._slot]) - int(self._pending[self._slot])

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        row = self._data[self._slot, : len(self)]
        return row[i].tolist()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data[self._slot, : len(self)].tolist())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, AbcSequence) else NotImplemented

    def __repr__(self) -> str:
        return f"RowView({list(self)!r})"


class SlotOutputs:
    """Per hot-zone slot: the admitted sequence, its output tokens and their times, whether it decodes."""

    def __init__(self, num_slots: int, max_output: int) -> None:
        width = max(1, max_output)
        self.count = np.zeros(num_slots, dtype=np.int64)
        self.target = np.zeros(num_slots, dtype=np.int64)
        self.decoding = np.zeros(num_slots, dtype=bool)  # prefilled, not finished: a decode row
        self.pending = np.zeros(num_slots, dtype=np.int64)  # launched steps whose tokens are not yet here
        self.tokens = np.zeros((num_slots, width), dtype=np.int64)
        self.ms = np.zeros((num_slots, width), dtype=np.float64)
        self.seqs: list[Sequence | None] = [None] * num_slots

    def attach(self, seq: Sequence, slot: int) -> None:
        """``seq`` was admitted into ``slot``: its outputs so far move into the row."""
        n = len(seq.output)
        self.tokens[slot, :n] = list(seq.output)
        self.ms[slot, :n] = list(seq.token_ms)
        self.count[slot] = n
        self.target[slot] = seq.request.output_length
        self.decoding[slot] = False
        self.pending[slot] = 0
        self.seqs[slot] = seq
        seq.slot = slot
        seq.output = RowView(self.tokens, slot, self.count, self.pending)
        seq.token_ms = RowView(self.ms, slot, self.count, self.pending)

    def detach(self, seq: Sequence) -> None:
        """``seq`` leaves its slot (finished or preempted): its outputs become lists again."""
        slot = seq.slot
        if slot < 0 or self.seqs[slot] is not seq:
            return
        n = int(self.count[slot])
        seq.output = self.tokens[slot, :n].tolist()
        seq.token_ms = self.ms[slot, :n].tolist()
        self.count[slot] = 0
        self.decoding[slot] = False
        self.pending[slot] = 0
        self.seqs[slot] = None
        seq.slot = -1

    def decoding_slots(self) -> np.ndarray:
        return np.flatnonzero(self.decoding)

    def last_tokens(self, slots: np.ndarray) -> np.ndarray:
        """The newest output token of each slot (what its next decode step feeds); -1 where it is pending."""
        return np.where(self.pending[slots] > 0, -1, self.tokens[slots, self.count[slots] - 1])

    def launch(self, slots: np.ndarray) -> np.ndarray:
        """A step that gives each slot one token was launched: count it (pending until :meth:`fill`); returns
        the slots it completes, which stop decoding."""
        n = self.count[slots] + 1
        self.count[slots] = n
        self.pending[slots] += 1
        done = slots[n >= self.target[slots]]
        self.decoding[done] = False
        return done

    def fill(self, slots: np.ndarray, tokens: np.ndarray, now_ms: float) -> None:
        """The tokens of the oldest launched step of ``slots`` arrived at ``now_ms``: they fill each row's
        oldest pending column (a later step may already be launched)."""
        n = self.count[slots] - self.pending[slots]
        self.tokens[slots, n] = tokens
        self.ms[slots, n] = now_ms
        self.pending[slots] -= 1

    def record(self, slots: np.ndarray, tokens: np.ndarray, now_ms: float) -> np.ndarray:
        """One new token per slot at ``now_ms`` (:meth:`launch` and :meth:`fill` at once); returns the slots
        whose sequence is now complete."""
        done = self.launch(slots)
        self.fill(slots, tokens, now_ms)
        return done
