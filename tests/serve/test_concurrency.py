"""200 concurrent streaming requests against a real server (tiny random Llama), 50 of
them cancelled mid-stream: the rest complete with the right token counts, and the KV
cache ends consistent with no block in use."""

from __future__ import annotations

import asyncio

import openai

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server, wait_until_idle


def test_200_streams_with_50_cancelled(tmp_path):
    save_random_hf_model("llama", tmp_path)
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory_bytes=8 << 20, block_size=4)))

    async def run(url: str):
        import httpx

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
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

    with running_server(build_app(engine, "tiny")) as url:
        results = asyncio.run(run(url))
        assert sum(r[0] == "cancelled" for r in results) == 50
        completed = [r for r in results if r[0] == "done"]
        assert len(completed) == 150
        # one chunk per token (a word-level tokenizer emits text for every token)
        assert all(chunks == max_tokens for _, chunks, max_tokens in completed)
        wait_until_idle(engine.engine)
        assert not engine.engine.has_unfinished
        assert engine.engine.kv_cache.num_used_blocks == 0
        engine.engine.kv_cache.check_integrity([])
    engine.shutdown()
