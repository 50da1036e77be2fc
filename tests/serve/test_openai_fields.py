"""The OpenAI request fields clients really send, through the official openai client and raw
HTTP against the built-in model: content parts, batched prompts, echo (with prompt logprobs
and scoring), logit_bias, refused fields named in a 400, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.llm import LLM
from fivefold.sampling_params import SamplingParams
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import ServerMetrics
from tests.serve.conftest import running_server

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=128 << 20)), ServerMetrics(MODEL))
    with running_server(build_app(engine, MODEL)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(smollm2):
    return LLM(smollm2, kv_cache_memory_bytes=64 << 20)


def post(server, path, body):
    return httpx.post(server[0] + path, json=body, timeout=120)


def test_content_parts_equal_string_content(client):
    question = "What is the capital of France?"
    as_text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             temperature=0, max_tokens=12)
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    joined = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": question}]}], temperature=0, max_tokens=12)
    assert joined.choices[0].message.content == as_text.choices[0].message.content
    two = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                         temperature=0, max_tokens=12)
    assert two.usage.prompt_tokens > 0  # parts are joined by a newline (vLLM's rule) and run


def test_image_parts_and_bad_contents_are_refused_by_name(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and "content is required" in r.json()["error"]["message"]
    # null content is accepted on an assistant turn that carries tool calls
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = post(server, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]})
    assert r.status_code == 200, r.text


def test_batched_prompts_index_choices_as_openai(client, offline):
    prompts = ["One", "Two", "Three"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5)
    assert [c.index for c in r.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
        assert [r.choices[p * 2 + i].text for i in range(2)] == [alone, alone]
    tokenizer = offline.tokenizer
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 6 * 5  # no choice stops early on these prompts
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=5)
    assert [c.text for c in by_ids.choices] == [r.choices[p * 2].text for p in range(3)]
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5, stream=True))
    texts = {k: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == k)
             for k in range(3)}
    assert texts == {p: r.choices[p * 2].text for p in range(3)}


def test_echo_prepends_the_prompt_and_its_logprobs(client, offline):
    prompt = "The three primary colors are"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=2, echo=True)
    c = echoed.choices[0]
    assert c.text == prompt + plain.choices[0].text
    ids = offline.tokenizer.encode(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e["logprob"] for e in reference.prompt_logprobs[1:]],
                                                          abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    # scoring: echo with max_tokens 0 returns the prompt and its logprobs, no new token
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, echo=True,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


def test_logit_bias_through_the_server(client, offline):
    token = offline.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == " banana" * 3


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "hi", "suffix": "end"}, "suffix", "suffix (fill-in-the-middle insertion) is not supported"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of=3 with n=1 is not supported"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, None, "logit_bias names token id 99999"),
    ({"prompt": "hi", "logit_bias": {"5": 300}}, None, "logit_bias values must be in [-100, 100]"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 is accepted only with echo"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, None, "max_tokens must be >= 1, got -1"),
    ({"prompt": ["a", ""]}, "prompt", "the prompt is empty (prompt 1)"),
    ({"prompt": [[5], [70000]]}, "prompt", "prompt token id 70000 is outside the vocabulary"),
])
def test_unsupported_and_bad_fields_get_a_400_that_names_them(server, body, param, message):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_refused_chat_fields_and_nulls_that_ask_nothing(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
    # fields sent as null ask for nothing: accepted, as a client that fills every field sends them
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "audio": None, "suffix": None, "functions": None})
    assert r.status_code == 200, r.text


def test_tokenize_and_detokenize(server, offline):
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    ids = offline.tokenizer.encode("Hello world")
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == server[1].max_model_len
    assert "".join(r["token_strs"]) == offline.tokenizer.decode(ids, skip_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {
        "prompt": offline.tokenizer.decode(ids, skip_special_tokens=False)}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    usage = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert post(server, "/detokenize", {"tokens": [70000]}).status_code == 400
    assert post(server, "/tokenize", {}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def test_response_format_and_guided_fields(client):
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=100,
                                           temperature=temperature, seed=4, n=2)
        for c in r.choices:
            jsonschema.validate(json.loads(c.message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                       max_tokens=150, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                                 max_tokens=100, temperature=0, stream=True))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")


@pytest.mark.parametrize("extra, message", [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "ask for one output constraint, not 2"),
    ({"guided_json": '{"type": '}, "the JSON schema is not valid JSON"),
    ({"guided_regex": "([a-z"}, "the regex constraint does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs: unsupported key(s) ['ebnf']"),
    ({"guided_grammar": "x"}, "the grammar constraint does not compile"),
])
def test_bad_output_constraints_are_400(server, extra, message):
    r = post(server, "/v1/completions", {"prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_every_refused_field_is_named_in_its_400(server):
    from fivefold.serve.protocol import REFUSED_FIELDS

    for name, reason in REFUSED_FIELDS.items():
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = post(server, path, {**body, name: "x", "max_tokens": 1})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error.pop("request_id") == r.headers["x-request-id"]
            assert error == {"message": reason, "type": "invalid_request_error", "param": name,
                             "code": "unsupported_field"}


def test_tools_on_a_template_that_cannot_render_them(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                              "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_continuous_usage_stats_in_every_chunk(server):
    import json

    body = {"prompt": "Count:", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    bad = post(server, "/v1/completions", {**body, "stream_options": {"include_usage": True, "per_token": True}})
    assert bad.status_code == 422 and "per_token" in bad.json()["error"]["message"]
