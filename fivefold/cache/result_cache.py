"""Request-result cache: whole responses of deterministic requests, keyed by content.

Key: SHA-256 of (model fingerprint, prompt-template version, canonical request),
where the canonical request is the JSON of the prompt or messages and every
sampling parameter, fields in name order, nested objects in the order
sent (a schema's property order changes the output), logit_bias sorted. Only deterministic requests are cacheable
(temperature 0, or a fixed seed). LRU, bounded by entries and by bytes.
Changing the version (``set_version``) purges every entry of other versions.

The version is the operator's: ``fivefold serve --prompt-version`` at start, then
``POST /admin/prompt-version`` behind the admin key (fivefold/serve/http_base.py); an ordinary
request cannot set it, so no client can purge the cache for the others.

Both backends (this in-process LRU and the Redis one, redis_cache.py) have one async
interface, ``get``/``put``/``set_version``/``keys``, so the server awaits either without
blocking its event loop on the network.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class ResultCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    purged: int = 0


ORDERLESS_FIELDS = ("logit_bias",)  # mappings whose key order cannot change an answer


def canonical_request(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the order-free mappings sorted, everything else (schemas, tools, messages) as sent."""
    return {name: dict(sorted(value.items())) if name in ORDERLESS_FIELDS and isinstance(value, dict) else value
            for name, value in fields.items()}


def is_cacheable(request: dict[str, Any]) -> bool:
    """Deterministic requests only: greedy, or sampled with a fixed seed."""
    return request.get("temperature", 1.0) == 0 or request.get("seed") is not None


class ResultCache:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20, version: str = "v1") -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("result cache bounds must be positive")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.version = version
        self._entries: OrderedDict[str, tuple[str, Any, int]] = OrderedDict()  # key -> (version, value, bytes)
        self.num_bytes = 0
        self.stats = ResultCacheStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def is_shared(self) -> bool:
        """False: this cache lives in one process (each replica has its own)."""
        return False

    @staticmethod
    def make_key(model_fingerprint: str, version: str, request: dict[str, Any]) -> str:
        """The key of ``request``: its top-level fields in name order, every nested value as given.

        Nested keys are NOT sorted: the order of a JSON schema's properties is the order the
        grammar writes them, a tool's parameters are rendered into the prompt in their order;
        two requests that differ only there get different answers, so they get different keys.
        Nested mappings whose order cannot change the output (logit_bias) are sorted by the
        caller, :func:`canonical_request`."""
        fields = dict(sorted(request.items()))
        canonical = json.dumps([model_fingerprint, version, fields], separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()

    async def set_version(self, version: str) -> int:
        """Make ``version`` current and purge every entry of another version; return how many."""
        with self._lock:
            if version == self.version:
                return 0
            self.version = version
            stale = [k for k, (v, _, _) in self._entries.items() if v != version]
            for key in stale:
                _, _, nbytes = self._entries.pop(key)
                self.num_bytes -= nbytes
            self.stats.purged += len(stale)
            return len(stale)

    async def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != self.version:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry[1]

    async def put(self, key: str, value: Any) -> None:
        nbytes = len(json.dumps(value, separators=(",", ":")))
        with self._lock:
            if nbytes > self.max_bytes:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[2]
            self._entries[key] = (self.version, value, nbytes)
            self.num_bytes += nbytes
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, (_, _, evicted_bytes) = self._entries.popitem(last=False)
                self.num_bytes -= evicted_bytes
                self.stats.evictions += 1

    async def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)
