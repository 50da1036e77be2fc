"""The owner of the KV cache blocks: allocation, ref counts, freeing.

The model runner owns the tensors; this class only owns the block ids and decides
who may use which. Predicate/commit pairs: ``can_allocate`` then ``allocate_slots``
(which returns False, allocating nothing, when it cannot).
"""

from __future__ import annotations

from collections import deque

from fivefold.engine.sequence import Sequence


class KVCacheManager:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more computed tokens, or nothing."""
        num_new = self.num_new_blocks(seq, num_new_tokens)
        if num_new > self.num_free_blocks:
            return False
        for _ in range(num_new):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_ids.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody references return to the pool."""
        for block_id in reversed(seq.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_ids = []

    def check_integrity(self) -> None:
        """free + used == total, and every free block has ref count 0."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is free twice"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not free & used, "a referenced block is on the free list"
        assert len(free) + len(used) == self.num_blocks, "a block is neither free nor used"
