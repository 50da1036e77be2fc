"""One client can neither take the server down nor starve the others (issue 34): hostile grammars,
work multipliers, error shapes, cache keys, keys, streams. Each test sends the hostile request
and checks that a normal request beside it is still served and the engine still runs.

The server runs the built-in SmolLM2 (grammars need its byte-level tokenizer) with a grammar
budget of 1 s, so that a budget overrun is reached quickly."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import threading
import time

import httpx
import pytest

from fivefold.cache.result_cache import ResultCache
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.generation import MAX_LOGPROB_ENTRIES
from tests.serve.conftest import running_server

BUDGET_S = 1.0
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NORMAL = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
# llguidance refuses, after some steps, a token its own mask allowed (the finding that killed the server)
AMBIGUOUS = ('start: s\ns: s s | "a" | "b" | ' + " | ".join(f"t{k}" for k in range(60)) + "\n"
             + "".join(f"t{k}: s s\n" for k in range(60)))
SLOW = 'start: s\ns: s s s | s s | "a" | "b" | "ab" | "ba"\n'  # 0.3-0.7 s a token by token 300


@pytest.fixture(scope="module")
def server(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=96 << 20, grammar_budget_s=BUDGET_S)))
    engine.engine.warm_up_structured_output()
    with running_server(build_app(engine, "smol", api_key=API_KEY, result_cache=ResultCache())) as url:
        yield url, engine
    engine.shutdown()


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120, **kw)


def _is_openai_error(r: httpx.Response) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "code"} <= set(error) and bool(error["message"])


def _alongside(url: str, engine, hostile) -> httpx.Response:
    """Send ``hostile()`` (a function making one request) with a normal request running beside it;
    return the hostile answer after checking the normal one completed and the engine lives."""
    normal: list = []
    beside = NORMAL | {"max_tokens": 24, "temperature": 0.5, "ignore_eos": True}  # sampled: never a cache hit
    thread = threading.Thread(target=lambda: normal.append(_post(url, "/v1/completions", beside)))
    thread.start()
    answer = hostile()
    thread.join(120)
    assert normal and normal[0].status_code == 200, normal[0].text if normal else "no answer"
    assert normal[0].json()["usage"]["completion_tokens"] == 24
    assert engine.is_running
    return answer


# -- 1, 2: grammars ----------------------------------------------------------------------------
def test_a_grammar_that_fails_midway_ends_its_request_alone(server):
    url, engine = server
    body = NORMAL | {"guided_grammar": AMBIGUOUS, "max_tokens": 100, "logit_bias": {"64": -100, "65": -100}}
    r = _alongside(url, engine, lambda: _post(url, "/v1/completions", body))
    assert r.status_code == 400 and _is_openai_error(r), r.text
    assert r.json()["error"]["code"] == "grammar_error" and "grammar" in r.json()["error"]["message"]
    # streamed: the error arrives as an event of that stream, then [DONE]
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=AUTH, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and any("grammar_error" in e for e in events[:-1]), events[-3:]
    assert _post(url, "/v1/completions", NORMAL).status_code == 200 and engine.is_running


def test_a_slow_grammar_ends_at_its_budget_naming_it(server):
    url, engine = server
    body = NORMAL | {"guided_grammar": SLOW, "max_tokens": 400, "temperature": 1.0, "seed": 3}
    r = _alongside(url, engine, lambda: _post(url, "/v1/completions", body))
    assert r.status_code == 400 and _is_openai_error(r), r.text
    assert f"budget of {BUDGET_S:g} s" in r.json()["error"]["message"]


def test_grammar_work_runs_off_the_engine_thread(server):
    """The engine thread only copies masks: a grammar's compile and masks run in the grammar
    threads, so a mask that takes seconds never holds the others' step."""
    from fivefold.engine import structured_output

    url, engine = server
    seen: set[str] = set()
    original = structured_output.Grammar._work

    def spy(self, token_id):
        seen.add(threading.current_thread().name)
        return original(self, token_id)

    structured_output.Grammar._work = spy
    try:
        r = _post(url, "/v1/completions", NORMAL | {"guided_choice": ["yes", "no"]})
    finally:
        structured_output.Grammar._work = original
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    assert seen and all(name.startswith("fivefold-grammar") for name in seen), seen


# -- 3: every answer in the OpenAI error shape ---------------------------------------------------
DEEP_SCHEMA = {"type": "object", "properties": {}}
_node = DEEP_SCHEMA
for _ in range(200):
    _node["properties"]["x"] = {"type": "object", "properties": {}}
    _node = _node["properties"]["x"]
