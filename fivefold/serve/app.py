"""The OpenAI-compatible HTTP front (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions (JSON or SSE streaming), /health, /metrics. The embeddings server
(fivefold/serve/embeddings.py) is built on the same base.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
400 for values out of range (the message names the limit), malformed JSON, an empty
prompt or unknown model; 401 without the right API key; 413 for a body over the
size limit (judged by Content-Length; a chunked body is not counted); 422 for fields
of the wrong type; 429 past the queue limits; 503 after the queue timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from fivefold.cache.result_cache import ResultCache, canonical_request, is_cacheable
from fivefold.errors import (
    EngineDeadError,
    FivefoldError,
    InvalidRequestError,
    OverloadedError,
    QueueTimeoutError,
    ReplicaUnavailableError,
)
from fivefold.sampling_params import SamplingParams, wrap_seed
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    PromptVersionRequest,
    TokenizeRequest,
    message_text,
    structured_outputs_of,
    unsupported_fields,
)
from fivefold.serve.tool_calls import (
    ToolCallStream,
    check_tool_request,
    forced_call_grammar,
    parse_tool_calls,
    template_tool_call,
)

DEFAULT_MAX_BODY_BYTES = 1 << 20
# The work one request may ask for in logprobs: choices x (echoed prompt tokens + max_tokens) x
# (1 + logprobs), summed over its prompts. Each entry becomes Python objects and JSON (~100 bytes),
# so this bounds a request's answer to ~100 MB; lm-eval-style scoring (64 prompts of 2k tokens,
# echo, logprobs 1) needs a quarter of it.
MAX_LOGPROB_ENTRIES = 1 << 20
# Outputs (one per step that adds text) a streaming choice may have waiting for a client that
# reads nothing, before its stream is aborted: memory per stream stays bounded.
MAX_STREAM_BACKLOG = 1024


@dataclass(frozen=True)
class ServerSpec:
    """One LLM server, as ``fivefold serve`` runs it alone or as each of ``--replicas`` (the
    spec is what is sent to every replica)."""

    model: str
    served_model_name: str
    dtype: str = "float32"
    engine_options: dict = field(default_factory=dict)
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    queue_timeout: float | None = None
    result_cache: str | None = "memory"  # None: off; "memory" or a redis:// URL
    result_cache_entries: int = 1024
    result_cache_bytes: int = 64 << 20
    prompt_version: str = "v1"
    cache_namespace: str = "default"  # separates deployments that share one Redis
    redis_configure_lru: bool = False  # let the cache set Redis's maxmemory and eviction policy
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    num_threads: int | None = None  # torch threads (a replica's share of its node); None: torch's default

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise FivefoldError(f"a server needs at least 1 thread, got {self.num_threads}")
        check_label("--prompt-version", self.prompt_version)
        check_label("--cache-namespace", self.cache_namespace)

    def make_result_cache(self, behind_front: bool = False):
        """The result cache this spec names, or None (raises FivefoldError on a bad backend).

        A shared (Redis) cache is namespaced by ``cache_namespace`` and the weights' content
        fingerprint. ``behind_front``: a replica adopts the version stored there rather than
        the start-up one, so a replica restarted after an admin change never reverts it."""
        from fivefold.cache.factory import make_result_cache
        from fivefold.models.fingerprint import weights_fingerprint
        from fivefold.models.registry import resolve_model_path

        if self.result_cache is None:
            return None
        namespace = self.cache_namespace
        if self.result_cache != "memory":
            namespace = f"{namespace}:{weights_fingerprint(resolve_model_path(self.model))}"
        return make_result_cache(self.result_cache, self.result_cache_entries, self.result_cache_bytes,
                                 None if behind_front else self.prompt_version, namespace,
                                 self.redis_configure_lru)


LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_LABEL_CHARS = 64


def check_label(what: str, value: str) -> str:
    """A prompt version or cache namespace: 1-64 characters of letters, digits, '.', '_', '-'
    (they become part of Redis keys and HTTP headers)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_LABEL_CHARS or not set(value) <= LABEL_CHARS:
        raise InvalidRequestError(f"{what} must be 1-{MAX_LABEL_CHARS} characters of letters, digits, '.', '_' "
                                  f"or '-', got {value!r}"[:200])
    return value


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code or status}}
    return JSONResponse(body, status_code=status)


