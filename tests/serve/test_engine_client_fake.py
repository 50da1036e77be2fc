"""The HTTP handlers depend on the EngineClient protocol alone: served over a fake engine that
implements only the protocol (no LLMEngine, no model weights), completions, chat (streamed and
not), tokenize and the refusals of admission behave as over the real one, and the handlers hand
the engine exactly the sampling parameters the request asked for."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from fivefold.engine.outputs import CompletionOutput, RequestOutput
from fivefold.errors import OverloadedError
from fivefold.models.loader import load_tokenizer
from fivefold.models.registry import DEFAULT_LLM, resolve_model_path
from fivefold.serve.app import build_app
from fivefold.serve.engine_client import EngineClient


class EchoEngine:
    """Answers every choice with the first ``max_tokens`` tokens of its prompt, one per step."""

    metrics = None

    def __init__(self, max_queue: int = 8) -> None:
        self._tokenizer, self._config = load_tokenizer(DEFAULT_LLM)
        self.admitted: list[tuple[list[list[int]], object]] = []
        self.aborted: list[str] = []
        self.max_queue = max_queue

    tokenizer = property(lambda self: self._tokenizer)
    model_config = property(lambda self: self._config)
    model_path = property(lambda self: resolve_model_path(DEFAULT_LLM))
    dtype = property(lambda self: torch.float32)
    max_model_len = property(lambda self: 2048)
    max_num_seqs = property(lambda self: 4)
    is_running = property(lambda self: True)

    async def admit(self, prompts, params, request_ids) -> None:
        if sum(len(ids) for ids in request_ids) > self.max_queue:
            raise OverloadedError(f"the queue holds at most {self.max_queue} requests")
        self.admitted.append((prompts, params))

    async def generate(self, request_id, prompt_token_ids, params):
        tokens: list[int] = []
        text = ""
        for token in prompt_token_ids[: params.max_tokens]:
            tokens.append(token)
            finished = len(tokens) == min(params.max_tokens, len(prompt_token_ids))
            previous, text = text, self._tokenizer.decode(tokens)
            yield RequestOutput(request_id, prompt_token_ids,
                                [CompletionOutput(0, text, list(tokens), "length" if finished else None)],
                                finished, delta_text=text[len(previous):], delta_token_ids=[token])

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {}

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


@pytest.fixture(scope="module")
def served():
    engine = EchoEngine()
    assert isinstance(engine, EngineClient)  # the protocol's members, all of them
    with TestClient(build_app(engine, "echo")) as client:
        yield engine, client


def test_completion_over_the_fake_engine(served):
    engine, client = served
    prompt = "The capital of France is Paris"
    ids = engine.tokenizer.encode(prompt)
    r = client.post("/v1/completions", json={"model": "echo", "prompt": prompt, "max_tokens": 3,
                                             "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["zz"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == engine.tokenizer.decode(ids[:3])
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(ids), 3, len(ids) + 3)
    prompts, params = engine.admitted[-1]
    assert prompts == [ids]
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop) == (3, 0.5, 0.9, 7, ("zz",))


def test_streamed_chat_over_the_fake_engine(served):
    engine, client = served
    messages = [{"role": "user", "content": "Say hello"}]
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": messages, "max_tokens": 4,
                                                  "stream": True})
    assert r.status_code == 200, r.text
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    prompt_ids = engine.admitted[-1][0][0]
    assert prompt_ids == engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == engine.tokenizer.decode(prompt_ids[:4])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_the_refusals_over_the_fake_engine(served):
    engine, client = served
    r = client.post("/tokenize", json={"model": "echo", "prompt": "hello world"})
    assert r.status_code == 200 and r.json()["tokens"] == engine.tokenizer.encode("hello world")
    r = client.post("/v1/completions", json={"model": "echo", "prompt": "hi", "max_tokens": 2, "n": 9})
    assert r.status_code == 429 and "at most 8" in r.json()["error"]["message"]  # admission's refusal, as sent
    r = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code in (400, 404) and "other" in r.json()["error"]["message"]
