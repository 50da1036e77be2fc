"""The OpenAI-compatible LLM server: the base app (http_base.py) with ``/v1/completions``,
``/v1/chat/completions`` (JSON or SSE streaming), ``/tokenize``, ``/detokenize`` and the
prompt-version admin routes, each surface a class over an
:class:`~fivefold.serve.engine_client.EngineClient`.

:func:`create_llm_server` loads the model and starts its engine thread (what ``fivefold serve``
and each replica run); :func:`build_app` builds the app over a running engine client.
"""

from __future__ import annotations

from fastapi import FastAPI

from fivefold.cache.result_cache import ResultCache
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.chat import ChatAPI
from fivefold.serve.completions import CompletionsAPI
from fivefold.serve.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from fivefold.serve.engine_client import EngineClient
from fivefold.serve.http_base import PromptVersionAdmin, build_base_app, registry_text
from fivefold.serve.served_cache import ServedResultCache, served_model_identity
from fivefold.serve.tokenization import TokenizeAPI


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, result_cache: ResultCache | None = None,
              prompt_version: str | None = None, admin_key: str | None = None,
              behind_front: bool = False, dashboard: bool = False) -> FastAPI:
    """The FastAPI app. With ``result_cache``, deterministic requests (temperature 0 or a
    seed) are answered from it when the same request was answered before under the same
    prompt version; ``X-Cache: hit|miss|bypass`` says which, and ``Cache-Control: no-cache``
    bypasses it.

    The prompt version is the operator's: ``prompt_version`` (default: the cache's own) at
    start, then ``POST /admin/prompt-version`` with ``admin_key``. A replica
    (``behind_front``) takes it from the front's ``X-Fivefold-Prompt-Version`` header
    instead; a client's ``X-Prompt-Version`` is refused with a 400. ``dashboard``: the live page
    (``/dashboard``, fivefold/serve/live_page.py) from the engine's metrics."""
    app = build_base_app(model_name, registry_text(None if engine.metrics is None else engine.metrics.registry),
                         api_key, max_body_bytes, is_healthy=lambda: engine.is_running)
    cache = ServedResultCache(result_cache, served_model_identity(engine), prompt_version, behind_front,
                              engine.metrics)
    PromptVersionAdmin(admin_key, cache.current_version, cache.change_version).register(app)
    CompletionsAPI(engine, model_name, cache).register(app)
    ChatAPI(engine, model_name, cache).register(app)
    TokenizeAPI(engine, model_name).register(app)
    if dashboard:
        from fivefold.serve.live_page import LiveDashboard

        if engine.metrics is None:
            raise FivefoldError("--dashboard needs the server's metrics (an engine without them has no live page)")
        LiveDashboard(engine.metrics, model_name).register(app)
    return app


def create_llm_server(config: ServerConfig, api_key: str | None = None, admin_key: str | None = None,
                      behind_front: bool = False, dashboard: bool = False) -> tuple[AsyncEngine, FastAPI]:
    """(engine, app): the model loaded, its engine thread running, the app over it
    (``behind_front``: a replica, which takes the prompt version from its front)."""
    import torch

    from fivefold.llm import LLM
    from fivefold.serve.metrics import ServerMetrics

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    llm = LLM(config.model, config.dtype, quantization=config.quantization, **config.engine_options)
    llm.engine.warm_up_structured_output()  # the grammar engine's one-time tables, before the first request
    engine = AsyncEngine(llm.engine, ServerMetrics(config.served_model_name),
                         max_queued_requests=config.max_queued_requests, max_queued_tokens=config.max_queued_tokens,
                         queue_timeout=config.queue_timeout)
    cache = config.make_result_cache(behind_front)
    app = build_app(engine, config.served_model_name, api_key=api_key, max_body_bytes=config.max_body_bytes,
                    result_cache=cache, prompt_version=None if behind_front else config.prompt_version,
                    admin_key=admin_key, behind_front=behind_front, dashboard=dashboard)
    return engine, app
