from fivefold.cache.result_cache import ResultCache, is_cacheable


def key(i: int, version: str = "v1") -> str:
    return ResultCache.make_key("model-fp", version, {"prompt": f"p{i}", "temperature": 0})


def test_hit_miss_and_lru_order():
    cache = ResultCache(max_entries=3)
    for i in range(3):
        cache.put(key(i), {"text": i})
    assert cache.get(key(0)) == {"text": 0}  # 0 becomes most recent
    cache.put(key(3), {"text": 3})  # evicts the least recently used: 1
    assert cache.keys() == [key(2), key(0), key(3)]
    assert cache.get(key(1)) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)


def test_byte_bound():
    cache = ResultCache(max_entries=100, max_bytes=60)
    cache.put(key(0), {"text": "a" * 20})  # 31 bytes of JSON: two do not fit in 60
    cache.put(key(1), {"text": "b" * 20})
    assert cache.keys() == [key(1)] and cache.num_bytes == 31
    cache.put(key(2), {"text": "c" * 100})  # larger than the whole cache: not stored
    assert cache.keys() == [key(1)]


def test_version_change_purges_other_versions():
    cache = ResultCache(version="v1")
    cache.put(key(0, "v1"), {"text": 0})
    cache.set_version("v2")
    assert len(cache) == 0 and cache.stats.purged == 1 and cache.get(key(0, "v1")) is None


def test_key_covers_every_parameter_and_only_deterministic_requests_are_cacheable():
    a = ResultCache.make_key("fp", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert a == ResultCache.make_key("fp", "v1", {"max_tokens": 5, "temperature": 0, "prompt": "x"})
    assert a != ResultCache.make_key("fp", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 6})
    assert a != ResultCache.make_key("other-model", "v1", {"prompt": "x", "temperature": 0, "max_tokens": 5})
    assert is_cacheable({"temperature": 0}) and is_cacheable({"temperature": 0.7, "seed": 3})
    assert not is_cacheable({"temperature": 0.7}) and not is_cacheable({})
