"""Block-level behaviour of the KV cache manager and its radix-tree prefix cache:
exact block ids, ref counts and eviction order, with check_integrity after each scenario."""

from __future__ import annotations

from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.prefix_cache import RadixPrefixCache
from fivefold.engine.sequence import Sequence
from fivefold.sampling_params import SamplingParams

BS = 4


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Admit (with prefix hits) and compute ``num_tokens`` (default: all) as the scheduler would."""
    computed = kv.get_computed_blocks(seq)
    hit = len(computed) * BS
    n = (seq.num_uncomputed_tokens - hit) if num_tokens is None else num_tokens
    assert kv.allocate_slots(seq, n, computed)
    seq.num_computed_tokens += hit + n
    kv.cache_full_blocks(seq)


def test_allocation_ids_and_refcounts_without_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a, b = make_seq("a", list(range(10))), make_seq("b", list(range(5)))
    compute(kv, a)
    compute(kv, b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    assert kv.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    kv.check_integrity([a, b])
    kv.free(a)
    assert list(kv.free_block_ids) == [5, 6, 7, 2, 1, 0]  # tail first
    kv.check_integrity([b])
    c = make_seq("c", list(range(100, 113)))
    compute(kv, c)
    assert c.block_ids == [5, 6, 7, 2]
    kv.check_integrity([b, c])


def test_shared_prefix_reuses_blocks_and_computes_only_the_rest():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq("a", list(range(12)) + [99])  # 3 full blocks + 1 token
    compute(kv, a)
    assert a.block_ids == [0, 1, 2, 3]
    assert kv.prefix_cache.num_published_blocks == 3  # the partial block is never published
    b = make_seq("b", list(range(8)) + [50, 51, 52, 53, 54])
    assert kv.get_computed_blocks(b) == [0, 1]
    compute(kv, b)
    assert b.block_ids == [0, 1, 4, 5] and b.num_computed_tokens == 13
    assert kv.ref_counts[:6] == [2, 2, 1, 1, 1, 1]
    kv.check_integrity([a, b])
    # A prompt that is entirely cached still computes its last token: one block fewer is reused.
    c = make_seq("c", list(range(12)))
    assert kv.get_computed_blocks(c) == [0, 1]
    kv.check_integrity([a, b])


def test_freed_published_blocks_stay_cached_and_are_revived():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    assert kv.num_evictable_blocks == 2 and list(kv.free_block_ids) == [3, 4, 5, 2]
    kv.check_integrity([])
    b = make_seq("b", list(range(8)) + [7, 7])
    compute(kv, b)
    assert b.block_ids == [0, 1, 3] and kv.ref_counts[:2] == [1, 1]
    assert kv.num_evictable_blocks == 0
    assert kv.stats.num_queries == 0  # the manager counts nothing by itself; the scheduler records
    kv.check_integrity([b])


def test_eviction_is_lru_and_leaf_first_and_only_when_free_runs_out():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq("a", list(range(8)) + [1])  # blocks 0,1 published, 2 partial
    b = make_seq("b", list(range(100, 108)) + [1])  # blocks 3,4 published, 5 partial
    compute(kv, a)
    compute(kv, b)
    kv.free(b)  # b's blocks become cached first (older)
    kv.free(a)
    assert kv.num_free_blocks == 2 and kv.num_evictable_blocks == 4
    c = make_seq("c", list(range(200, 208)) + [1])
    compute(kv, c)
    # Two free blocks are used before anything is evicted; then b's leaf (4) goes first.
    assert c.block_ids == [5, 2, 4]
    assert kv.prefix_cache.contains_block(3) and not kv.prefix_cache.contains_block(4)
    kv.check_integrity([c])
    d = make_seq("d", list(range(300, 308)))
    compute(kv, d)
    # Next LRU: b's root block 3 (now a leaf), then a's leaf 1 — a's prefix block 0 survives.
    assert d.block_ids == [3, 1]
    assert kv.prefix_cache.contains_block(0) and kv.get_computed_blocks(make_seq("e", list(range(4)) + [9])) == [0]
    kv.check_integrity([c, d])


def test_pool_exhaustion_allocates_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_seq("a", list(range(9)))
    compute(kv, a)
    b = make_seq("b", list(range(50, 55)))
    assert not kv.can_allocate(b, 5)
    assert not kv.allocate_slots(b, 5)
    assert b.block_ids == [] and kv.ref_counts == [1, 1, 1]
    kv.check_integrity([a, b])


def test_lookahead_reserves_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq("a", list(range(5)))
    assert kv.allocate_slots(a, 5, num_lookahead_tokens=7)  # 12 tokens of room
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=6) and a.block_ids == [0, 1, 2]
    kv.check_integrity([a])


def test_radix_tree_insert_keeps_existing_block_and_links_nothing_below_it():
    tree = RadixPrefixCache(block_size=2)
    assert tree.insert([1, 2, 3, 4], [10, 11]) == 2
    # Same first block computed elsewhere (block 20): the tree keeps 10, and 21 is not hung under it
    # (its sequence does not hold 10, which could then lose its last reference while 21 is in use).
    assert tree.insert([1, 2, 5, 6], [20, 21]) == 0
    assert tree.match_prefix([1, 2, 5, 6, 7]) == [10]
    assert not tree.contains_block(20) and not tree.contains_block(21)
    tree.check_integrity()
    # 11 is referenced, so it stays, and so does its parent 10 (not a leaf).
    assert tree.evict(10, lambda b: b != 11) == []
    assert tree.match_prefix([1, 2, 3, 4]) == [10, 11]
    assert tree.evict(10, lambda b: True) == [11, 10]
    tree.check_integrity()
