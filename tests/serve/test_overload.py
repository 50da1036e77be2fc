"""Overload protection: 429 with Retry-After past the queue limits, 503 after the queue timeout."""

from __future__ import annotations

import time

import httpx
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.serve.conftest import running_server, wait_until_idle

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm2):
    # One sequence at a time, so a second request has to queue.
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20, max_num_seqs=1)),
                         max_queued_requests=2, max_queued_tokens=1000, queue_timeout=0.5)
    with running_server(build_app(engine, MODEL)) as url:
        yield url, engine
    engine.shutdown()


def test_queue_limits_give_429_with_retry_after(server):
    url, engine = server
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
    engine.admission.reserve(["fake-1", "fake-2"], 1)  # the queue is full
    try:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == "too many queued requests: the limit is 2"
    finally:
        engine.admission.release(["fake-1", "fake-2"])
    engine.admission.reserve(["fake-3"], 999)  # one place left, but only 1 token
    try:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["message"] == "too many queued prompt tokens: the limit is 1000"
    finally:
        engine.admission.release(["fake-3"])
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200


def test_queue_timeout_gives_503_and_leaves_the_queue(server):
    url, engine = server
    long_body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=long_body) as long:
        lines = long.iter_lines()
        next(lines)  # the long request is running and holds the only sequence slot
        for body in ({"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                     {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}):
            start = time.monotonic()
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503, r.text
            assert "the limit is 0.5 s" in r.json()["error"]["message"]
            assert 0.5 <= time.monotonic() - start < 5
        assert engine.num_queued_requests == 0
    wait_until_idle(engine.engine)  # closing the long stream aborted it
    assert not engine.engine.has_unfinished and engine.engine.kv_cache.num_used_blocks == 0