BAD_CALL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                "tool_calls": [{"id": "c1", "type": "function", "function": "f"}]},
            {"role": "tool", "content": "1", "tool_call_id": "c1"}]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", NORMAL | {"guided_json": "5"}, "guided_json"),
    ("/v1/completions", NORMAL | {"guided_json": "true"}, "guided_json"),
    ("/v1/completions", NORMAL | {"guided_json": "null"}, "guided_json"),
    ("/v1/completions", NORMAL | {"guided_json": "[1, 2]"}, "guided_json"),
    ("/v1/completions", NORMAL | {"structured_outputs": {"json": "7"}}, "structured_outputs"),
    ("/v1/completions", NORMAL | {"guided_json": DEEP_SCHEMA}, "nested more than"),
    ("/v1/chat/completions", {"model": "smol", "max_tokens": 4, "messages": BAD_CALL}, "messages[1].tool_calls[0].function"),
    ("/v1/chat/completions", {"model": "smol", "max_tokens": 4,
                              "messages": [BAD_CALL[0], BAD_CALL[1] | {"tool_calls": [{"function": 5}]}]},
     "messages[1].tool_calls[0].function"),
    ("/tokenize", {"model": "smol", "messages": BAD_CALL}, "messages[1].tool_calls[0].function"),
], ids=["json-5", "json-true", "json-null", "json-array", "structured-outputs-scalar", "schema-200-deep",
        "tool-call-function-string", "tool-call-function-number", "tokenize-tool-call"])
def test_malformed_constraints_and_tool_calls_are_400s_naming_the_field(server, path, body, field):
    url, _ = server
    r = _post(url, path, body)
    assert r.status_code == 400 and _is_openai_error(r), r.text
    assert field in r.json()["error"]["message"], r.json()


ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/smol", "/tokenize", "/detokenize",
          "/health", "/metrics", "/version", "/admin/prompt-version", "/no/such/route", "/v1/embeddings"]
BODIES = {"none": None, "bad-json": b'{"prompt": ', "huge": b"[" * (2 << 20),
          "deep": b"[" * 400_000 + b"]" * 400_000}


def test_every_route_and_method_answers_in_the_openai_shape(server):
    """Every route x GET/POST/PUT/DELETE x {no body, bad JSON, a body over the limit, one nested
    400,000 deep}, with and without the API key: every answer that is not a success is an OpenAI
    error body, and the server still serves."""
    url, engine = server
    num_errors = 0
    with httpx.Client(timeout=60) as client:
        for route in ROUTES:
            for method in ("GET", "POST", "PUT", "DELETE"):
                for name, body in BODIES.items():
                    for headers in (AUTH, {}):
                        r = client.request(method, f"{url}{route}", content=body,
                                           headers=headers | {"content-type": "application/json"})
                        if r.status_code >= 400:
                            num_errors += 1
                            assert _is_openai_error(r), (method, route, name, r.status_code, r.text[:200])
                        else:
                            assert method == "GET" and route in ("/v1/models", "/v1/models/smol", "/health",
                                                                 "/metrics", "/version"), (method, route, name)
    assert num_errors > 300
    assert _post(url, "/v1/completions", NORMAL).status_code == 200 and engine.is_running


# -- 4: an empty prompt list ---------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_prompt_list_is_a_400(server, stream):
    url, _ = server
    r = _post(url, "/v1/completions", NORMAL | {"prompt": [], "stream": stream})
    assert r.status_code == 400 and _is_openai_error(r) and "prompt" in r.json()["error"]["message"], r.text


# -- 5: result-cache keys ------------------------------------------------------------------------
def test_schemas_that_differ_only_in_property_order_get_their_own_answers(server):
    url, _ = server
    a = {"type": "object", "properties": {"name": {"enum": ["x"]}, "age": {"enum": [1]}},
         "required": ["name", "age"], "additionalProperties": False}
    b = a | {"properties": {"age": {"enum": [1]}, "name": {"enum": ["x"]}}}  # the same but for the order
    first = _post(url, "/v1/completions", NORMAL | {"max_tokens": 30, "guided_json": a})
    second = _post(url, "/v1/completions", NORMAL | {"max_tokens": 30, "guided_json": b})
    assert first.json()["choices"][0]["text"] == '{"name":"x","age":1}'
    assert second.json()["choices"][0]["text"] == '{"age":1,"name":"x"}', second.headers.get("x-cache")
    assert first.headers["x-cache"] == second.headers["x-cache"] == "miss"


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-3, 3)
    if kind == 1:
        return rng.choice(["a", "b", "", "\u00e9"])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.random()
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice("pqrs") + str(i): _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _perturb(rng: random.Random, value, reorder: bool = True):
    """A value that differs from ``value`` in some way a model's output can see (a reordered object
    counts: property and argument order is written into grammars and prompts)."""
    if reorder and isinstance(value, dict) and len(value) > 1 and rng.random() < 0.5:
        items = list(value.items())
        while list(value.items()) == items:
            rng.shuffle(items)
        return dict(items)
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        return value | {key: _perturb(rng, value[key])}
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        return value[:i] + [_perturb(rng, value[i])] + value[i + 1:]
    while True:
        other = _random_json(rng)
        if json.dumps(other) != json.dumps(value):
            return other


