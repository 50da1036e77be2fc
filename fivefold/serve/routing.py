"""Choosing an engine replica for a request: round-robin, least-loaded, or prefix-aware.

The routers are pure policy: they see each replica's load (``ReplicaLoad``) and the
prompt's token ids, and name a replica. They hold no connection to the replicas, so the
same policy serves any front (issue 10 puts them in front of Ray Serve replicas).

Prefix-aware routing keeps a shared prompt prefix hot in one replica's prefix cache: the
key is a hash of the prompt's first ``num_prefix_blocks`` full KV blocks (as the prefix
cache sees them), placed on a consistent-hash ring with ``num_virtual_nodes`` points per
replica, so taking a replica out moves only the keys it held. When the key's replica is
saturated (``load >= saturation`` x its capacity), or the prompt is shorter than one
block, the least-loaded replica takes the request instead.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass

from fivefold.errors import FivefoldError, ReplicaUnavailableError

ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware")


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one replica at the moment of a request."""

    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    capacity: int = 64  # the replica's max_num_seqs
    is_healthy: bool = True

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


def _healthy(replicas: list[ReplicaLoad]) -> list[ReplicaLoad]:
    alive = [r for r in replicas if r.is_healthy]
    if not alive:
        raise ReplicaUnavailableError("no healthy replica is available; retry once one has restarted")
    return alive


class RoundRobinRouter:
    """Each healthy replica in turn."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, prompt_ids: list[int], replicas: list[ReplicaLoad]) -> str:
        alive = sorted(_healthy(replicas), key=lambda r: r.replica_id)
        return alive[next(self._counter) % len(alive)].replica_id


class LeastLoadedRouter:
    """The healthy replica with the fewest running + waiting requests relative to its capacity
    (ties: the lowest id)."""

    def choose(self, prompt_ids: list[int], replicas: list[ReplicaLoad]) -> str:
        return min(_healthy(replicas), key=lambda r: (r.load / r.capacity, r.replica_id)).replica_id


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class PrefixAwareRouter:
    """Consistent hash of the first full KV blocks of the prompt, least-loaded when saturated."""

    def __init__(self, block_size: int = 16, num_prefix_blocks: int = 2, saturation: float = 1.0,
                 num_virtual_nodes: int = 64) -> None:
        if block_size < 1 or num_prefix_blocks < 1 or num_virtual_nodes < 1 or saturation <= 0:
            raise FivefoldError("block_size, num_prefix_blocks and num_virtual_nodes must be >= 1, saturation > 0")
        self.block_size, self.num_prefix_blocks = block_size, num_prefix_blocks
        self.saturation, self.num_virtual_nodes = saturation, num_virtual_nodes
        self._fallback = LeastLoadedRouter()
        self.num_prefix_routed = 0
        self.num_fallbacks = 0
        self._rings: dict[tuple[str, ...], list[tuple[int, str]]] = {}  # per set of healthy replicas

    def prefix_key(self, prompt_ids: list[int]) -> int | None:
        """Hash of the prompt's first full blocks (up to ``num_prefix_blocks``); None under one block."""
        num_blocks = min(self.num_prefix_blocks, len(prompt_ids) // self.block_size)
        if num_blocks == 0:
            return None
        return _hash(",".join(map(str, prompt_ids[: num_blocks * self.block_size])))

    def owner(self, key: int, replica_ids: list[str]) -> str:
        """The replica the ring assigns ``key`` to among ``replica_ids``."""
        members = tuple(sorted(replica_ids))
        ring = self._rings.get(members)
        if ring is None:  # built once per membership, not per request
            ring = sorted((_hash(f"{rid}#{v}"), rid) for rid in members for v in range(self.num_virtual_nodes))
            self._rings[members] = ring
        i = bisect.bisect_left(ring, (key, ""))
        return ring[i % len(ring)][1]

    def choose(self, prompt_ids: list[int], replicas: list[ReplicaLoad]) -> str:
        alive = _healthy(replicas)
        key = self.prefix_key(prompt_ids)
        if key is not None:
            owner = next(r for r in alive if r.replica_id == self.owner(key, [r.replica_id for r in alive]))
            if owner.load < self.saturation * owner.capacity:
                self.num_prefix_routed += 1
                return owner.replica_id
        self.num_fallbacks += 1
        return self._fallback.choose(prompt_ids, alive)


def make_router(policy: str, block_size: int = 16):
    if policy == "round-robin":
        return RoundRobinRouter()
    if policy == "least-loaded":
        return LeastLoadedRouter()
    if policy == "prefix-aware":
        return PrefixAwareRouter(block_size)
    raise FivefoldError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got '{policy}'")