async def _read_limited(receive, limit: int):
    """(body, a receive that replays it) when the body is at most ``limit`` bytes; (None, receive)
    as soon as it is over (the rest is not read)."""
    chunks, size, pending = [], 0, []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: let the app see it after the body
            pending.append(message)
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None, receive
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    replay = [{"type": "http.request", "body": body, "more_body": False}, *pending]

    async def replayed():
        return replay.pop(0) if replay else await receive()

    return body, replayed


PROMPT_VERSION_REFUSAL = ("X-Prompt-Version is not accepted from clients: the operator sets the prompt version "
                          "(fivefold serve --prompt-version, or POST /admin/prompt-version with the admin key)")
# What the front tells a replica the current prompt version is; honoured only behind a front.
FRONT_VERSION_HEADER = "x-fivefold-prompt-version"


def add_prompt_version_admin(app: FastAPI, admin_key: str | None, current, change) -> None:
    """``GET``/``POST /admin/prompt-version`` behind ``Authorization: Bearer ADMIN_KEY``
    (its own key, not the API key; without one the endpoints answer 403). ``current()``
    is the version now; ``await change(version)`` makes a new one current and returns the
    extra fields of the reply (e.g. how many entries were purged)."""
    import hmac

    check_key("--admin-key (FIVEFOLD_ADMIN_KEY)", admin_key)

    def authorize(request: Request) -> None:
        if admin_key is None:
            raise APIError(403, "admin endpoints are disabled: start the server with --admin-key "
                                "(or FIVEFOLD_ADMIN_KEY)", code="admin_disabled")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_key}".encode()):
            raise APIError(401, "invalid or missing admin key (Authorization: Bearer ADMIN_KEY)",
                           code="invalid_admin_key")

    @app.get("/admin/prompt-version")
    async def get_prompt_version(request: Request):
        authorize(request)
        return {"object": "prompt_version", "version": current()}

    @app.post("/admin/prompt-version")
    async def set_prompt_version(request: Request):
        authorize(request)  # before the body is even read: no validation message for the unauthorized
        from pydantic import ValidationError

        try:
            body = PromptVersionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            if first.get("type") == "json_invalid":
                raise APIError(400, "malformed JSON body") from None
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise APIError(422, f"{where}: {first.get('msg', 'invalid')}", where) from None
        previous, version = current(), check_label("version", body.version)
        extra = await change(version)
        return {"object": "prompt_version", "version": version, "previous": previous, **extra}


def check_key(what: str, key: str | None) -> None:
    """Refuse an empty (or blank) key: with one, 'Authorization: Bearer ' would be a valid login."""
    if key is not None and not key.strip():
        raise FivefoldError(f"{what} is empty: give a non-empty key, or leave it out to disable it")


# Routes any client may call without the API key: liveness, metrics (as vLLM) and the version.
# /admin/* has its own key. Everything else (/v1/*, /tokenize, /detokenize, ...) needs the API key.
PUBLIC_PATHS = ("/health", "/metrics", "/version")


def is_authorized(headers: dict, api_key: str) -> bool:
    """Whether the request carries ``Authorization: Bearer API_KEY`` (compared in constant time)."""
    import hmac

    return hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {api_key}".encode())