def test_requests_that_can_differ_in_output_never_share_a_key():
    """Property test of the cache key over the fields a request carries: a random request, then one
    field changed (values, nesting, or the order of a nested object): never the same key. And the
    same request with its top-level fields or its logit_bias reordered: always the same key."""
    from fivefold.cache.result_cache import ResultCache, canonical_request
    from fivefold.serve.protocol import ChatCompletionRequest

    rng = random.Random(5)
    fields = ["messages", "tools", "guided_json", "response_format", "stop", "max_tokens", "seed", "logit_bias",
              "structured_outputs", "temperature", "n"]
    for _ in range(500):
        request = {"messages": [{"role": "user", "content": rng.choice(["hi", "yo"])}], "temperature": 0,
                   **{f: _random_json(rng) for f in rng.sample(fields[1:], 4)}}
        key = lambda r: ResultCache.make_key("fp", "v1", canonical_request(r))  # noqa: E731
        changed = rng.choice(list(request))
        other = request | {changed: _perturb(rng, request[changed], reorder=changed != "logit_bias")}
        assert key(request) != key(other), (changed, request[changed], other[changed])
        shuffled = dict(rng.sample(list(request.items()), len(request)))
        assert key(request) == key(shuffled)
    bias = {"logit_bias": {"5": 1.0, "7": -1.0}}
    assert ResultCache.make_key("fp", "v1", canonical_request(bias)) == \
        ResultCache.make_key("fp", "v1", canonical_request({"logit_bias": {"7": -1.0, "5": 1.0}}))
    # and what the server dumps keeps a schema's property order
    dumped = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                   guided_json={"b": 1, "a": 2}).model_dump()
    assert list(dumped["guided_json"]) == ["b", "a"]


