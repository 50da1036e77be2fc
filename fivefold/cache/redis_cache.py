"""The request-result cache on Redis, shared by every replica of a deployment.

Same keys, same async interface and same rules as the in-process :class:`ResultCache`
(``make_key``, ``get``, ``put``, ``set_version``, ``keys``; only deterministic requests
are cached, an entry over the byte bound is not stored). Calls go through
``redis.asyncio``, so a slow Redis delays the request that waits for it, never the
server's event loop.

Namespaces: every key starts with ``fivefold:{namespace}:``, where the server's namespace
is its ``--cache-namespace`` plus the served model's content fingerprint. Two deployments
on one Redis (another model, or the same model with another namespace) never read,
version or purge each other's entries. ``fivefold:{namespace}:version`` holds the prompt
version and each entry is ``fivefold:{namespace}:{version}:{sha256}``. A version change
swaps the stored version and deletes the namespace's entries of other versions, once,
whichever process saw the change first.

Bounds: Redis's own ``maxmemory`` with an LRU ``maxmemory-policy`` bounds the bytes (no
count bound, as in any Redis cache). The cache never changes a server's configuration
unless asked (``--redis-configure-lru``: set ``maxmemory`` to ``max_bytes`` when it is 0
and the policy to ``allkeys-lru`` when it does not evict); otherwise a server that would
grow without bound gets a warning at start.

Failures never fail a request: a lookup that cannot reach Redis is a miss, a store is
dropped, and both are counted (``num_errors``). After a failure the cache stays out of
the way for ``retry_after`` seconds, so a Redis that went away costs one timeout, not
one per request. URLs are logged and reported with their password masked.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any
from urllib.parse import urlsplit

from fivefold.cache.result_cache import ResultCache, ResultCacheStats
from fivefold.errors import FivefoldError

log = logging.getLogger(__name__)

LRU_POLICIES = ("allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu")


def redact_url(url: str) -> str:
    """``url`` with its password masked: ``user:***@``, a token-only user as ``***@``, and a
    ``password=`` query parameter (``unix://`` URLs) as ``password=***``."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return "<unparseable Redis URL>"
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        masked = f"{user.partition(':')[0]}:***@{host}" if ":" in user else f"***@{host}"
        url = url.replace(netloc, masked, 1)
    return re.sub(r"([?&])password=[^&#]*", r"\1password=***", url)


class RedisResultCache:
    """``ResultCache``'s interface over a Redis server at ``url`` (``redis://[USER:PASS@]HOST:PORT[/DB]``).

    ``version`` None adopts the version stored in the namespace (what a replica restarted
    behind a front does, so that it never reverts an operator's change); a string makes it
    current, published (and other versions' entries purged) by the first call."""

    make_key = staticmethod(ResultCache.make_key)

    def __init__(self, url: str, max_bytes: int = 64 << 20, version: str | None = "v1",
                 namespace: str = "default", configure_lru: bool = False, timeout: float = 1.0,
                 retry_after: float = 5.0) -> None:
        try:
            import redis
            import redis.asyncio
        except ImportError:
            raise FivefoldError("the Redis result cache needs the redis package: "
                                "pip install 'fivefold[cluster]'") from None
        if max_bytes < 1:
            raise FivefoldError(f"result cache bytes must be >= 1, got {max_bytes}")
        self.safe_url = redact_url(url)
        self.max_bytes, self.prefix = max_bytes, f"fivefold:{namespace}"
        self._errors = (redis.RedisError, OSError)
        self.stats = ResultCacheStats()
        self.num_errors = 0
        self.retry_after = retry_after
        self._down_until = 0.0
        # Start-up is synchronous (it runs before the server's loop, and a bad URL must fail
        # the command at once); serving uses the async client.
        try:
            with redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout) as client:
                client.ping()
                self._check_memory_bound(client, configure_lru)
                stored = client.get(self._version_key)
        except (ValueError, *self._errors) as exc:
            raise FivefoldError(f"cannot use Redis at {self.safe_url}: {exc}") from None
        stored = stored.decode() if stored is not None else None
        self.version = version or stored or "v1"
        # A new version is published (and the old entries purged) by the first call on the loop.
        self._is_published = stored == self.version
        self.client = redis.asyncio.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    def _check_memory_bound(self, client, configure_lru: bool) -> None:
        """Make Redis evict least-recently-used keys past ``max_bytes`` if asked; else warn when it won't."""
        try:
            config = client.config_get("maxmemory*")
        except self._errors as exc:  # a managed Redis may forbid CONFIG: its own settings apply
            log.warning("cannot read Redis maxmemory at %s (%s); its own settings apply", self.safe_url, exc)
            return
        unbounded = int(config.get("maxmemory", 0)) == 0
        no_lru = config.get("maxmemory-policy") not in LRU_POLICIES
        if not configure_lru:
            if unbounded or no_lru:
                log.warning("Redis at %s has maxmemory %s and policy %s: result-cache entries are never evicted; "
                            "set an LRU bound on the server or pass --redis-configure-lru", self.safe_url,
                            config.get("maxmemory"), config.get("maxmemory-policy"))
            return
        try:
            if unbounded:
                client.config_set("maxmemory", self.max_bytes)
            if no_lru:
                client.config_set("maxmemory-policy", "allkeys-lru")
        except self._errors as exc:
            log.warning("could not set Redis maxmemory at %s (%s); its own settings apply", self.safe_url, exc)

    @property
    def is_shared(self) -> bool:
        """True: every process on this Redis and namespace sees the same entries."""
        return True

    @property
    def _version_key(self) -> str:
        return f"{self.prefix}:version"

    def _entry_key(self, key: str) -> str:
        return f"{self.prefix}:{self.version}:{key}"

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_after
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            log.warning("Redis result cache at %s failed (%d so far): %s", self.safe_url, self.num_errors, exc)

    async def set_version(self, version: str) -> int:
        """Make ``version`` current for every process of this namespace; delete the entries of
        other versions (only the first process to see the change finds any). Returns how many."""
        if version == self.version and self._is_published:
            return 0
        self.version, self._is_published = version, False
        if self._is_down():
            return 0
        try:
            previous = await self.client.set(self._version_key, version, get=True)
            self._is_published = True
            if previous is None or previous.decode() == version:
                return 0
            keep, version_key = f"{self.prefix}:{version}:".encode(), self._version_key.encode()
            stale = [k async for k in self.client.scan_iter(match=f"{self.prefix}:*", count=1000)
                     if not k.startswith(keep) and k != version_key]
            for start in range(0, len(stale), 1000):
                await self.client.unlink(*stale[start:start + 1000])
            self.stats.purged += len(stale)
            return len(stale)
        except self._errors as exc:
            self._failed(exc)
            return 0

    async def _publish(self) -> None:
        if not self._is_published:
            await self.set_version(self.version)

    async def get(self, key: str) -> Any | None:
        await self._publish()
        try:
            data = None if self._is_down() else await self.client.get(self._entry_key(key))
        except self._errors as exc:
            self._failed(exc)
            data = None
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return json.loads(data)

    async def put(self, key: str, value: Any) -> None:
        data = json.dumps(value, separators=(",", ":"))
        if len(data) > self.max_bytes or self._is_down():
            return
        await self._publish()
        try:
            await self.client.set(self._entry_key(key), data)
        except self._errors as exc:
            self._failed(exc)

    async def keys(self) -> list[str]:
        """Entry keys of the current version (unordered: Redis keeps the LRU clock itself)."""
        prefix = f"{self.prefix}:{self.version}:"
        return [k.decode()[len(prefix):] async for k in self.client.scan_iter(match=prefix + "*", count=1000)]

    async def aclose(self) -> None:
        await self.client.aclose()
