"""Routing policies: exact choices on given loads, and the consistent-hash properties of prefix-aware."""

import pytest

from fivefold.errors import FivefoldError, ReplicaUnavailableError
from fivefold.serve.routing import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    ReplicaLoad,
    RoundRobinRouter,
    make_router,
)

IDLE = [ReplicaLoad("r0"), ReplicaLoad("r1"), ReplicaLoad("r2")]


def _prompt(prefix: int, suffix: int, length: int = 40) -> list[int]:
    return [prefix * 1000 + i for i in range(32)] + [suffix * 7 + i for i in range(length - 32)]


def test_round_robin_cycles_over_healthy_replicas():
    router = RoundRobinRouter()
    assert [router.choose([], IDLE) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    down = [IDLE[0], ReplicaLoad("r1", is_healthy=False), IDLE[2]]
    assert {router.choose([], down) for _ in range(4)} == {"r0", "r2"}


def test_least_loaded_uses_load_relative_to_capacity():
    loads = [ReplicaLoad("r0", 10, 2, capacity=16), ReplicaLoad("r1", 20, 0, capacity=64), ReplicaLoad("r2", 3, 3)]
    assert LeastLoadedRouter().choose([], loads) == "r2"  # 6/64 < 20/64 < 12/16
    assert LeastLoadedRouter().choose([], IDLE) == "r0"  # ties: lowest id


def test_prefix_aware_keeps_a_two_block_prefix_on_one_replica_and_spreads_prefixes():
    router = PrefixAwareRouter(block_size=16, num_prefix_blocks=2)
    for prefix in range(20):
        targets = {router.choose(_prompt(prefix, s), IDLE) for s in range(5)}
        assert len(targets) == 1  # the suffix after the two blocks does not matter
    owners = {router.choose(_prompt(p, 0), IDLE) for p in range(20)}
    assert owners == {"r0", "r1", "r2"}  # 20 distinct prefixes use every replica
    assert router.num_prefix_routed == 120 and router.num_fallbacks == 0


def test_removing_a_replica_moves_only_its_keys():
    router = PrefixAwareRouter()
    before = {p: router.choose(_prompt(p, 0), IDLE) for p in range(60)}
    down = [IDLE[0], ReplicaLoad("r1", is_healthy=False), IDLE[2]]
    after = {p: router.choose(_prompt(p, 0), down) for p in range(60)}
    for p in range(60):
        if before[p] != "r1":
            assert after[p] == before[p]
        else:
            assert after[p] in ("r0", "r2")


def test_saturated_owner_and_short_prompts_fall_back_to_least_loaded():
    router = PrefixAwareRouter(block_size=16, saturation=1.0)
    prompt = _prompt(3, 0)
    owner = router.choose(prompt, IDLE)
    full = [ReplicaLoad(r.replica_id, 64 if r.replica_id == owner else 5, 0) for r in IDLE]
    other = router.choose(prompt, full)
    assert other != owner and router.num_fallbacks == 1
    assert router.choose(list(range(15)), [ReplicaLoad("r0", 9), ReplicaLoad("r1", 1)]) == "r1"  # < 1 block


def test_no_healthy_replica_and_bad_policy():
    with pytest.raises(ReplicaUnavailableError, match="no healthy replica"):
        make_router("least-loaded").choose([], [ReplicaLoad("r0", is_healthy=False)])
    with pytest.raises(FivefoldError, match="routing must be one of round-robin, least-loaded, prefix-aware"):
        make_router("random")
