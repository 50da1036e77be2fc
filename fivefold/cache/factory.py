"""``--result-cache``: the one place that knows both backends and picks one. The backends do
not import each other: redis_cache.py builds on result_cache.py, never the other way."""

from __future__ import annotations

from fivefold.cache.result_cache import ResultCache
from fivefold.errors import FivefoldError

RESULT_CACHE_BACKENDS = "memory | redis://HOST:PORT[/DB]"


def make_result_cache(backend: str, max_entries: int = 1024, max_bytes: int = 64 << 20, version: str | None = "v1",
                      namespace: str = "default", configure_lru: bool = False):
    """The result cache ``--result-cache`` names: ``memory`` (this process's LRU, the default)
    or a ``redis://`` URL (one cache for every replica of a deployment; see redis_cache.py).

    ``namespace`` separates deployments sharing one Redis (the server passes its
    ``--cache-namespace`` and the model's fingerprint); ``version`` None adopts the version
    stored there (a replica restarted behind a front); ``configure_lru`` lets the cache set
    Redis's ``maxmemory`` and eviction policy (``--redis-configure-lru``)."""
    if backend == "memory":
        if max_entries < 1 or max_bytes < 1:
            raise FivefoldError(f"result cache bounds must be >= 1, got {max_entries} entries and {max_bytes} bytes")
        return ResultCache(max_entries, max_bytes, version or "v1")
    if backend.startswith(("redis://", "rediss://", "unix://")):
        from fivefold.cache.redis_cache import RedisResultCache  # only with a redis:// URL: redis is optional

        return RedisResultCache(backend, max_bytes, version, namespace=namespace, configure_lru=configure_lru)
    raise FivefoldError(f"--result-cache must be {RESULT_CACHE_BACKENDS}, got '{backend}'")
