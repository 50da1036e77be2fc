"""`fivefold bench serve` drives any OpenAI-compatible server (issue 38): against a fake one that
requires an API key, streams both endpoints with usage and counts tokens on /tokenize, the load
generator sends the key, reads JSONL and ShareGPT prompts, counts prompt tokens with /tokenize or
a named tokenizer, and reports the percentiles and goodput; bad datasets fail in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fivefold.bench.serve_bench import read_dataset
from fivefold.errors import FivefoldError
from tests.serve.conftest import running_server

KEY = "sk-bench-123456"


def fake_openai_server(seen: list) -> FastAPI:
    """Streams `max_tokens` one-word chunks; a prompt token is a whitespace-separated word."""
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    def words(body: dict) -> int:
        if "messages" in body:
            return sum(len(m["content"].split()) for m in body["messages"])
        return len(body["prompt"].split()) if isinstance(body["prompt"], str) else len(body["prompt"])

    async def stream(body: dict, chat: bool):
        n = body["max_tokens"]
        for i in range(n):
            choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": words(body), "completion_tokens": n, "total_tokens": words(body) + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        async def handler(request: Request, chat=chat, path=path):
            if not authorized(request):
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            body = await request.json()
            seen.append((path, body))
            return StreamingResponse(stream(body, chat), media_type="text/event-stream")
        app.add_api_route(path, handler, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(request: Request):
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        seen.append(("/tokenize", body))
        return {"count": words(body)}

    return app


def _bench(url: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "fivefold", "bench", "serve", "--url", url, "--registry", "",
                          "--max-concurrency", "3", "--output-len", "5", "--slo", "ttft=10,tpot=10", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_drives_both_endpoints_with_a_key_and_dataset_files(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [{"prompt": "a b c"}, {"text": "d e"},
                                                         {"messages": [{"role": "user", "content": "f g h i"}]}]))
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "one two"},
                                                       {"from": "gpt", "value": "ignored answer"}]},
                                    {"conversations": [{"from": "gpt", "value": "no human turn"}]}]))
    seen: list = []
    with running_server(fake_openai_server(seen)) as url:
        result = _bench(url, "--api-key", KEY, "--dataset-path", str(jsonl), "--num-requests", "6")
        assert result["completed"] == 6 and result["failed"] == 0 and result["goodput_req_s"] > 0
        assert result["ttft_s"]["p50"] > 0 and result["output_token_throughput"] > 0
        sent = [b for p, b in seen if p == "/v1/completions"]
        assert sorted({b["prompt"] for b in sent}) == ["a b c", "d e", "f g h i"]
        assert all(b["max_tokens"] == 5 and b["stream"] for b in sent)
        assert [p for p, _ in seen].count("/tokenize") == 6  # counted by the server, before the run
        seen.clear()
        result = _bench(url, "--api-key", KEY, "--dataset-path", str(sharegpt), "--num-requests", "4",
                        "--endpoint", "/v1/chat/completions")
        assert result["completed"] == 4 and result["endpoint"] == "/v1/chat/completions"
        assert {b["messages"][0]["content"] for p, b in seen if p == "/v1/chat/completions"} == {"one two"}
        assert result["total_token_throughput"] > result["output_token_throughput"]  # prompt tokens counted
        # without the key every request fails, and the command says so with a non-zero exit
        out = subprocess.run([sys.executable, "-m", "fivefold", "bench", "serve", "--url", url, "--registry", "",
                              "--max-concurrency", "2", "--num-requests", "2", "--dataset-path", str(jsonl)],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
        assert out.returncode == 1 and "HTTP 401" in out.stdout


def test_bad_datasets_fail_in_one_line(tmp_path):
    with pytest.raises(FivefoldError, match="no such file"):
        read_dataset(str(tmp_path / "missing.jsonl"), 4, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(FivefoldError, match="line 2 is not JSON"):
        read_dataset(str(bad), 4, 0)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "x"}]}]))
    with pytest.raises(FivefoldError, match="no prompts found"):
        read_dataset(str(empty), 4, 0)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "p"}))
    assert read_dataset(str(one), 5, 1) == ["p"] * 5  # fewer prompts than requests: cycled
