"""The Redis result cache against a real redis-server: the in-process cache's keys, a
version bump seen by every user, LRU under maxmemory, and a Redis that goes away."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from fivefold.cache.redis_cache import RedisResultCache
from fivefold.cache.result_cache import ResultCache, make_result_cache
from fivefold.errors import FivefoldError
from tests.conftest import free_port


@pytest.fixture
def url(redis_url):
    redis.Redis.from_url(redis_url).flushall()
    return redis_url


def test_same_keys_and_round_trip_as_in_process(url):
    memory, shared = ResultCache(), make_result_cache(url, version="v1")
    assert isinstance(shared, RedisResultCache)
    key = ResultCache.make_key("model|float32", "v1", {"prompt": "hi", "temperature": 0})
    assert shared.make_key("model|float32", "v1", {"temperature": 0, "prompt": "hi"}) == key
    body = {"choices": [{"text": "hello", "index": 0}], "usage": {"prompt_tokens": 1}}
    memory.put(key, body)
    shared.put(key, body)
    assert shared.get(key) == memory.get(key) == body
    assert shared.get("missing") is None
    assert (shared.stats.hits, shared.stats.misses) == (1, 1)
    assert shared.keys() == [key]


def test_version_bump_invalidates_for_every_replica(url):
    a = RedisResultCache(url, version="v1")
    b = RedisResultCache(url, version="v1")  # another replica, same Redis
    a.put("k1", {"x": 1})
    a.put("k2", {"x": 2})
    assert b.get("k1") == {"x": 1}, "an entry one replica stored is a hit on the other"
    b.set_version("v2")
    assert b.stats.purged == 2 and len(b) == 0
    raw = redis.Redis.from_url(url)
    assert sorted(raw.keys("fivefold:result:*")) == [b"fivefold:result:version"]
    a.set_version("v2")  # the other replica follows: nothing left to purge
    assert a.get("k1") is None and a.stats.purged == 0
    b.put("k1", {"x": 3})
    assert a.get("k1") == {"x": 3}


def test_lru_eviction_under_maxmemory(url):
    raw = redis.Redis.from_url(url)
    raw.config_set("maxmemory", 0)
    raw.config_set("maxmemory-policy", "noeviction")
    # Redis's LRU samples keys and keeps idle time in seconds: sample widely, age in seconds.
    raw.config_set("maxmemory-samples", 64)
    base = int(raw.info("memory")["used_memory"])
    bound = base + (2 << 20)
    cache = RedisResultCache(url, max_bytes=bound)
    config = raw.config_get("maxmemory*")
    assert int(config["maxmemory"]) == bound and config["maxmemory-policy"] == "allkeys-lru"
    value = {"text": "x" * 20_000}
    for i in range(40):  # 0.8 MB of old entries
        cache.put(f"old{i}", value)
    time.sleep(2.1)
    assert cache.get("old0") == value  # used again: no longer old
    for i in range(80):  # 1.6 MB of new ones: the budget forces evictions
        cache.put(f"new{i}", value)
    assert int(raw.info("memory")["used_memory"]) <= bound
    keys = set(cache.keys())
    assert "old0" in keys, "the recently used entry survives"
    assert {f"new{i}" for i in range(80)} <= keys, "the newest entries survive"
    assert len([k for k in keys if k.startswith("old")]) < 30, "least recently used entries were evicted"
    raw.config_set("maxmemory", 0)


def test_entry_over_bound_is_not_stored(url):
    cache = RedisResultCache(url, max_bytes=1000)
    redis.Redis.from_url(url).config_set("maxmemory", 0)
    cache.put("big", {"text": "y" * 2000})
    assert cache.get("big") is None


def test_unreachable_redis_is_a_one_line_error_and_a_lost_one_is_a_miss():
    port = free_port()
    with pytest.raises(FivefoldError, match=f"cannot use Redis at redis://127.0.0.1:{port}"):
        make_result_cache(f"redis://127.0.0.1:{port}")
    with pytest.raises(FivefoldError, match="--result-cache must be memory"):
        make_result_cache("memcached://x")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
                            stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        cache = RedisResultCache(f"redis://127.0.0.1:{port}", retry_after=60)
        cache.put("k", {"v": 1})
        assert cache.get("k") == {"v": 1}
    finally:
        proc.terminate()
        proc.wait(10)
    assert cache.get("k") is None and cache.num_errors == 1
    cache.put("k", {"v": 2})  # dropped, and no second timeout while Redis is marked down
    assert cache.get("k") is None and cache.num_errors == 1
