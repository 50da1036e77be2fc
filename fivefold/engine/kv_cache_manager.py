"""The owner of the KV cache blocks: allocation, ref counts, the prefix cache.

The model runner owns the tensors; this class owns the block ids and decides who
may use which. Each block is in exactly one of three states:

- free: on ``free_block_ids``, ref count 0, holds nothing reusable;
- cached: ref count 0 but published in the prefix cache, so a later request with
  the same prefix can reuse it; evicted (least recently used first) only when no
  free block is left;
- in use: ref count = the number of sequences whose block table holds it.

``allocate_slots`` returns False, allocating nothing, when the blocks are not
there; the scheduler then preempts (vLLM v1's contract).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from fivefold.engine.prefix_cache import RadixPrefixCache
from fivefold.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of which served from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class KVCacheManager:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.prefix_cache = RadixPrefixCache(block_size) if enable_prefix_caching else None
        self.evictable: set[int] = set()  # cached blocks with ref count 0
        self.stats = PrefixCacheStats()

    # --- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks kept for reuse by the prefix cache, evicted when blocks run out."""
        return len(self.evictable)

    @property
    def num_available_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -----------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of a not-yet-computed sequence.

        At least one token is always left to compute, since sampling needs its logits.
        """
        # A request for prompt logprobs runs its whole prompt: cached tokens have no logits.
        if self.prefix_cache is None or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return []
        return self.prefix_cache.match_prefix(seq.token_ids[: seq.num_tokens - 1])

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.num_queries += num_query_tokens
        self.stats.num_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks ``seq`` has completely computed."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full > seq.num_published_blocks:
            self.prefix_cache.insert(seq.token_ids[: num_full * self.block_size], seq.block_ids[:num_full])
            seq.num_published_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block not in use (e.g. after the weights changed)."""
        if self.prefix_cache is None:
            return
        in_use = [b for b in self.prefix_cache.nodes_by_block if self.ref_counts[b] > 0]
        assert not in_use, "cannot reset the prefix cache while sequences use cached blocks"
        self.free_block_ids.extend(sorted(self.prefix_cache.reset()))
        self.evictable.clear()

    # --- allocation -------------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int = 0,
                       num_lookahead_tokens: int = 0) -> int:
        num_tokens = seq.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        needed = self.num_blocks_for(num_tokens + num_lookahead_tokens)
        return max(0, needed - len(seq.block_ids) - num_computed_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Iterable[int] = (),
                     num_lookahead_tokens: int = 0) -> bool:
        computed_blocks = list(computed_blocks)
        # Reusing a cached-but-unreferenced block takes it out of the evictable pool.
        num_revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        num_new = self.num_new_blocks(seq, num_new_tokens, len(computed_blocks), num_lookahead_tokens)
        return num_new <= self.num_available_blocks - num_revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Iterable[int] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Give ``seq`` the ``computed_blocks`` prefix hits plus room for ``num_new_tokens``
        (and ``num_lookahead_tokens`` reserved beyond them), or change nothing and return False."""
        computed_blocks = list(computed_blocks)
        if not self.can_allocate(seq, num_new_tokens, computed_blocks, num_lookahead_tokens):
            return False
        num_new = self.num_new_blocks(seq, num_new_tokens, len(computed_blocks), num_lookahead_tokens)
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                self.evictable.discard(block_id)
            self.ref_counts[block_id] += 1
        seq.block_ids.extend(computed_blocks)
        if num_new > len(self.free_block_ids):
            self._evict(num_new - len(self.free_block_ids))
        for _ in range(num_new):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_ids.append(block_id)
        return True

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past the first ``num_tokens`` slots (e.g. those that held
        rejected speculative tokens). Only unpublished, unshared tail blocks can be there."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_ids) > keep:
            block_id = seq.block_ids.pop()
            assert self.ref_counts[block_id] == 1 and (self.prefix_cache is None or
                                                       not self.prefix_cache.contains_block(block_id))
            self.ref_counts[block_id] = 0
            self.free_block_ids.append(block_id)

    def _evict(self, num_blocks: int) -> None:
        assert self.prefix_cache is not None
        evicted = self.prefix_cache.evict(num_blocks, lambda b: self.ref_counts[b] == 0)
        for block_id in evicted:
            self.evictable.discard(block_id)
            self.free_block_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Unreferenced blocks become cached if published, else free.

        Tail blocks go first, so that among one sequence's blocks the prefix outlives the tail.
        """
        for block_id in reversed(seq.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.prefix_cache is not None and self.prefix_cache.contains_block(block_id):
                    self.evictable.add(block_id)
                    self.prefix_cache.touch(block_id)
                else:
                    self.free_block_ids.append(block_id)
        seq.block_ids = []
        seq.num_published_blocks = 0

    # --- checks -----------------------------------------------------------------------------

    def check_integrity(self, seqs: Iterable[Sequence] | None = None) -> None:
        """free + cached + in use == total; ref counts agree with the block tables of
        ``seqs`` (every live sequence, when given) and with the radix tree."""
        free = list(self.free_block_ids)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has references"
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        in_use = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        cached = set(self.prefix_cache.nodes_by_block) if self.prefix_cache is not None else set()
        assert self.evictable == {b for b in cached if self.ref_counts[b] == 0}, "evictable set disagrees with the tree"
        assert not set(free) & cached, "a free block is still in the prefix cache"
        assert len(free) + len(self.evictable) + len(in_use) == self.num_blocks, "free + cached + in use != total"
        if seqs is not None:
            counts = [0] * self.num_blocks
            for seq in seqs:
                for block_id in seq.block_ids:
                    counts[block_id] += 1
            assert counts == self.ref_counts, "ref counts disagree with the block tables"
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            # Every block counted as evictable can be evicted now: eviction removes leaves only, so an
            # unreferenced node must not sit above a referenced one (then it would be counted as
            # available, and allocation would promise a block that eviction cannot free).
            for block_id, node in self.prefix_cache.nodes_by_block.items():
                parent = node.parent
                if self.ref_counts[block_id] > 0 and parent is not self.prefix_cache.root:
                    assert self.ref_counts[parent.block_id] > 0, (
                        f"cached block {parent.block_id} is counted as evictable but its child {block_id} is in use")
