"""The Redis result cache against a real redis-server: the in-process cache's keys, a
version bump seen by every process of a namespace and by no other namespace, a restarted
replica that adopts the stored version, LRU under maxmemory only when asked, an async
client that never blocks the loop, a Redis that goes away, and no password in any log."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from fivefold.cache.redis_cache import RedisResultCache, redact_url
from fivefold.cache.factory import make_result_cache
from fivefold.cache.result_cache import ResultCache
from fivefold.errors import FivefoldError
from tests.conftest import free_port, redis_server


@pytest.fixture
def url(redis_url):
    raw = redis.Redis.from_url(redis_url)
    raw.flushall()
    raw.config_set("maxmemory", 0)
    raw.config_set("maxmemory-policy", "noeviction")
    return redis_url


def test_same_keys_and_round_trip_as_in_process(url):
    async def run():
        memory, shared = ResultCache(), make_result_cache(url, version="v1", namespace="dep")
        assert isinstance(shared, RedisResultCache) and isinstance(shared.client, redis.asyncio.Redis)
        key = ResultCache.make_key("model|float32", "v1", {"prompt": "hi", "temperature": 0})
        assert shared.make_key("model|float32", "v1", {"temperature": 0, "prompt": "hi"}) == key
        body = {"choices": [{"text": "hello", "index": 0}], "usage": {"prompt_tokens": 1}}
        await memory.put(key, body)
        await shared.put(key, body)
        assert await shared.get(key) == await memory.get(key) == body
        assert await shared.get("missing") is None
        assert (shared.stats.hits, shared.stats.misses) == (1, 1)
        assert await shared.keys() == [key]
        assert redis.Redis.from_url(url).exists(f"fivefold:dep:v1:{key}")
        await shared.aclose()
    asyncio.run(run())


def test_version_bump_reaches_its_namespace_and_no_other(url):
    async def run():
        a = RedisResultCache(url, version="v1", namespace="dep")
        b = RedisResultCache(url, version="v1", namespace="dep")  # another replica of the same deployment
        other = RedisResultCache(url, version="v1", namespace="other")  # another deployment, same Redis
        for i in range(2):
            await a.put(f"k{i}", {"x": i})
        await other.put("k0", {"x": "other"})
        assert await b.get("k0") == {"x": 0}, "an entry one replica stored is a hit on the other"
        assert await b.set_version("v2") == 2 and await b.keys() == []
        raw = redis.Redis.from_url(url)
        assert sorted(raw.keys("fivefold:dep:*")) == [b"fivefold:dep:version"]
        assert raw.get("fivefold:dep:version") == b"v2" and raw.get("fivefold:other:version") == b"v1"
        assert await other.get("k0") == {"x": "other"}, "another deployment's entries survive the bump"
        assert await a.set_version("v2") == 0  # the other replica follows: nothing left to purge
        assert await a.get("k0") is None
        await b.put("k0", {"x": 3})
        assert await a.get("k0") == {"x": 3}
        # A replica restarted with the start-up spec (version None) adopts the stored version.
        restarted = RedisResultCache(url, version=None, namespace="dep")
        assert restarted.version == "v2" and await restarted.get("k0") == {"x": 3}
        assert raw.get("fivefold:dep:version") == b"v2"
        for c in (a, b, other, restarted):
            await c.aclose()
    asyncio.run(run())


def test_server_configuration_is_left_alone_unless_asked(url, caplog):
    raw = redis.Redis.from_url(url)
    with caplog.at_level(logging.WARNING, logger="fivefold.cache.redis_cache"):
        RedisResultCache(url, max_bytes=10 << 20)
    config = raw.config_get("maxmemory*")
    assert int(config["maxmemory"]) == 0 and config["maxmemory-policy"] == "noeviction"
    assert "never evicted" in caplog.text and "--redis-configure-lru" in caplog.text


def test_lru_eviction_under_maxmemory_when_asked(url):
    raw = redis.Redis.from_url(url)
    # Redis's LRU samples keys and keeps idle time in seconds: sample widely, age in seconds.
    raw.config_set("maxmemory-samples", 64)
    base = int(raw.info("memory")["used_memory"])
    bound = base + (2 << 20)

    async def run():
        cache = RedisResultCache(url, max_bytes=bound, configure_lru=True)
        config = raw.config_get("maxmemory*")
        assert int(config["maxmemory"]) == bound and config["maxmemory-policy"] == "allkeys-lru"
        value = {"text": "x" * 20_000}
        for i in range(40):  # 0.8 MB of old entries
            await cache.put(f"old{i}", value)
        await asyncio.sleep(2.1)
        assert await cache.get("old0") == value  # used again: no longer old
        for i in range(80):  # 1.6 MB of new ones: the budget forces evictions
            await cache.put(f"new{i}", value)
        assert int(raw.info("memory")["used_memory"]) <= bound
        keys = set(await cache.keys())
        assert "old0" in keys, "the recently used entry survives"
        assert {f"new{i}" for i in range(80)} <= keys, "the newest entries survive"
        assert len([k for k in keys if k.startswith("old")]) < 30, "least recently used entries were evicted"
        await cache.aclose()
    try:
        asyncio.run(run())
    finally:
        raw.config_set("maxmemory", 0)


def test_entry_over_bound_is_not_stored(url):
    async def run():
        cache = RedisResultCache(url, max_bytes=1000)
        await cache.put("big", {"text": "y" * 2000})
        assert await cache.get("big") is None
        await cache.aclose()
    asyncio.run(run())


def test_a_slow_redis_does_not_block_the_event_loop(url):
    """While Redis is paused for 0.5 s, a lookup waits, and the loop keeps running other work."""
    async def run():
        cache = RedisResultCache(url, timeout=5.0)
        await cache.put("k", {"v": 1})
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        redis.Redis.from_url(url).execute_command("CLIENT", "PAUSE", 500, "ALL")
        task = asyncio.ensure_future(ticker())
        start = time.monotonic()
        assert await cache.get("k") == {"v": 1}
        waited = time.monotonic() - start
        task.cancel()
        await cache.aclose()
        return waited, ticks
    waited, ticks = asyncio.run(run())
    assert waited >= 0.3, "the pause held the lookup"
    assert ticks >= 10, f"the loop ran only {ticks} ticks while the lookup waited {waited:.2f} s"


def test_unreachable_redis_is_a_one_line_error_and_a_lost_one_is_a_miss():
    port = free_port()
    with pytest.raises(FivefoldError, match=f"cannot use Redis at redis://127.0.0.1:{port}"):
        make_result_cache(f"redis://127.0.0.1:{port}")
    with pytest.raises(FivefoldError, match="--result-cache must be memory"):
        make_result_cache("memcached://x")

    async def store(cache):
        await cache.put("k", {"v": 1})
        return await cache.get("k")

    async def after(cache):
        first = await cache.get("k")
        errors = cache.num_errors
        await cache.put("k", {"v": 2})  # dropped, and no second timeout while Redis is marked down
        return first, errors, await cache.get("k"), cache.num_errors

    with redis_server() as live:
        cache = RedisResultCache(live, retry_after=60)
        loop = asyncio.new_event_loop()  # one loop for the cache's whole life, as in a server
        assert loop.run_until_complete(store(cache)) == {"v": 1}
    assert loop.run_until_complete(after(cache)) == (None, 1, None, 1)
    loop.close()


def test_passwords_never_reach_logs_or_errors(caplog):
    secret = "s3cret-pw"
    assert redact_url(f"redis://:{secret}@h:1/0") == "redis://:***@h:1/0"
    assert redact_url(f"redis://user:{secret}@h") == "redis://user:***@h"
    assert redact_url(f"unix:///tmp/r.sock?db=0&password={secret}") == "unix:///tmp/r.sock?db=0&password=***"
    with caplog.at_level(logging.DEBUG):
        with redis_server(password=secret) as live:
            wrong = live.replace(secret, "wrong-" + secret)
            with pytest.raises(FivefoldError) as refused:
                RedisResultCache(wrong)
            assert secret not in str(refused.value) and ":***@" in str(refused.value)
            cache = RedisResultCache(live, retry_after=60)  # warns: no LRU bound
            loop = asyncio.new_event_loop()
            loop.run_until_complete(cache.put("k", {"v": 1}))
        assert loop.run_until_complete(cache.get("k")) is None  # the server is gone: logged as a failure
        loop.close()
    assert cache.num_errors == 1 and "failed" in caplog.text and "never evicted" in caplog.text
    assert secret not in caplog.text
