"""Every error a client can cause is a 4xx with an OpenAI error body, and the server still
answers a normal request afterwards: a sweep of hostile bodies against a tiny model."""

from __future__ import annotations

import json

import httpx
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server

LIMIT = 8192
# Mistral/Llama-2 style: user and assistant must alternate, else raise_exception.
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ m['content'] }} {% endfor %}")
OK = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "max_tokens": 2, "temperature": 0}


def _chunks(data: bytes, size: int = 1000):
    for i in range(0, len(data), size):
        yield data[i:i + size]


# (name, endpoint, body as JSON / raw bytes / a chunked generator factory, status, message fragment)
HOSTILE = [
    ("seed 2^64", "completions", {**OK, "seed": 2**64}, 400, "seed must be in [-9223372036854775808"),
    ("seed -2^63-1", "completions", {**OK, "seed": -(2**63) - 1}, 400, "seed must be in"),
    ("seed a float", "completions", {**OK, "seed": 1.5}, 422, "seed"),
    ("temperature 1e309", "completions", {**OK, "temperature": 1e308 * 10}, 400, "temperature must be in"),
    ("max_tokens 0", "completions", {**OK, "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("max_tokens 2^70", "completions", {**OK, "max_tokens": 2**70}, 400, "exceeds the maximum context length"),
    ("n 1000", "completions", {**OK, "n": 1000}, 400, "n must be in [1, 16]"),
    ("top_p 0", "completions", {**OK, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("top_k -5", "completions", {**OK, "top_k": -5}, 400, "top_k must be >= 0"),
    ("logprobs 10^6", "completions", {**OK, "logprobs": 10**6}, 400, "logprobs must be in"),
    ("17 stop strings", "completions", {**OK, "stop": ["x"] * 17}, 400, "stop must be at most 16"),
    ("empty stop string", "completions", {**OK, "stop": [""]}, 400, "stop must be at most 16 non-empty"),
    ("stop string of 2000 characters", "completions", {**OK, "stop": ["x" * 2000]}, 400,
     "each stop string must be at most 1024 characters"),
    ("prompt of wrong type", "completions", {**OK, "prompt": {"a": 1}}, 422, "prompt"),
    ("negative token id", "completions", {**OK, "prompt": [-1]}, 400, "prompt token id -1 is outside the vocabulary"),
    ("empty prompt", "completions", {**OK, "prompt": ""}, 400, "the prompt is empty"),
    ("not JSON", "completions", b'{"prompt": ', 400, "malformed JSON"),
    ("JSON array", "completions", b"[1, 2]", 422, ""),
    ("body over the limit", "completions", {**OK, "prompt": "w5 " * LIMIT}, 413, f"the limit is {LIMIT} bytes"),
    ("chunked body over the limit", "completions", lambda: _chunks(json.dumps({**OK, "prompt": "w5 " * LIMIT}).encode()),
     413, f"over the limit of {LIMIT} bytes"),
    ("unknown role", "chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ("roles that do not alternate", "chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]}, 400,
     "the chat template refused the messages: Conversation roles must alternate"),
    ("no messages", "chat/completions", {**CHAT, "messages": []}, 400, "messages is empty"),
]


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile")
    save_random_hf_model("llama", path, seed=4)
    loaded = load_model(str(path))
    loaded.tokenizer.hf.chat_template = ALTERNATING
    engine = AsyncEngine(LLMEngine(loaded, EngineConfig(block_size=4, kv_cache_memory_bytes=1 << 20)))
    with running_server(build_app(engine, "tiny", max_body_bytes=LIMIT)) as url:
        yield url
    engine.shutdown()


@pytest.mark.parametrize("name,endpoint,body,status,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_gets_a_4xx_error_body_and_the_server_still_answers(hostile_server, name, endpoint, body,
                                                                        status, message):
    url = f"{hostile_server}/v1/{endpoint}"
    headers = {"content-type": "application/json"}
    if isinstance(body, dict):
        r = httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=30)
    elif isinstance(body, bytes):
        r = httpx.post(url, content=body, headers=headers, timeout=30)
    else:  # a generator: httpx sends it with Transfer-Encoding: chunked, no Content-Length
        r = httpx.post(url, content=body(), headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and message in error["message"], error
    ok = httpx.post(f"{hostile_server}/v1/completions", json=OK, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_chunked_body_under_the_limit_is_served(hostile_server):
    r = httpx.post(f"{hostile_server}/v1/completions", content=_chunks(json.dumps(OK).encode(), 7),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_largest_and_smallest_seeds_run(hostile_server):
    for seed in (2**63 - 1, -(2**63)):
        body = {**OK, "seed": seed, "temperature": 1.0, "n": 2}
        r = httpx.post(f"{hostile_server}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
