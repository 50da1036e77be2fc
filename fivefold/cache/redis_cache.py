"""The request-result cache on Redis, shared by every replica and every front.

Same keys, same interface and same rules as the in-process :class:`ResultCache`
(``make_key``, ``get``, ``put``, ``set_version``; only deterministic requests are
cached, an entry over the byte bound is not stored). What changes is where the bounds
live:

- bytes: Redis's own ``maxmemory`` with an LRU ``maxmemory-policy``. When the server
  has no bound (``maxmemory 0``) or a policy that does not evict, the cache sets
  ``maxmemory`` to ``max_bytes`` and the policy to ``allkeys-lru`` (a Redis kept for
  this cache is the expected set-up; a managed Redis that forbids CONFIG is left as
  it is, with a warning);
- entries: no count bound, as in any Redis cache; memory is the bound.

Layout: ``{namespace}:version`` holds the current prompt version and each entry is
``{namespace}:{version}:{sha256}`` with the JSON body as its value. A version change
(``set_version``) swaps the stored version and deletes every entry of other versions,
whichever replica saw the change first, so a version bump invalidates for all.

Redis failures never fail a request: a lookup that cannot reach Redis is a miss, a
store is dropped, and both are counted (``num_errors``). After a failure the cache
stays out of the way for ``retry_after`` seconds, so that a Redis that went away costs
one timeout, not one per request (calls are synchronous and short on a reachable Redis:
one round trip each).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from fivefold.cache.result_cache import ResultCache, ResultCacheStats
from fivefold.errors import FivefoldError

log = logging.getLogger(__name__)

LRU_POLICIES = ("allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu")


class RedisResultCache:
    """``ResultCache``'s interface over a Redis server at ``url`` (``redis://HOST:PORT[/DB]``)."""

    make_key = staticmethod(ResultCache.make_key)

    def __init__(self, url: str, max_bytes: int = 64 << 20, version: str = "v1",
                 namespace: str = "fivefold:result", timeout: float = 1.0,
                 retry_after: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise FivefoldError("the Redis result cache needs the redis package: "
                                "pip install 'fivefold[cluster]'") from None
        if max_bytes < 1:
            raise FivefoldError(f"result cache bytes must be >= 1, got {max_bytes}")
        self.url, self.max_bytes, self.namespace = url, max_bytes, namespace
        self._errors = (redis.RedisError, OSError)
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
            self.client.ping()
        except (ValueError, *self._errors) as exc:
            raise FivefoldError(f"cannot use Redis at {url}: {exc}") from None
        self.version = version
        self.stats = ResultCacheStats()
        self.num_errors = 0
        self.retry_after = retry_after
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._bound_memory()
        self.set_version(version)

    def _bound_memory(self) -> None:
        """Make sure Redis evicts least-recently-used keys past ``max_bytes`` (see module doc)."""
        try:
            config = self.client.config_get("maxmemory*")
            if int(config.get("maxmemory", 0)) == 0:
                self.client.config_set("maxmemory", self.max_bytes)
            if config.get("maxmemory-policy") not in LRU_POLICIES:
                self.client.config_set("maxmemory-policy", "allkeys-lru")
        except self._errors as exc:
            log.warning("could not check or set Redis maxmemory at %s (%s); its own settings apply", self.url, exc)

    @property
    def _version_key(self) -> str:
        return f"{self.namespace}:version"

    def _entry_key(self, key: str) -> str:
        return f"{self.namespace}:{self.version}:{key}"

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_after
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            log.warning("Redis result cache at %s failed (%d so far): %s", self.url, self.num_errors, exc)

    def set_version(self, version: str) -> None:
        """Make ``version`` current for every user of this Redis; delete the entries of other versions."""
        with self._lock:
            self.version = version
            if self._is_down():
                return
            try:
                previous = self.client.set(self._version_key, version, get=True)
                if previous is None or previous.decode() == version:
                    return
                keep = f"{self.namespace}:{version}:".encode()
                stale = [k for k in self.client.scan_iter(match=f"{self.namespace}:*", count=1000)
                         if not k.startswith(keep) and k != self._version_key.encode()]
                for start in range(0, len(stale), 1000):
                    self.client.unlink(*stale[start:start + 1000])
                self.stats.purged += len(stale)
            except self._errors as exc:
                self._failed(exc)

    def get(self, key: str) -> Any | None:
        try:
            data = None if self._is_down() else self.client.get(self._entry_key(key))
        except self._errors as exc:
            self._failed(exc)
            data = None
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return json.loads(data)

    def put(self, key: str, value: Any) -> None:
        data = json.dumps(value, separators=(",", ":"))
        if len(data) > self.max_bytes or self._is_down():
            return
        try:
            self.client.set(self._entry_key(key), data)
        except self._errors as exc:
            self._failed(exc)

    def keys(self) -> list[str]:
        """Entry keys of the current version (unordered: Redis keeps the LRU clock itself)."""
        prefix = f"{self.namespace}:{self.version}:"
        return [k.decode()[len(prefix):] for k in self.client.scan_iter(match=prefix + "*", count=1000)]

    def __len__(self) -> int:
        return len(self.keys())
