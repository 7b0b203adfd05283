"""Block manager: which KV pages are free, shared, or cached for reuse.

Pages carry a reference count. A full block whose tokens are known gets a chained hash (the
previous block's hash plus this block's token ids); freed hashed blocks stay findable in an LRU
free queue until their page is handed out again, so a later prompt with the same prefix reuses
them (prefix caching). Only full blocks are ever shared by hash.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

import numpy as np

BlockHash = Hashable


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained key of one full block: equal keys mean equal token prefixes."""
    return (hash(parent), tuple(token_ids))


class BlockManager:
    """Allocation, ref counts and the prefix cache over ``num_blocks`` pages.

    Args:
        num_blocks: pages in the pool.
        block_size: tokens per page.
        enable_prefix_caching: keep and look up block hashes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # free pages, oldest first: allocation takes from the front, frees go to the back
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_hit_blocks = 0  # prefix-cache hits served (for stats and tests)

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (including evictable cached pages)."""
        return len(self._free)

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them consumes free pages)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    # ------------------------------------------------------------------ allocation
    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` pages (ref count 1), evicting the oldest cached ones first."""
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {count}, {len(self._free)} free")
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._block_hash[block]
            if key is not None:
                if self._cached.get(key) == block:
                    del self._cached[key]
                self._block_hash[block] = None
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Adds a reference to each page (a fork, or a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drops one reference per page; pages reaching zero join the free queue. The table is
        freed tail first, so a sequence's last pages are evicted before its first ones."""
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            assert count >= 0, f"block {block} freed more often than allocated"
            self.ref_counts[block] = count
            if count == 0:
                if not self.enable_prefix_caching:
                    self._block_hash[block] = None
                self._free[block] = None

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pages holding the longest cached prefix whose block keys are ``hashes``."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for key in hashes:
            block = self._cached.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def register(self, block: int, key: BlockHash) -> None:
        """Marks a full, computed page as holding the block ``key``."""
        if not self.enable_prefix_caching or self._block_hash[block] is not None:
            return
        if key not in self._cached:
            self._cached[key] = block
            self._block_hash[block] = key

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (after a weight update the cached KV is stale)."""
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks

    def check_invariants(self) -> None:
        """Asserts the free queue and the ref counts agree (tests)."""
        free = set(self._free)
        zero = set(np.flatnonzero(self.ref_counts == 0).tolist())
        assert free == zero, (sorted(free ^ zero))[:10]
        for key, block in self._cached.items():
            assert self._block_hash[block] == key
