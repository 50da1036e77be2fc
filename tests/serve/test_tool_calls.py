"""Tool calling end to end on a random-weight Qwen2 whose chat template renders tools in the
Hermes format (<tool_call> JSON), with a byte-level BPE tokenizer trained here on pydoc text
(so that the grammar can spell any JSON): forced calls (a named function, "required") are
deterministic through the grammar, streamed like the whole answer, and a tool result goes
back through the template. The parser is also checked on its own, streamed in random pieces."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import ServerMetrics
from fivefold.serve.tool_calls import ToolCallStream, parse_tool_calls
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server

# A Hermes-style template (our own, in the format Qwen's templates use): tools in the system turn,
# calls as <tool_call> JSON, tool results as <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Reply with <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}\n<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>"
    "{%- else %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}\n<|im_start|>assistant\n{%- endif %}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def save_byte_level_qwen2(directory) -> None:
    """A random-weight Qwen2 with a 640-token byte-level BPE tokenizer and the Hermes template."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: the config's bos 1, eos 2
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(topics.values())[:60], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token=None)
    fast.chat_template = HERMES_TEMPLATE
    fast.save_pretrained(str(directory))
    save_random_hf_model("qwen2", directory, vocab_size=len(fast), max_position_embeddings=1024)
    fast.save_pretrained(str(directory))  # save_random_hf_model wrote its word-level tokenizer: put ours back


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-tools")
    save_byte_level_qwen2(directory)
    engine = AsyncEngine(LLMEngine(load_model(str(directory)), EngineConfig(kv_cache_memory_bytes=16 << 20)),
                         ServerMetrics("qwen2-tools"))
    with running_server(build_app(engine, "qwen2-tools")) as url:
        yield url
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def check_calls(calls, names) -> None:
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for c in calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_forced_tool_calls_in_openai_shape_streamed_alike(client, tool_choice, names):
    kw = dict(model="qwen2-tools", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
              temperature=0, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False
    streamed, content = {}, ""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        for call in (delta.tool_calls or []) if delta else []:
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert content == ""
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_and_none_answer_in_text(client):
    for tool_choice in ("auto", "none"):
        r = client.chat.completions.create(model="qwen2-tools", messages=MESSAGES, tools=TOOLS, max_tokens=12,
                                           temperature=0, tool_choice=tool_choice)
        assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls


def test_a_tool_result_goes_back_through_the_template(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = httpx.post(server + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
     "tool_choice names function 'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "function names must be unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "ask for one output constraint, not 2"),
])
def test_bad_tool_requests_are_400(server, body, message):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_parser_whole_and_streamed_in_random_pieces():
    texts = [
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
        '{"x": [1, 2]}}\n</tool_call>\n',
        'No call here, only <tool text and a < sign.',
        'Broken: <tool_call>\n{"name": 3}\n</tool_call> and an open <tool_call>\n{"name": "x"',
        '  \n',
    ]
    rng = random.Random(0)
    for text in texts:
        content, calls = parse_tool_calls(text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
            stream, streamed, streamed_calls = ToolCallStream(), "", []
            for i, piece in enumerate(pieces):
                delta, new = stream.feed(piece, is_final=i == len(pieces) - 1)
                streamed += delta
                streamed_calls += new
            assert streamed == (content or "")
            assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    assert parse_tool_calls(texts[0])[0] == "Let me check."
    assert [c["function"]["name"] for c in parse_tool_calls(texts[1])[1]] == ["a", "b"]
    assert parse_tool_calls(texts[1])[0] is None
    assert parse_tool_calls(texts[3]) == (texts[3], [])
