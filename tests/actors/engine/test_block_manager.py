"""Block manager: ref counts, free queue, chained block hashes and LRU reuse."""

from __future__ import annotations

import pytest

from actors.engine.block_manager import BlockManager, hash_block


def chain(blocks):
    keys, parent = [], None
    for tokens in blocks:
        parent = hash_block(parent, tokens)
        keys.append(parent)
    return keys


def test_allocate_share_free():
    bm = BlockManager(4, 2)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1
    bm.share(a[:2])
    assert bm.ref_counts[a].tolist() == [2, 2, 1]
    bm.free(a)
    assert bm.num_free_blocks == 2  # a[2] back; a[0], a[1] still referenced
    bm.free(a[:2])
    assert bm.num_free_blocks == 4
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(5)


def test_prefix_lookup_follows_the_chain():
    bm = BlockManager(8, 2)
    blocks = bm.allocate(3)
    keys = chain([(1, 2), (3, 4), (5, 6)])
    for b, k in zip(blocks, keys):
        bm.register(b, k)
    assert bm.lookup(keys) == blocks
    assert bm.lookup(chain([(1, 2), (3, 4), (9, 9)])) == blocks[:2]
    assert bm.lookup(chain([(3, 4)])) == []  # same tokens, different prefix: no hit
    # a second page with the same content does not replace the first
    dup = bm.allocate(1)[0]
    bm.register(dup, keys[0])
    assert bm.lookup(keys[:1]) == [blocks[0]]


def test_freed_cached_blocks_are_reused_then_evicted_oldest_first():
    bm = BlockManager(4, 2)
    first = bm.allocate(2)
    keys = chain([(1, 1), (2, 2)])
    for b, k in zip(first, keys):
        bm.register(b, k)
    bm.free(first)
    assert bm.num_free_blocks == 4
    hits = bm.lookup(keys)
    assert hits == first  # still cached after the free
    bm.share(hits)
    assert bm.num_free_blocks == 2 and bm.ref_counts[first].tolist() == [1, 1]
    bm.free(hits)
    # allocating everything evicts: the never-used pages first, then the cached ones (tail
    # of the freed sequence before its head)
    order = bm.allocate(4)
    assert order[2:] == [first[1], first[0]]
    assert bm.lookup(keys) == []
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    b = bm.allocate(1)[0]
    key = hash_block(None, (1, 2))
    bm.register(b, key)
    assert bm.lookup([key]) == []
