import asyncio

from fivefold.cache.result_cache import ResultCache, is_cacheable


def key(i: int, version: str = "v1") -> str:
    return ResultCache.make_key("model-fp", version, {"prompt": f"p{i}", "temperature": 0})


def test_hit_miss_and_lru_order():
    async def run():
        cache = ResultCache(max_entries=3)
        for i in range(3):
            await cache.put(key(i), {"text": i})
        assert await cache.get(key(0)) == {"text": 0}  # 0 becomes most recent
        await cache.put(key(3), {"text": 3})  # evicts the least recently used: 1
        assert await cache.keys() == [key(2), key(0), key(3)]
        assert await cache.get(key(1)) is None
        assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)
    asyncio.run(run())


def test_byte_bound():
    async def run():
        cache = ResultCache(max_entries=100, max_bytes=60)
        await cache.put(key(0), {"text": "a" * 20})  # 31 bytes of JSON: two do not fit in 60
        await cache.put(key(1), {"text": "b" * 20})
        assert await cache.keys() == [key(1)] and cache.num_bytes == 31
        await cache.put(key(2), {"text": "c" * 100})  # larger than the whole cache: not stored
        assert await cache.keys() == [key(1)]
    asyncio.run(run())


def test_version_change_purges_other_versions():
    async def run():
        cache = ResultCache(version="v1")
        await cache.put(key(0, "v1"), {"text": 0})
        assert await cache.set_version("v1") == 0
        assert await cache.set_version("v2") == 1
        assert len(cache) == 0 and cache.stats.purged == 1 and await cache.get(key(0, "v1")) is None
    asyncio.run(run())


def test_key_covers_every_parameter_and_only_deterministic_requests_are_cacheable():
    a = ResultCache.make_key("fp", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert a == ResultCache.make_key("fp", "v1", {"max_tokens": 5, "temperature": 0, "prompt": "x"})
    assert a != ResultCache.make_key("fp", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 6})
    assert a != ResultCache.make_key("other-model", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert is_cacheable({"temperature": 0}) and is_cacheable({"temperature": 0.7, "seed": 3})
    assert not is_cacheable({"temperature": 0.7}) and not is_cacheable({})
