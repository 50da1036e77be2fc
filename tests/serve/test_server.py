"""A real server on 127.0.0.1 (uvicorn in a thread) driven by the official openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import ServerMetrics
from tests.serve.conftest import running_server, wait_until_idle

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=512 << 20)), ServerMetrics(MODEL))
    app = build_app(engine, MODEL, api_key=API_KEY, max_body_bytes=64 << 10)
    with running_server(app) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=16)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 16 == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stream = list(client.chat.completions.create(stream=True, **kw))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full


def test_n_stop_seed_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=12)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=12)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and len({c.text for c in r.choices}) > 1
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=16).choices[0].text
    stop = greedy.split()[2]
    s = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=16, stop=[stop])
    assert s.choices[0].text == greedy[: greedy.index(stop)] and s.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=3, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 3 and all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


@pytest.mark.parametrize("body, status, message", [
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, 400, "temperature must be in [0, 2], got 3.0"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "exceeds the maximum context length 8192"),
    ({"model": MODEL, "prompt": "hi " * 9000}, 400, "the maximum context length is 8192"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' is not served here"),
    ({"model": MODEL, "prompt": ""}, 400, "the prompt is empty"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 422, "max_tokens"),
    ({"model": MODEL, "prompt": [70000]}, 400, "prompt token id 70000 is outside the vocabulary [0, 49152)"),
])
def test_bad_completion_requests(server, body, status, message):
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_empty_messages_malformed_json_big_body_and_api_key(server):
    url, auth = server[0], {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=auth)
    assert r.status_code == 400 and "messages is empty" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": ', headers=auth | {"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 70000}, headers=auth)
    assert r.status_code == 413 and "the limit is 65536 bytes" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_disconnected_streams_are_aborted_and_blocks_freed(server, client):
    engine = server[1].engine
    for _ in range(4):
        stream = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
    wait_until_idle(engine)
    assert not engine.has_unfinished
    assert engine.kv_cache.num_used_blocks == 0
    engine.kv_cache.check_integrity([])


def metric(text: str, name: str, **labels) -> float:
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            label_part = line[len(name):].split(" ")[0]
            parsed = dict(kv.split("=") for kv in label_part.strip("{}").split(",") if kv)
            if {k: v.strip('"') for k, v in parsed.items()} == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_after_known_traffic(server, client):
    url = server[0]
    before = httpx.get(url + "/metrics").text
    prompt = "Metrics test: the quick brown fox"
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    after = httpx.get(url + "/metrics").text
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    assert delta("fivefold:request_success_total", finished_reason="length") == 3
    assert delta("fivefold:generation_tokens_total") == 15
    num_prompt = len(server[1].tokenizer.encode(prompt))
    assert delta("fivefold:prompt_tokens_total") == 3 * num_prompt
    assert delta("fivefold:time_to_first_token_seconds_count") == 3
    assert delta("fivefold:inter_token_latency_seconds_count") == 12
    assert delta("fivefold:prefix_cache_queries_total") == 3 * num_prompt
    assert metric(after, "fivefold:num_requests_running") == 0 and metric(after, "fivefold:kv_cache_usage_perc") == 0


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    url, engine = server[0], server[1].engine
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "temperature": 0, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0)
    start = time.time()
    wait_until_idle(engine)
    assert not engine.has_unfinished, "400 tokens take ~13 s: only an abort empties the engine this soon"
    assert time.time() - start < 5
    assert engine.kv_cache.num_used_blocks == 0
    # The gauges follow the abort even though no step ran after it.
    after = httpx.get(url + "/metrics").text
    assert metric(after, "fivefold:num_requests_running") == 0
    assert metric(after, "fivefold:kv_cache_used_blocks") == 0
    assert metric(after, "fivefold:kv_cache_num_blocks") == engine.kv_cache.num_blocks


def test_version_and_model_card_endpoints(server):
    """GET /version; GET /v1/models/{id} is the served model's card, and any other id is 404
    model_not_found in OpenAI's error shape."""
    from fivefold import __version__

    url, auth = server[0], {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/version", headers=auth).json() == {"version": __version__}
    card = httpx.get(url + f"/v1/models/{MODEL}", headers=auth)
    assert card.status_code == 200 and card.json()["id"] == MODEL
    assert card.json() == httpx.get(url + "/v1/models", headers=auth).json()["data"][0]
    missing = httpx.get(url + "/v1/models/gpt-4", headers=auth)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and "gpt-4" in missing.json()["error"]["message"]
