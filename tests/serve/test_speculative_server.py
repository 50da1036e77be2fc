"""The server with prompt-lookup speculation under concurrent load: 48 streaming requests
(12 cancelled mid-stream) over repetitive prompts, so that most steps verify proposals in a
batch that also holds rows without them. The completed streams' text equals the engine's
without speculation, the spec counters reach /metrics, and the pool ends empty."""

from __future__ import annotations

import asyncio

import httpx
import openai

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import ServerMetrics
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server, wait_until_idle


def _prompt(i: int) -> list[int]:
    phrase = [3 + (i * 7 + j * 13) % 300 for j in range(4 + i % 5)]
    return phrase * 3


def test_streams_with_speculation_match_the_engine_without_it(tmp_path):
    save_random_hf_model("llama", tmp_path, seed=2)
    loaded = load_model(str(tmp_path))
    options = dict(kv_cache_memory_bytes=4 << 20, block_size=4)
    reference = LLMEngine(loaded, EngineConfig(**options))
    expected = {}
    for i in range(48):
        reference.add_request(_prompt(i), SamplingParams(temperature=0, max_tokens=16 + i % 9, ignore_eos=True),
                              request_id=str(i))
    while reference.has_unfinished:
        for out in reference.step():
            if out.finished:
                expected[int(out.request_id)] = out.outputs[0].text
    engine = AsyncEngine(LLMEngine(loaded, EngineConfig(speculative="ngram", prompt_lookup_min=1, **options)),
                         ServerMetrics("tiny"))

    async def run(url: str):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))

        async def one(i: int):
            stream = await client.completions.create(model="tiny", prompt=_prompt(i), max_tokens=16 + i % 9,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, num_chunks = "", 0
            async for chunk in stream:
                num_chunks += 1
                text += chunk.choices[0].text
                if i % 4 == 1 and num_chunks == 2:
                    await stream.close()  # walk away mid-stream
                    return i, None
            return i, text

        return await asyncio.gather(*(one(i) for i in range(48)))

    with running_server(build_app(engine, "tiny")) as url:
        results = asyncio.run(run(url))
        done = {i: text for i, text in results if text is not None}
        assert len(done) == 36
        assert all(text == expected[i] for i, text in done.items())
        wait_until_idle(engine.engine)
        stats = engine.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0 and stats["num_used_blocks"] == 0, stats
        engine.engine.kv_cache.check_integrity([])
        metrics = httpx.get(url + "/metrics").text
        accepted = next(line for line in metrics.splitlines()
                        if line.startswith("fivefold:spec_decode_num_accepted_tokens_total"))
        assert float(accepted.split()[-1]) == stats["spec_num_accepted_tokens"]
    engine.shutdown()
