"""The result cache in front of the engine: hits never reach it, sampled requests are
not cached, a prompt-version change invalidates, no-cache bypasses."""

from __future__ import annotations

import httpx
import openai
import pytest

from fivefold.cache.result_cache import ResultCache
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.serve.conftest import running_server

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def server(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20)))
    cache = ResultCache(max_entries=8)
    with running_server(build_app(engine, MODEL, result_cache=cache, prompt_version="v1", admin_key=ADMIN)) as url:
        yield url, engine, cache
    engine.shutdown()


def post(url, body, **headers):
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, headers=headers, timeout=60)


def test_hit_miss_version_and_bypass(server):
    url, engine, cache = server
    body = {"prompt": "Result cache: the sky is", "temperature": 0, "max_tokens": 8}
    first = post(url, body)
    assert first.headers["x-cache"] == "miss"
    queries = engine.engine.kv_cache.stats.num_queries
    second = post(url, body)
    assert second.headers["x-cache"] == "hit"
    assert second.json()["choices"] == first.json()["choices"] and second.json()["usage"] == first.json()["usage"]
    assert engine.engine.kv_cache.stats.num_queries == queries, "a hit must not reach the engine"
    # a streamed hit returns the same text
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    chunks = list(client.completions.create(model=MODEL, stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.json()["choices"][0]["text"]
    assert engine.engine.kv_cache.stats.num_queries == queries
    # Cache-Control: no-cache goes to the engine
    assert post(url, body, **{"Cache-Control": "no-cache"}).headers["x-cache"] == "bypass"
    # a client cannot set the prompt version (it would purge the cache for everyone)
    refused = post(url, body, **{"X-Prompt-Version": "v2"})
    assert refused.status_code == 400 and "X-Prompt-Version is not accepted" in refused.json()["error"]["message"]
    assert post(url, body).headers["x-cache"] == "hit"
    # the operator's new prompt version makes the old entry unreachable and purges it
    num_entries = len(cache)
    assert num_entries >= 1
    changed = set_version(url, "v2")
    assert changed.status_code == 200, changed.text
    assert changed.json() == {"object": "prompt_version", "version": "v2", "previous": "v1",
                              "num_purged": num_entries}
    assert len(cache) == 0
    assert post(url, body).headers["x-cache"] == "miss"
    assert post(url, body).headers["x-cache"] == "hit"
    assert httpx.get(url + "/admin/prompt-version", headers=auth(ADMIN)).json()["version"] == "v2"


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def set_version(url, version, key=ADMIN):
    return httpx.post(url + "/admin/prompt-version", json={"version": version}, headers=auth(key), timeout=30)


@pytest.mark.parametrize("key,body,status,message", [
    (None, {"version": "v3"}, 401, "invalid or missing admin key"),
    ("wrong", {"version": "v3"}, 401, "invalid or missing admin key"),
    (ADMIN, {"version": "v 3"}, 400, "version must be 1-64 characters"),
    (ADMIN, {"version": "x" * 65}, 400, "version must be 1-64 characters"),
    (ADMIN, {"version": 3}, 422, "version"),
    (ADMIN, {"version": "v3", "extra": 1}, 422, "extra"),
])
def test_admin_endpoint_refuses_bad_keys_and_versions(server, key, body, status, message):
    url, _, _ = server
    headers = {} if key is None else auth(key)
    reply = httpx.post(url + "/admin/prompt-version", json=body, headers=headers, timeout=30)
    assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text


def test_admin_endpoints_are_off_without_an_admin_key(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=16 << 20)))
    with running_server(build_app(engine, MODEL, result_cache=ResultCache())) as url:
        for reply in (httpx.get(url + "/admin/prompt-version"), set_version(url, "v2", key="anything")):
            assert reply.status_code == 403 and "--admin-key" in reply.json()["error"]["message"]
    engine.shutdown()


def test_only_deterministic_requests_are_cached(server):
    url, _, cache = server
    sampled = {"prompt": "Once upon a time", "temperature": 0.8, "max_tokens": 4}
    assert post(url, sampled).headers["x-cache"] == "bypass"
    assert post(url, sampled).headers["x-cache"] == "bypass"
    seeded = dict(sampled, seed=3)
    assert post(url, seeded).headers["x-cache"] == "miss"
    hit = post(url, seeded)
    assert hit.headers["x-cache"] == "hit"