# -- 6, 7: work bounds, and CPU work off the event loop ------------------------------------------
def test_work_multipliers_are_bounded_with_a_400_naming_the_limit(server):
    url, _ = server
    prompts = ["word " * 500] * 64
    r = _post(url, "/v1/completions", NORMAL | {"prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 0, "n": 16})
    assert r.status_code == 400 and _is_openai_error(r), r.text
    assert str(MAX_LOGPROB_ENTRIES) in r.json()["error"]["message"]


def test_echo_text_offsets_are_the_running_sum_of_token_lengths(server):
    url, _ = server
    r = _post(url, "/v1/completions", NORMAL | {"prompt": "One two three four five", "echo": True, "logprobs": 1,
                                                "max_tokens": 3})
    logprobs = r.json()["choices"][0]["logprobs"]
    offsets, position = [], 0
    for token in logprobs["tokens"]:
        offsets.append(position)
        position += len(token)
    assert logprobs["text_offset"] == offsets and len(offsets) > 5


def test_tokenization_and_large_bodies_run_off_the_event_loop(server):
    """While a large prompt is tokenized, the event loop stays free: the tokenizer runs in a worker
    thread, never on the loop's own (which also answers /health)."""
    url, engine = server
    tokenizer = engine.engine.tokenizer
    threads: set[str] = set()
    original = tokenizer.encode

    def spy(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            threads.add("an event loop's thread")
        except RuntimeError:
            threads.add("a worker thread")
        return original(*args, **kwargs)

    tokenizer.encode = spy
    try:
        assert _post(url, "/v1/completions", NORMAL | {"prompt": "word " * 50}).status_code == 200
        assert _post(url, "/v1/chat/completions", {"model": "smol", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
        assert _post(url, "/tokenize", {"model": "smol", "prompt": "hi"}).status_code == 200
    finally:
        del tokenizer.encode
    assert threads == {"a worker thread"}, threads


def test_tokenize_and_detokenize_need_the_key_and_keep_the_limits(server):
    url, engine = server
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 401 and _is_openai_error(r), (path, r.text)
        assert _post(url, path, body).status_code == 200
    limit = engine.engine.max_model_len
    r = _post(url, "/tokenize", {"prompt": "word " * (limit + 10)})
    assert r.status_code == 400 and f"maximum context length is {limit}" in r.json()["error"]["message"]
    r = _post(url, "/detokenize", {"tokens": [1] * (limit + 1)})
    assert r.status_code == 400 and _is_openai_error(r)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # liveness stays open


# -- 10: keys ------------------------------------------------------------------------------------
def test_empty_keys_are_refused_at_start_and_the_admin_key_comes_before_the_body(smollm2):
    from fivefold.errors import FivefoldError
    from fivefold.serve.http_base import build_base_app

    for key in ("", "   "):
        with pytest.raises(FivefoldError, match="--api-key is empty"):
            build_base_app("m", lambda: "", api_key=key)
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=8 << 20)))
    try:
        with pytest.raises(FivefoldError, match="admin-key"):
            build_app(engine, "smol", admin_key="")
        with running_server(build_app(engine, "smol", admin_key="admin")) as url:
            for body in (b"not json", b'{"version": 5}', b'{"version": "v2"}'):
                r = httpx.post(f"{url}/admin/prompt-version", content=body, timeout=10,
                               headers={"Authorization": "Bearer wrong", "content-type": "application/json"})
                assert r.status_code == 401 and _is_openai_error(r), r.text
                r = httpx.post(f"{url}/admin/prompt-version", content=body, timeout=10,
                               headers={"content-type": "application/json"})
                assert r.status_code == 401, r.text
            r = httpx.post(f"{url}/admin/prompt-version", content=b'{"version": 5}', timeout=10,
                           headers={"Authorization": "Bearer admin", "content-type": "application/json"})
            assert r.status_code == 422 and _is_openai_error(r), r.text
    finally:
        engine.shutdown()


def test_the_cli_refuses_an_empty_api_key_in_one_line(tmp_path):
    import subprocess
    import sys

    for args, env in ((["--api-key", ""], {}), ([], {"FIVEFOLD_ADMIN_KEY": ""})):
        out = subprocess.run([sys.executable, "-m", "fivefold", "serve", "--model", "smollm2-135m-instruct", *args],
                             capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, **env})
        assert out.returncode != 0 and "is empty" in out.stderr, out.stderr[-500:]
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# -- 11: streams ---------------------------------------------------------------------------------
def test_a_client_that_leaves_before_its_first_token_aborts_its_request(smollm2, caplog):
    """One sequence at a time: a long request runs, a streamed one waits behind it; its client gives up
    before the first token. The waiting request must leave the engine then, not after it ran, and
    the server logs no error for it (a client leaving is not an exception in the application, and
    the cancelled work's futures are not left unretrieved)."""
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=48 << 20, max_num_seqs=1)))
    answers: list = []
    try:
        with running_server(build_app(engine, "smol")) as url:
            long = threading.Thread(target=lambda: answers.append(httpx.post(
                f"{url}/v1/completions", timeout=300, json=NORMAL | {"max_tokens": 300, "ignore_eos": True})))
            long.start()
            deadline = time.time() + 60
            while not engine.engine.requests and time.time() < deadline:
                time.sleep(0.05)
            assert engine.engine.requests, answers[0].text if answers else "the long request never started"
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=NORMAL | {"stream": True}, timeout=2.0)
            deadline = time.time() + 5
            while len(engine.engine.requests) > 1 and time.time() < deadline:
                time.sleep(0.05)
            assert len(engine.engine.requests) == 1, list(engine.engine.requests)  # only the long one
            assert long.is_alive()  # ... which is still running: the abort came from the disconnect
            long.join(300)
            assert answers[0].status_code == 200
        gc.collect()  # an unretrieved future's error is logged when it is collected
        errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
    finally:
        engine.shutdown()


def test_a_stream_nobody_reads_is_aborted_at_its_backlog(smollm2, monkeypatch):
    """The app driven over ASGI by a client that never takes a body chunk: its choice is aborted once
    MAX_STREAM_BACKLOG outputs wait, instead of generating into an unbounded queue."""
    from fivefold.serve import choices

    monkeypatch.setattr(choices, "MAX_STREAM_BACKLOG", 4)
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=16 << 20)))
    app = build_app(engine, "smol")
    body = json.dumps(NORMAL | {"stream": True, "max_tokens": 300, "ignore_eos": True}).encode()

    async def run():
        never = asyncio.Event()
        sent = {"body": False}

        async def receive():
            if not sent["body"]:
                sent["body"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                await never.wait()  # the client reads nothing

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("test", 1),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        task = asyncio.ensure_future(app(scope, receive, send))
        seq, deadline = None, time.time() + 120
        while time.time() < deadline and (seq is None or seq.request_id in engine.engine.requests):
            await asyncio.sleep(0.05)
            if seq is None and engine.engine.requests:
                seq = next(iter(engine.engine.requests.values())).seq
        task.cancel()
        return seq

    try:
        seq = asyncio.run(run())
        assert seq is not None and seq.finish_reason == "abort" and seq.num_output_tokens < 40, seq
        assert not engine.engine.requests
    finally:
        engine.shutdown()
