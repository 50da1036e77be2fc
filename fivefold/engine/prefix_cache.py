"""Prefix cache: a radix tree over block-aligned token prefixes.

Every edge of the tree is one full KV block (``block_size`` token ids); the path
from the root to a node spells a token prefix, and the node holds the id of the
block whose keys and values were computed for exactly that prefix. So a new
request walks the tree with its prompt, one block at a time, and reuses every
block on the matched path.

Contract (as in SGLang's ``BasePrefixCache``):
- ``match_prefix(tokens)`` returns the cached block ids of the longest matched
  full-block prefix and marks them as recently used; it changes no ref counts.
- ``insert(tokens, block_ids)`` publishes fully computed blocks; a prefix already
  present keeps its existing block (the caller's copy stays private, and so do the
  caller's blocks after it). So whoever references a node references its parent: an
  unreferenced node has no referenced descendant, and every unreferenced cached block
  can be evicted (the KV cache manager checks this in ``check_integrity``).
- ``evict(n, is_evictable)`` removes up to ``n`` least-recently-used leaves whose
  blocks nobody references and returns their block ids. Only leaves are evicted, so
  every cached node's whole prefix stays cached.
- ``check_integrity()`` verifies parent/child links and the block index.

The tree does not own ref counts: the KV cache manager does, and tells the tree
which blocks are referenced through the ``is_evictable`` predicate.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence


def prefix_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block, each covering the whole prefix up to that block's end."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[start:start + block_size])))
        hashes.append(h)
    return hashes


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]  # the block's token ids (empty for the root)
    block_id: int
    parent: "RadixNode | None"
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    last_access: int = 0


class RadixPrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = RadixNode(key=(), block_id=-1, parent=None)
        self.nodes_by_block: dict[int, RadixNode] = {}
        self._clock = 0

    @property
    def num_published_blocks(self) -> int:
        """Blocks in the tree (in use or evictable): what a later prompt can match."""
        return len(self.nodes_by_block)

    def contains_block(self, block_id: int) -> bool:
        return block_id in self.nodes_by_block

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _blocks(self, tokens: Sequence[int]):
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            yield tuple(tokens[start:start + bs])

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix of ``tokens``."""
        now = self._tick()
        node, matched = self.root, []
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            matched.append(child.block_id)
            node = child
        return matched

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int]) -> int:
        """Publish the full blocks of ``tokens`` (computed into ``block_ids``); return how many were new."""
        now = self._tick()
        node, num_new = self.root, 0
        for key, block_id in zip(self._blocks(tokens), block_ids):
            child = node.children.get(key)
            if child is not None and child.block_id != block_id:
                # Another sequence published this prefix first; the caller's copy stays private, and so
                # does everything after it: linking the caller's blocks below a node it does not hold
                # would let that node lose its last reference while a child is in use, and eviction
                # (leaves only) could not free what the pool counts as available.
                break
            if child is None:
                if block_id in self.nodes_by_block:
                    break  # this block already caches another prefix; nothing below can be linked
                child = RadixNode(key=key, block_id=block_id, parent=node)
                node.children[key] = child
                self.nodes_by_block[block_id] = child
                num_new += 1
            child.last_access = now
            node = child
        return num_new

    def touch(self, block_id: int) -> None:
        """Mark a cached block as used now (e.g. when its last user frees it)."""
        node = self.nodes_by_block.get(block_id)
        if node is not None:
            node.last_access = self._tick()

    def evict(self, num_blocks: int, is_evictable: Callable[[int], bool]) -> list[int]:
        """Remove up to ``num_blocks`` least-recently-used unreferenced leaves; return their ids."""
        heap = [(n.last_access, n.block_id, n) for n in self.nodes_by_block.values()
                if not n.children and is_evictable(n.block_id)]
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_blocks:
            _, block_id, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            del self.nodes_by_block[block_id]
            evicted.append(block_id)
            if parent is not self.root and not parent.children and is_evictable(parent.block_id):
                heapq.heappush(heap, (parent.last_access, parent.block_id, parent))
        return evicted

    def reset(self) -> list[int]:
        """Drop every node; return the block ids that were cached."""
        ids = list(self.nodes_by_block)
        self.root.children.clear()
        self.nodes_by_block.clear()
        return ids

    def check_integrity(self) -> None:
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, "broken parent/child link"
                assert len(key) == self.block_size, "a node's key is not one full block"
                assert self.nodes_by_block.get(child.block_id) is child, "block index disagrees with the tree"
                seen += 1
                stack.append(child)
        assert seen == len(self.nodes_by_block), "block index holds nodes that are not in the tree"
