"""200 concurrent streaming requests against a real server (tiny random Llama), 50 of
them cancelled mid-stream: the rest complete with the right token counts, and the KV
cache ends consistent with no block in use."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import openai

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.conftest import save_random_hf_model


def test_200_streams_with_50_cancelled(tmp_path):
    import uvicorn

    save_random_hf_model("llama", tmp_path)
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory=8 << 20, block_size=4)))
    app = build_app(engine, "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", limit_concurrency=1000))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)

    async def run():
        import httpx

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=250)))

        async def one(i: int):
            max_tokens = 20 + i % 7
            stream = await client.completions.create(model="tiny", prompt=[5 + i % 50, 7, 9 + i % 11],
                                                     max_tokens=max_tokens, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            num_chunks = 0
            async for chunk in stream:
                num_chunks += 1
                if i % 4 == 0 and num_chunks == 3:
                    await stream.close()  # walk away mid-stream
                    return ("cancelled", None, None)
            return ("done", num_chunks, max_tokens)

        return await asyncio.gather(*(one(i) for i in range(200)))

    try:
        results = asyncio.run(run())
        assert sum(r[0] == "cancelled" for r in results) == 50
        completed = [r for r in results if r[0] == "done"]
        assert len(completed) == 150
        # one chunk per token (a word-level tokenizer emits text for every token)
        assert all(chunks == max_tokens for _, chunks, max_tokens in completed)
        deadline = time.time() + 10
        while engine.engine.has_unfinished and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert not engine.engine.has_unfinished
        assert engine.engine.kv_cache.num_used_blocks == 0
        engine.engine.kv_cache.check_integrity([])
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.shutdown()
