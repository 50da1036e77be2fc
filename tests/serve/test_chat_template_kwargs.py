"""chat_template_kwargs (vLLM's field) reach the template: a random-weight Qwen3 whose template,
like Qwen3's own, writes an empty think block when enable_thinking is false; the variables the
server sets are refused by name; min_tokens is taken by the server (issue 38)."""

from __future__ import annotations

import json

import httpx

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server

# Qwen3's switch, on the tiny word-level vocabulary: "w5 w6" is the closed think block
TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
            "{% if add_generation_prompt %}w3 {% if enable_thinking is defined and enable_thinking is false %}"
            "w5 w6 {% endif %}{% endif %}")


def test_enable_thinking_reaches_the_template_and_reserved_names_are_refused(tmp_path):
    save_random_hf_model("qwen3", tmp_path, seed=3)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory_bytes=4 << 20, block_size=4)))
    try:
        with running_server(build_app(engine, "qwen3-tiny")) as url:
            def chat(**extra):
                return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                    "model": "qwen3-tiny", "messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 1,
                    "temperature": 0, **extra})

            default, thinking_off = chat(), chat(chat_template_kwargs={"enable_thinking": False})
            assert default.status_code == thinking_off.status_code == 200
            # "w3 w10 w11 w4 w3" against the same plus "w5 w6"
            assert default.json()["usage"]["prompt_tokens"] == 5
            assert thinking_off.json()["usage"]["prompt_tokens"] == 7
            on = chat(chat_template_kwargs={"enable_thinking": True})
            assert on.json()["usage"]["prompt_tokens"] == 5
            for name in ("add_generation_prompt", "messages"):
                r = chat(chat_template_kwargs={name: False})
                assert r.status_code == 400 and name in r.json()["error"]["message"]
            r = chat(min_tokens=3, max_tokens=3, logit_bias={"2": 100})  # 2: the tiny model's EOS
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()
