"""Physical cold blocks: allocation, refcounts, chained prefix hashes and the LRU of freed cached blocks.

A block id is the same row in every layer's pool. A block is *in use* while sequences reference it
(``refcount > 0``). A block whose tokens are known (a prompt block) is *registered* under the hash of its
tokens chained with its parent's hash; when its last reference goes, it stays registered in the LRU of free
blocks and a later sequence with the same prefix reuses it. Unregistered free blocks are handed out first;
then the LRU is evicted oldest first (the block loses its hash).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import numpy as np

ROOT_HASH = 0


class CacheFullError(RuntimeError):
    """No free block is left for a step (the scheduler should have preempted first)."""


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Hashes of the first ``num_blocks`` full blocks: ``h_i = hash((h_{i-1}, tokens of block i))``."""
    out: list[int] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Host-side ownership of ``num_blocks`` physical blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.evictions = 0
        self.version = 0  # bumped whenever a block's use (refcount > 0) may have changed

    # ---- queries ------------------------------------------------------------------------------------
    def num_free(self) -> int:
        """Blocks that can be allocated now (unregistered free + LRU)."""
        return len(self._free) + len(self._lru)

    def num_cached_free(self) -> int:
        return len(self._lru)

    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free()

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest registered prefix of ``hashes``."""
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def in_lru(self, block: int) -> bool:
        return block in self._lru

    # ---- changes ------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1 (evicting LRU blocks if needed)."""
        if n > self.num_free():
            raise CacheFullError(f"need {n} free blocks, {self.num_free()} left of {self.num_blocks}")
        out = []
        self.version += n > 0
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.evictions += 1
            self.refcount[block] = 1
            out.append(block)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """One more reference to each (registered) block; an LRU block comes back into use."""
        for block in blocks:
            self._lru.pop(block, None)
            self.refcount[block] += 1
            self.version += 1

    def release(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference of each; returns the blocks that became free."""
        freed = []
        for block in blocks:
            assert self.refcount[block] > 0, f"block {block} released with refcount {self.refcount[block]}"
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.version += 1
                freed.append(block)
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        return freed

    def register(self, block: int, h: int) -> bool:
        """Make ``block`` findable under ``h`` (False if another block already is, or it already has a
        hash)."""
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True

    # ---- checks -------------------------------------------------------------------------------------
    def check_integrity(self, expected_refcount: np.ndarray) -> None:
        """Refcounts equal the references sequences hold; every block is in exactly one place."""
        bad = np.flatnonzero(self.refcount != expected_refcount)
        assert bad.size == 0, f"refcounts {self.refcount[bad[:8]]} != expected {expected_refcount[bad[:8]]}"
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & lru, f"blocks both free and in the LRU: {sorted(free & lru)[:8]}"
        in_use = set(np.flatnonzero(self.refcount > 0).tolist())
        assert not in_use & (free | lru), f"blocks in use and free: {sorted(in_use & (free | lru))[:8]}"
        assert len(in_use) + len(free) + len(lru) == self.num_blocks, (
            f"{self.num_blocks - len(in_use) - len(free) - len(lru)} blocks leaked"
        )
        assert all(b in self._hash_of for b in lru), "an LRU block without a hash"
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
