"""The LLM server's use of the result cache: the prompt version, keys, lookups, stores and
replays of cached answers.

Deterministic requests (temperature 0 or a seed) are answered from the cache when the same
request was answered before under the same prompt version; ``X-Cache: hit|miss|bypass`` says
which, and ``Cache-Control: no-cache`` bypasses it. The prompt version is the operator's
(``--prompt-version``, then ``POST /admin/prompt-version``); a replica behind a front takes it
from the front's header on each request instead.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request

from fivefold.cache.result_cache import ResultCache, canonical_request, is_cacheable
from fivefold.serve.choices import sse
from fivefold.serve.config import check_label
from fivefold.serve.engine_client import EngineClient
from fivefold.serve.http_base import FRONT_VERSION_HEADER


def served_model_identity(client: EngineClient) -> str:
    """What identifies the served weights in result-cache keys: a hash of the checkpoint's
    content (not its path), so replicas on different machines share keys, the dtype, and the
    quantization applied while loading (int8 weights give other results than float ones)."""
    from fivefold.models.fingerprint import weights_fingerprint

    identity = f"{weights_fingerprint(client.model_path)}|{client.dtype}"
    quantization = getattr(client, "quantization", None)
    return identity if quantization is None else f"{identity}|{quantization}"


class ServedResultCache:
    """The current prompt version and, when the server has a result cache, its keys and entries
    for this model (``metrics``: the server's, counting hits and misses)."""

    def __init__(self, cache: ResultCache | None, identity: str, prompt_version: str | None = None,
                 behind_front: bool = False, metrics=None) -> None:
        self.cache, self.identity, self.behind_front, self.metrics = cache, identity, behind_front, metrics
        self.version = check_label("prompt version", prompt_version or getattr(cache, "version", "v1"))

    def current_version(self) -> str:
        return self.version

    async def change_version(self, version: str) -> dict:
        """Make ``version`` current (the admin route); the old version's entries are purged."""
        self.version = version
        return {"num_purged": 0 if self.cache is None else await self.cache.set_version(version)}

    async def lookup(self, endpoint: str, req, request: Request) -> tuple[str | None, dict | None, str]:
        """(key or None, cached body or None, X-Cache value)."""
        if self.cache is None:
            return None, None, "bypass"
        fields = req.model_dump(exclude={"stream", "stream_options", "user", "model"})
        if "no-cache" in request.headers.get("cache-control", "") or not is_cacheable(fields):
            return None, None, "bypass"
        version = self.version
        if self.behind_front and request.headers.get(FRONT_VERSION_HEADER):
            version = check_label("prompt version", request.headers[FRONT_VERSION_HEADER])
        await self.cache.set_version(version)  # a no-op unless the version changed
        key = ResultCache.make_key(self.identity, version, {"endpoint": endpoint, **canonical_request(fields)})
        body = await self.cache.get(key)
        if self.metrics is not None:
            self.metrics.result_cache_lookup(body is not None)
        return key, body, "hit" if body is not None else "miss"

    async def store(self, key: str | None, body: dict) -> None:
        """Keep an answer under its key (None: the request was not cacheable)."""
        if key is not None:
            await self.cache.put(key, body)


def fresh_ids(body: dict, prefix: str) -> dict:
    """A cached answer with a new id and creation time, as a new answer has."""
    return body | {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time())}


async def cached_events(body: dict, chunk_object: str, include_usage: bool, is_chat: bool) -> AsyncIterator[str]:
    """A cached answer as the stream that would have produced it: each choice in one chunk."""
    head = {"id": body["id"], "object": chunk_object, "created": body["created"], "model": body["model"]}
    for c in body["choices"]:
        if is_chat:
            role = {"role": "assistant", "content": ""}
            yield sse(head | {"choices": [{"index": c["index"], "delta": role, "logprobs": None,
                                           "finish_reason": None}]})
            message = c["message"]
            delta = {"index": c["index"], "delta": {"content": message["content"]}}
            if message.get("tool_calls"):
                delta["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        else:
            delta = {"index": c["index"], "text": c["text"]}
        yield sse(head | {"choices": [delta | {"logprobs": c["logprobs"], "finish_reason": c["finish_reason"]}]})
    if include_usage:
        yield sse(head | {"choices": [], "usage": body["usage"]})
    yield sse("[DONE]")