def replica_unavailable_response(exc: ReplicaUnavailableError) -> JSONResponse:
    return error_response(503, str(exc), code="replica_unavailable", error_type="server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def model_fingerprint(engine: AsyncEngine) -> str:
    """What identifies the served weights in result-cache keys: a hash of the checkpoint's
    content (not its path), so replicas on different machines share keys."""
    from fivefold.models.fingerprint import weights_fingerprint

    loaded = engine.engine.loaded
    return f"{weights_fingerprint(loaded.path)}|{loaded.model.dtype}"


def registry_text(registry):
    """``metrics_text`` for build_base_app: the exposition of one prometheus registry (or none)."""
    async def text() -> str:
        from prometheus_client import generate_latest

        return "" if registry is None else generate_latest(registry).decode()
    return text


def build_base_app(model_name: str, metrics_text, api_key: str | None = None,
                   max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, is_healthy=None, lifespan=None) -> FastAPI:
    """What every fivefold server has: the body-size and API-key guard, OpenAI-style error
    bodies, ``/health``, ``/metrics`` (``await metrics_text()``, e.g. ``registry_text(r)``)
    and ``/v1/models``. The LLM and the embeddings apps add their endpoints to it; the
    replicated front (cluster.py) also passes ``is_healthy`` (``/health`` answers 503 when
    it is false) and a ``lifespan`` for its background work."""
    check_key("--api-key", api_key)
    app = FastAPI(title="Fivefold", version="0.1.0", lifespan=lifespan)

    # A pure ASGI middleware: Starlette's BaseHTTPMiddleware (@app.middleware) wraps the
    # receive channel, and then request.is_disconnected() never sees the client leave.
    class Guard:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                headers = dict(scope.get("headers") or [])
                length = headers.get(b"content-length", b"").decode()
                refusal = None
                if length.isdigit() and int(length) > max_body_bytes:
                    refusal = error_response(413, f"request body is {length} bytes; the limit is {max_body_bytes} bytes")
                elif b"x-prompt-version" in headers:
                    refusal = error_response(400, PROMPT_VERSION_REFUSAL, param="X-Prompt-Version")
                elif api_key is not None and scope["path"] not in PUBLIC_PATHS and \
                        not scope["path"].startswith("/admin/") and not is_authorized(headers, api_key):
                    refusal = error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                             error_type="authentication_error")
                if refusal is None and not length.isdigit() and scope.get("method") in ("POST", "PUT", "PATCH"):
                    # No Content-Length (chunked transfer): read the body here, up to the limit, and
                    # replay it to the app, so the limit holds whatever the transfer encoding.
                    body, receive = await _read_limited(receive, max_body_bytes)
                    if body is None:
                        refusal = error_response(413, f"request body is over the limit of {max_body_bytes} bytes")
                if refusal is not None:
                    return await refusal(scope, receive, send)
            await self.inner(scope, receive, send)

    app.add_middleware(Guard)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'parse error')}")
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(422, f"{loc or 'body'}: {first.get('msg', 'invalid')}", param=loc or None)

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):  # 404 and 405 of the router, too
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(_, exc: Exception):
        if isinstance(exc, RecursionError):  # json.loads of a body nested thousands deep
            return error_response(400, "malformed JSON body: nested too deeply")
        return error_response(500, f"internal error: {type(exc).__name__}", error_type="internal_error")

    @app.exception_handler(APIError)
    async def on_api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(FivefoldError)
    async def on_fivefold_error(_, exc: FivefoldError):
        if isinstance(exc, OverloadedError):
            response = error_response(429, str(exc), code="overloaded")
            response.headers["Retry-After"] = "1"
            return response
        if isinstance(exc, QueueTimeoutError):
            return error_response(503, str(exc), code="queue_timeout", error_type="server_error")
        if isinstance(exc, ReplicaUnavailableError):
            return replica_unavailable_response(exc)
        if isinstance(exc, EngineDeadError):
            return error_response(500, str(exc), code=500, error_type="internal_error")
        return error_response(400, str(exc))

    @app.get("/health")
    async def health():
        if is_healthy is not None and not is_healthy():
            return error_response(503, "the server is not healthy: no engine or replica is running", code="unhealthy",
                                  error_type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await metrics_text(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "fivefold"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, model_name)
        return card

    @app.get("/version")
    async def version():
        from fivefold import __version__

        return {"version": __version__}

    return app


async def await_unless_disconnected(request: Request, awaitables: list):
    """The results of ``awaitables``; if the client goes away first, cancel them all (a queued
    request is dropped, a running one aborted by its own cleanup) and stop this handler."""
    done = asyncio.gather(*awaitables)
    while not done.done():
        await asyncio.wait([done], timeout=0.5)
        if not done.done() and await request.is_disconnected():
            for a in awaitables:
                a.cancel()
            await asyncio.gather(*awaitables, return_exceptions=True)
            raise asyncio.CancelledError
    return done.result()


def check_model(name: str | None, model_name: str) -> None:
    """404 ``model_not_found`` (as OpenAI and vLLM answer) unless ``name`` is absent or the served model."""
    if name is not None and name != model_name:
        raise APIError(404, f"model '{name}' is not served here; available: {model_name}", "model", "model_not_found")


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, result_cache: ResultCache | None = None,
              prompt_version: str | None = None, admin_key: str | None = None,
              behind_front: bool = False) -> FastAPI:
    """The FastAPI app. With ``result_cache``, deterministic requests (temperature 0 or a
    seed) are answered from it when the same request was answered before under the same
    prompt version; ``X-Cache: hit|miss|bypass`` says which, and ``Cache-Control: no-cache``
    bypasses it.

    The prompt version is the operator's: ``prompt_version`` (default: the cache's own) at
    start, then ``POST /admin/prompt-version`` with ``admin_key``. A replica
    (``behind_front``) takes it from the front's ``X-Fivefold-Prompt-Version`` header
    instead; a client's ``X-Prompt-Version`` is refused with a 400."""
    app = build_base_app(model_name, registry_text(None if engine.metrics is None else engine.metrics.registry),
                         api_key, max_body_bytes, is_healthy=lambda: engine.is_running)
    tokenizer = engine.tokenizer
    fingerprint = model_fingerprint(engine)
    versions = {"current": check_label("prompt version", prompt_version or getattr(result_cache, "version", "v1"))}

    async def change_version(version: str) -> dict:
        versions["current"] = version
        return {"num_purged": 0 if result_cache is None else await result_cache.set_version(version)}

    add_prompt_version_admin(app, admin_key, lambda: versions["current"], change_version)

    def sampling(req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                 forced=None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=req.stop or (), ignore_eos=req.ignore_eos,
            logprobs=logprobs, n=req.n, logit_bias=req.logit_bias or (), stop_token_ids=req.stop_token_ids or (),
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs_of(req, forced),
        )

    def check_work(prompts: list[list[int]], params: SamplingParams) -> None:
        """400 when answering would take more than MAX_LOGPROB_ENTRIES logprob entries (see there)."""
        per_token = 0 if params.logprobs is None else 1 + params.logprobs
        per_prompt_token = 0 if params.prompt_logprobs is None else 1 + params.prompt_logprobs
        if not per_token and not per_prompt_token:
            return
        entries = params.n * sum(len(ids) * per_prompt_token + params.max_tokens * per_token for ids in prompts)
        if entries > MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"this request asks for {entries} logprob entries (choices x (echoed prompt tokens + "
                                f"max_tokens) x (1 + logprobs), over every prompt); the limit is "
                                f"{MAX_LOGPROB_ENTRIES}: lower n, logprobs, max_tokens or the number of prompts",
                           "logprobs", "request_too_large")

    def check_request(req) -> None:
        """400 for a field this server does not implement (named), 404 for another model."""
        check_model(req.model, model_name)
        refused = unsupported_fields(req)
        if refused is not None:
            raise APIError(400, refused[1], refused[0], "unsupported_field")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} with n={req.n} is not supported: choosing the best of extra "
                                "samples is not implemented (best_of must equal n, or be left out)", "best_of")

    def per_choice(params: SamplingParams, index: int) -> SamplingParams:
        seed = None if params.seed is None else wrap_seed(params.seed + index)
        return replace(params, n=1, seed=seed)

    def choice_jobs(prompts: list[list[int]], params: SamplingParams, base_id: str):
        """(choice index, request id, prompt ids, params) of every choice: prompt p's choice i is
        index p * n + i, as OpenAI numbers the choices of a batched request."""
        n = params.n
        return [(p * n + i, f"{base_id}-{p * n + i}", ids, per_choice(params, i))
                for p, ids in enumerate(prompts) for i in range(n)]

    async def run_choices(request: Request, prompts: list[list[int]], params: SamplingParams, base_id: str):
        """Run every choice of every prompt to completion; abort them all if the client disconnects."""
        async def one(request_id, ids, choice_params):
            last = None
            async for out in engine.add_request(request_id, ids, choice_params):
                last = out
            return last

        # A cancelled choice's stream aborts its engine request in its finally block.
        tasks = [asyncio.ensure_future(one(rid, ids, cp)) for _, rid, ids, cp in choice_jobs(prompts, params, base_id)]
        return await await_unless_disconnected(request, tasks)

    def usage(prompts: list[list[int]], outs, n: int, num_completion_tokens=None) -> dict:
        completion = sum(len(o.outputs[0].token_ids) for o in outs) if num_completion_tokens is None \
            else num_completion_tokens
        prompt = sum(len(ids) for ids in prompts)
        cached = sum(outs[p * n].num_cached_tokens for p in range(len(prompts)) if p * n < len(outs))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(entries):
        """OpenAI's completions logprobs of entries {"token_id", "logprob", "top"} (an echoed
        prompt's first token has logprob and top None, as OpenAI and vLLM answer)."""
        if entries is None:
            return None
        tokens = [token_text(e["token_id"]) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {token_text(t): lp for t, lp in e["top"]}
                             for e in entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else [],
        }

    def chat_logprobs(entries):
        if entries is None:
            return None
        content = []
        for e in entries:
            text = token_text(e["token_id"])
            top = [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())} for t, lp in e["top"]]
            content.append({"token": text, "logprob": e["logprob"], "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}

    async def start_stream(request: Request, prompts, params, base_id):
        """Start every choice and wait for the first output, so that a refusal or a queue
        timeout still gets its HTTP status instead of an error inside a 200 stream. A client that
        leaves before the first token aborts every choice; one that stops reading is cut off once
        MAX_STREAM_BACKLOG outputs per choice wait for it (its choices are aborted)."""
        merged: asyncio.Queue = asyncio.Queue()
        num_jobs = len(prompts) * params.n

        async def pump(k: int, request_id: str, ids, choice_params):
            try:
                async for out in engine.add_request(request_id, ids, choice_params):
                    if merged.qsize() >= MAX_STREAM_BACKLOG * num_jobs:  # leaving the loop aborts the request
                        raise OverloadedError(f"the client read none of the last {MAX_STREAM_BACKLOG} outputs "
                                              "of a choice: its stream was aborted")
                    merged.put_nowait((k, out))
            except Exception as exc:
                merged.put_nowait((k, exc))
            merged.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(*job)) for job in choice_jobs(prompts, params, base_id)]
        try:
            first, = await await_unless_disconnected(request, [asyncio.ensure_future(merged.get())])
        except BaseException:  # the client left (or this handler was cancelled): abort every choice
            for t in tasks:
                t.cancel()
            raise
        if isinstance(first[1], Exception):
            for t in tasks:
                t.cancel()
            raise first[1]
        return first, merged, tasks

    async def stream_choices(started, num_choices: int, chunk, usage_of, include_usage: bool,
                             first_chunks=(), on_complete=None) -> AsyncIterator[str]:
        """SSE: one event per new piece of text of any choice, then usage (if asked) and [DONE]."""
        first, merged, tasks = started
        for k in range(num_choices):
            for event in first_chunks:
                yield f"data: {json.dumps(event(k))}\n\n"
        finals, remaining, item = {}, num_choices, first
        try:
            while True:
                k, out = item
                if out is None:
                    remaining -= 1
                elif isinstance(out, Exception):
                    error_type = "internal_error" if isinstance(out, EngineDeadError) else "server_error"
                    yield f"data: {json.dumps({'error': {'message': str(out), 'type': error_type}})}\n\n"
                elif out.finished and out.outputs[0].finish_reason == "error":  # its grammar failed: not cached
                    error = {"message": str(out.outputs[0].stop_reason), "type": "invalid_request_error",
                             "param": None, "code": "grammar_error"}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                else:
                    if out.finished:
                        finals[k] = out
                    yield f"data: {json.dumps(chunk(k, out))}\n\n"
                if not remaining:
                    break
                item = await merged.get()
            outs = [finals[k] for k in sorted(finals)]
            if on_complete is not None and len(outs) == num_choices:
                await on_complete(outs)
            if include_usage:
                yield f"data: {json.dumps(chunk(None, None) | {'choices': [], 'usage': usage_of(outs)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()  # a client that went away: the streams' finally blocks abort the requests

    async def cache_lookup(endpoint: str, req, request: Request):
        """(key or None, cached body or None, X-Cache value)."""
        if result_cache is None:
            return None, None, "bypass"
        fields = req.model_dump(exclude={"stream", "stream_options", "user", "model"})
        if "no-cache" in request.headers.get("cache-control", "") or not is_cacheable(fields):
            return None, None, "bypass"
        version = versions["current"]
        if behind_front and request.headers.get(FRONT_VERSION_HEADER):
            version = check_label("prompt version", request.headers[FRONT_VERSION_HEADER])
        await result_cache.set_version(version)  # a no-op unless the version changed
        key = ResultCache.make_key(fingerprint, version, {"endpoint": endpoint, **canonical_request(fields)})
        body = await result_cache.get(key)
        if engine.metrics is not None:
            (engine.metrics.result_cache_hits if body is not None else engine.metrics.result_cache_misses).inc()
        return key, body, "hit" if body is not None else "miss"

    def cached_stream(body: dict, chunk_object: str, include_usage: bool, is_chat: bool) -> AsyncIterator[str]:
        async def events():
            head = {"id": body["id"], "object": chunk_object, "created": body["created"], "model": body["model"]}
            for c in body["choices"]:
                if is_chat:
                    yield f"data: {json.dumps(head | {'choices': [{'index': c['index'], 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None, 'finish_reason': None}]})}\n\n"
                    message = c["message"]
                    delta = {"index": c["index"], "delta": {"content": message["content"]}}
                    if message.get("tool_calls"):
                        delta["delta"]["tool_calls"] = [{"index": i, **call}
                                                        for i, call in enumerate(message["tool_calls"])]
                else:
                    delta = {"index": c["index"], "text": c["text"]}
                yield f"data: {json.dumps(head | {'choices': [delta | {'logprobs': c['logprobs'], 'finish_reason': c['finish_reason']}]})}\n\n"
            if include_usage:
                yield f"data: {json.dumps(head | {'choices': [], 'usage': body['usage']})}\n\n"
            yield "data: [DONE]\n\n"
        return events()

    def fresh_ids(body: dict, prefix: str) -> dict:
        return body | {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time())}

    async def prepare(prompts: list[list[int]], params: SamplingParams, base_id: str) -> None:
        for p, ids in enumerate(prompts):
            if not ids:
                where = "" if len(prompts) == 1 else f" (prompt {p})"
                raise APIError(400, f"the prompt is empty{where}; at least one token is required", "prompt")
        check_work(prompts, params)

        def validate_all() -> None:
            for ids in prompts:
                engine.validate(ids, params)

        await asyncio.to_thread(validate_all)  # a grammar's check can take a while: off the event loop
        reserved: list[str] = []
        try:
            for p, ids in enumerate(prompts):
                request_ids = [f"{base_id}-{p * params.n + i}" for i in range(params.n)]
                engine.reserve_queue(request_ids, len(ids))
                reserved += request_ids
        except Exception:
            engine.release_queue(reserved)  # all of a batched request is queued, or none of it
            raise

    # endpoint -> (id prefix, response object, stream chunk object)
    endpoints = {"completions": ("cmpl", "text_completion", "text_completion"),
                 "chat": ("chatcmpl", "chat.completion", "chat.completion.chunk")}

    async def respond(kind: str, req, request: Request, prompts: list[list[int]], params: SamplingParams,
                      choice_of, delta_of, usage_of=None):
        """The shared path of both endpoints: result cache, queue, engine, JSON or SSE.

        ``choice_of(output, k)`` / ``delta_of(output, k)`` give the endpoint-specific fields of
        finished choice k / of a stream chunk of choice k; ``usage_of(outs)`` the usage (default:
        every output token counts)."""
        prefix, object_name, chunk_object = endpoints[kind]
        usage_of = usage_of or (lambda outs: usage(prompts, outs, params.n))
        include = bool(req.stream_options and req.stream_options.include_usage)
        key, hit, cache_state = await cache_lookup(kind, req, request)
        headers = {"X-Cache": cache_state}
        if hit is not None:
            body = fresh_ids(hit, prefix)
            if req.stream:
                return StreamingResponse(cached_stream(body, chunk_object, include, kind == "chat"),
                                         media_type="text/event-stream", headers=headers)
            return JSONResponse(body, headers=headers)
        base_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        await prepare(prompts, params, base_id)

        async def body_from(outs) -> dict:
            # Detokenizing logprobs of thousands of tokens takes a while: off the event loop.
            choices = await asyncio.to_thread(lambda: [{"index": k, **choice_of(o, k)} for k, o in enumerate(outs)])
            body = {"id": base_id, "object": object_name, "created": created, "model": model_name,
                    "choices": choices, "usage": usage_of(outs)}
            if key is not None:
                await result_cache.put(key, body)
            return body

        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk(k, out):
            head = {"id": base_id, "object": chunk_object, "created": created, "model": model_name}
            if out is None:
                return head
            body = head | {"choices": [{"index": k, **delta_of(out, k)}]}
            if continuous:  # vLLM's continuous_usage_stats: this choice's usage so far
                num_prompt, num_out = len(prompts[k // params.n]), len(out.outputs[0].token_ids)
                body["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                                 "total_tokens": num_prompt + num_out}
            return body

        def role_chunk(k):
            return chunk(None, None) | {"choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}

        if req.stream:
            started = await start_stream(request, prompts, params, base_id)
            first_chunks = (role_chunk,) if kind == "chat" else ()
            return StreamingResponse(stream_choices(started, len(prompts) * params.n, chunk, usage_of, include,
                                                    first_chunks, on_complete=body_from),
                                     media_type="text/event-stream", headers=headers)
        outs = await run_choices(request, prompts, params, base_id)
        failed = next((o for o in outs if o.outputs[0].finish_reason == "error"), None)
        if failed is not None:  # one choice's grammar failed: the request fails, nothing is cached
            raise APIError(400, str(failed.outputs[0].stop_reason), None, "grammar_error")
        body = await body_from(outs)
        return await asyncio.to_thread(JSONResponse, body, headers=headers)  # rendering a large body, too

    def new_entries(out) -> list[dict] | None:
        """Logprob entries of the tokens this output added."""
        entries = out.outputs[0].logprobs
        return None if entries is None else entries[len(entries) - len(out.delta_token_ids):]

    def completion_prompts(req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """(token ids, text) of each prompt of a completions request (one, or a batch)."""
        vocab_size = engine.engine.loaded.config.vocab_size
        given = req.prompt
        if isinstance(given, list) and not given:  # [] would be a batch of no prompts: an answer with no choices
            raise APIError(400, "prompt is an empty list; give a prompt (text or token ids) or a batch of them",
                           "prompt")
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        prompts, texts = [], []
        for p, one in enumerate(given):
            if isinstance(one, str):
                prompts.append(tokenizer.encode(one) if one else [])
                texts.append(one)
                continue
            bad = next((t for t in one if not 0 <= t < vocab_size), None)
            if bad is not None:
                where = "" if len(given) == 1 else f" (prompt {p})"
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size}){where}",
                               "prompt")
            prompts.append(list(one))
            texts.append(tokenizer.decode(list(one), skip_special_tokens=False))
        return prompts, texts

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        prompts, texts = await asyncio.to_thread(completion_prompts, req)  # a large prompt: off the event loop
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        # echo with max_tokens 0 scores the prompt: one token is run (the engine always samples
        # one) and dropped from the answer, which holds the prompt and its logprobs only.
        is_scoring = max_tokens == 0
        if is_scoring and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is accepted only with echo, to score the prompt)",
                           "max_tokens")
        echo_logprobs = req.logprobs if req.echo else None
        params = sampling(req, 1 if is_scoring else max_tokens, req.logprobs, prompt_logprobs=echo_logprobs)
        n = params.n

        def shaped(out, k, text: str, entries, finish, with_prompt: bool) -> dict:
            """A choice's (or a chunk's) fields: a scored prompt's generated token dropped, the
            prompt (and its logprobs, the first null) put in front when ``with_prompt``."""
            if is_scoring:
                text, entries = "", [] if entries is not None else None
                finish = "length" if finish else None
            if with_prompt:
                text = texts[k // n] + text
                if echo_logprobs is not None:
                    first = {"token_id": prompts[k // n][0], "logprob": None, "top": None}
                    entries = [first, *(out.prompt_logprobs or [None])[1:], *(entries or [])]
            return {"text": text, "logprobs": completion_logprobs(entries), "finish_reason": finish}

        def choice_of(out, k):
            c = out.outputs[0]
            return shaped(out, k, c.text, c.logprobs, c.finish_reason, req.echo)

        echoed_choices: set[int] = set()

        def delta_of(out, k):
            first_chunk = req.echo and k not in echoed_choices  # the first chunk of a choice carries the prompt
            echoed_choices.add(k)
            return shaped(out, k, out.delta_text, new_entries(out), out.outputs[0].finish_reason, first_chunk)

        usage_of = (lambda outs: usage(prompts, outs, n, 0)) if is_scoring else None
        return await respond("completions", req, request, prompts, params, choice_of, delta_of, usage_of)

    def chat_messages(req) -> list[dict]:
        """The messages as the chat template takes them: content as text, tool fields kept."""
        if not req.messages:
            raise APIError(400, "messages is empty; at least one message is required", "messages")
        rendered = []
        for i, m in enumerate(req.messages):
            text = message_text(m)
            if text is None and not (m.role == "assistant" and m.tool_calls):
                raise APIError(400, f"messages[{i}]: content is required (null only on an assistant message with "
                                    "tool_calls)", f"messages.{i}.content")
            one = {"role": m.role, "content": text or ""}  # templates test content, or print None
            one |= {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None}
            if m.tool_calls:
                one["tool_calls"] = [template_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
            rendered.append(one)
        return rendered

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools and len(tools) > MAX_TOOLS:
            raise APIError(400, f"tools: at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
        asked = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        choice = check_tool_request(tools, asked, tokenizer.hf.chat_template)
        calls_tools = choice != "none"
        prompt_ids = await asyncio.to_thread(lambda: tokenizer.apply_chat_template(
            chat_messages(req), add_generation_prompt=True, tools=tools if calls_tools else None))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context
            max_tokens = max(1, engine.engine.max_model_len - len(prompt_ids))
        top = req.top_logprobs if req.top_logprobs is not None else 0
        forced = forced_call_grammar(tools, choice, req.parallel_tool_calls) if calls_tools else None
        params = sampling(req, max_tokens, top if req.logprobs else None,
                          forced=("tool_choice", forced) if forced is not None else None)

        def finish_reason(out, has_calls: bool) -> str | None:
            reason = out.outputs[0].finish_reason
            return "tool_calls" if has_calls and reason == "stop" else reason

        def choice_of(out, k):
            content, calls = parse_tool_calls(out.outputs[0].text) if calls_tools else (out.outputs[0].text, [])
            message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
            return {"message": message, "logprobs": chat_logprobs(out.outputs[0].logprobs),
                    "finish_reason": finish_reason(out, bool(calls))}

        streams: dict[int, ToolCallStream] = {}

        def delta_of(out, k):
            if not calls_tools:
                delta = {"content": out.delta_text}
            else:
                stream = streams.setdefault(k, ToolCallStream())
                content, calls = stream.feed(out.delta_text, out.finished)
                delta = {"content": content} if content or not calls else {}
                if calls:
                    first = stream.num_calls - len(calls)
                    delta["tool_calls"] = [{"index": first + j, **c} for j, c in enumerate(calls)]
            has_calls = calls_tools and streams[k].num_calls > 0
            return {"delta": delta, "logprobs": chat_logprobs(new_entries(out)),
                    "finish_reason": finish_reason(out, has_calls)}

        return await respond("chat", req, request, [prompt_ids], params, choice_of, delta_of)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's shape: {"count", "max_model_len", "tokens", "token_strs"}. Behind the API key, and held
        to the limits of a request: a prompt longer than the context is refused (400)."""
        check_model(req.model, model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if req.prompt is None and req.add_special_tokens:
            raise APIError(400, "add_special_tokens applies to a prompt: the chat template writes the special "
                                "tokens of messages itself", "add_special_tokens")

        def token_ids() -> list[int]:
            if req.prompt is not None:
                return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
            return tokenizer.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)

        ids = await asyncio.to_thread(token_ids)
        max_model_len = engine.engine.max_model_len
        if len(ids) > max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the maximum context length is {max_model_len}",
                           "prompt" if req.prompt is not None else "messages")
        strs = await asyncio.to_thread(lambda: [token_text(t) for t in ids]) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model, model_name)
        vocab_size = engine.engine.loaded.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
        if len(req.tokens) > engine.engine.max_model_len:
            raise APIError(400, f"{len(req.tokens)} tokens; the maximum context length is {engine.engine.max_model_len}",
                           "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)}

    return app


def create_llm_server(spec: ServerSpec, api_key: str | None = None, admin_key: str | None = None,
                      behind_front: bool = False) -> tuple[AsyncEngine, FastAPI]:
    """(engine, app): the model loaded, its engine thread running, the app over it
    (``behind_front``: a replica, which takes the prompt version from its front)."""
    import torch

    from fivefold.llm import LLM
    from fivefold.serve.metrics import ServerMetrics

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    llm = LLM(spec.model, spec.dtype, **spec.engine_options)
    llm.engine.warm_up_structured_output()  # the grammar engine's one-time tables, before the first request
    engine = AsyncEngine(llm.engine, ServerMetrics(spec.served_model_name),
                         max_queued_requests=spec.max_queued_requests, max_queued_tokens=spec.max_queued_tokens,
                         queue_timeout=spec.queue_timeout)
    cache = spec.make_result_cache(behind_front)
    app = build_app(engine, spec.served_model_name, api_key=api_key, max_body_bytes=spec.max_body_bytes,
                    result_cache=cache, prompt_version=None if behind_front else spec.prompt_version,
                    admin_key=admin_key, behind_front=behind_front)
    return engine, app
