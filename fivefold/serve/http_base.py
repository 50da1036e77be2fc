"""What every fivefold server has, whatever it serves: the FastAPI app, the body-size and
API-key guard, OpenAI-shaped errors, ``/health``, ``/metrics``, ``/v1/models``, ``/version``
and the prompt-version admin routes. The LLM app (app.py), the embeddings app
(embeddings.py) and the replicated front (cluster.py) are built on :func:`build_base_app`.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
400 for values out of range (the message names the limit), malformed JSON, an empty
prompt or unknown model; 401 without the right API key; 413 for a body over the
size limit (judged by Content-Length; a chunked body is read up to the limit); 422 for
fields of the wrong type; 429 past the queue limits; 503 after the queue timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fivefold.errors import (
    EngineDeadError,
    FivefoldError,
    OverloadedError,
    QueueTimeoutError,
    ReplicaUnavailableError,
)
from fivefold.serve.config import DEFAULT_MAX_BODY_BYTES, check_label
from fivefold.serve.operations import REQUEST_ID, RequestLog
from fivefold.serve.protocol import PromptVersionRequest

PROMPT_VERSION_REFUSAL = ("X-Prompt-Version is not accepted from clients: the operator sets the prompt version "
                          "(fivefold serve --prompt-version, or POST /admin/prompt-version with the admin key)")
# What the front tells a replica the current prompt version is; honoured only behind a front.
FRONT_VERSION_HEADER = "x-fivefold-prompt-version"
# Routes any client may call without the API key: liveness, metrics (as vLLM) and the version.
# /admin/* has its own key. Everything else (/v1/*, /tokenize, /detokenize, ...) needs the API key.
PUBLIC_PATHS = ("/health", "/metrics", "/version")
# Pages a browser opens (the live dashboard): the API key is also taken as HTTP Basic's password.
BROWSER_PATHS = ("/dashboard", "/dashboard/data")


class APIError(Exception):
    """An HTTP error answered in OpenAI's shape: status, message, and the param and code fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body with this status."""
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code or status}}
    request_id = REQUEST_ID.get()
    if request_id is not None:  # the X-Request-Id of this request (operations.RequestLog)
        body["error"]["request_id"] = request_id
    return JSONResponse(body, status_code=status)


def replica_unavailable_response(exc: ReplicaUnavailableError) -> JSONResponse:
    """The 503 of a request whose replica died under it."""
    return error_response(503, str(exc), code="replica_unavailable", error_type="server_error")


def check_key(what: str, key: str | None) -> None:
    """Refuse an empty (or blank) key: with one, 'Authorization: Bearer ' would be a valid login."""
    if key is not None and not key.strip():
        raise FivefoldError(f"{what} is empty: give a non-empty key, or leave it out to disable it")


def is_authorized(headers: dict, api_key: str, basic: bool = False) -> bool:
    """Whether the request carries ``Authorization: Bearer API_KEY`` (compared in constant time);
    with ``basic``, also HTTP Basic with the key as the password (a browser's login prompt)."""
    given = headers.get(b"authorization", b"")
    if basic and given[:6].lower() == b"basic ":
        try:
            password = base64.b64decode(given[6:].strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(password, api_key.encode())
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


def check_model(name: str | None, model_name: str) -> None:
    """404 ``model_not_found`` (as OpenAI and vLLM answer) unless ``name`` is absent or the served model."""
    if name is not None and name != model_name:
        raise APIError(404, f"model '{name}' is not served here; available: {model_name}", "model", "model_not_found")


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


class RequestGuard:
    """The body-size limit, the refusal of a client's X-Prompt-Version and the API key, before
    any route runs.

    A pure ASGI middleware: Starlette's BaseHTTPMiddleware (@app.middleware) wraps the
    receive channel, and then request.is_disconnected() never sees the client leave."""

    def __init__(self, inner, api_key: str | None, max_body_bytes: int) -> None:
        self.inner, self.api_key, self.max_body_bytes = inner, api_key, max_body_bytes

    def refusal(self, scope, headers: dict, length: str) -> JSONResponse | None:
        """The answer to a request refused on its headers alone, or None."""
        if length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(413, f"request body is {length} bytes; the limit is {self.max_body_bytes} bytes")
        if b"x-prompt-version" in headers:
            return error_response(400, PROMPT_VERSION_REFUSAL, param="X-Prompt-Version")
        path = scope["path"]
        page = path in BROWSER_PATHS  # the live page: a browser logs in with the key as a password
        if self.api_key is not None and path not in PUBLIC_PATHS and not path.startswith("/admin/") and \
                not is_authorized(headers, self.api_key, basic=page):
            refused = error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                     error_type="authentication_error")
            if page:
                refused.headers["WWW-Authenticate"] = 'Basic realm="fivefold dashboard: the API key is the password"'
            return refused
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length", b"").decode()
            refusal = self.refusal(scope, headers, length)
            if refusal is None and not length.isdigit() and scope.get("method") in ("POST", "PUT", "PATCH"):
                # No Content-Length (chunked transfer): read the body here, up to the limit, and
                # replay it to the app, so the limit holds whatever the transfer encoding.
                body, receive = await _read_limited(receive, self.max_body_bytes)
                if body is None:
                    refusal = error_response(413, f"request body is over the limit of {self.max_body_bytes} bytes")
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.inner(scope, receive, send)


# -- exception handlers: every error in OpenAI's shape ---------------------------------------

async def on_validation(_, exc: RequestValidationError):
    """422 naming the field of the wrong type; 400 for a body that is not JSON."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'parse error')}")
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error_response(422, f"{loc or 'body'}: {first.get('msg', 'invalid')}", param=loc or None)


async def on_http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's HTTP errors, the router's own 404 and 405 included."""
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


async def on_unexpected(_, exc: Exception):
    """A 500 naming only the exception's type (its message may hold internals)."""
    if isinstance(exc, RecursionError):  # json.loads of a body nested thousands deep
        return error_response(400, "malformed JSON body: nested too deeply")
    return error_response(500, f"internal error: {type(exc).__name__}", error_type="internal_error")


async def on_api_error(_, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def on_fivefold_error(_, exc: FivefoldError):
    """The package's errors: 429 overloaded, 503 queue timeout or replica gone, 500 engine dead,
    else 400 (an invalid request; the message names the limit)."""
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


class ClientGone(Exception):
    """The client closed its connection before the answer was ready (raised by
    :func:`await_unless_disconnected` once the work is cancelled)."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned: what the access log records


async def on_client_gone(_, exc: ClientGone):
    """Nobody reads this answer; the status (499) is for the access log and the metrics. Handled
    here rather than left to propagate, which uvicorn logs as an exception in the application."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


EXCEPTION_HANDLERS = ((RequestValidationError, on_validation), (StarletteHTTPException, on_http_error),
                      (Exception, on_unexpected), (APIError, on_api_error), (FivefoldError, on_fivefold_error),
                      (ClientGone, on_client_gone))


class ServerInfoAPI:
    """``/health``, ``/metrics`` (``await metrics_text()``), ``/v1/models``, ``/v1/models/{id}``
    and ``/version``: open to any client (but /v1/models, behind the API key)."""

    def __init__(self, model_name: str, metrics_text, is_healthy=None) -> None:
        self.model_name, self.metrics_text, self.is_healthy = model_name, metrics_text, is_healthy
        self.card = {"id": model_name, "object": "model", "created": 0, "owned_by": "fivefold"}

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])

    async def health(self):
        if self.is_healthy is not None and not self.is_healthy():
            return error_response(503, "the server is not healthy: no engine or replica is running", code="unhealthy",
                                  error_type="server_error")
        return {"status": "ok"}

    async def metrics(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await self.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [self.card]}

    async def model(self, model_id: str):
        check_model(model_id, self.model_name)
        return self.card

    async def version(self):
        from fivefold import __version__

        return {"version": __version__}


class PromptVersionAdmin:
    """``GET``/``POST /admin/prompt-version`` behind ``Authorization: Bearer ADMIN_KEY``
    (its own key, not the API key; without one the endpoints answer 403). ``current()``
    is the version now; ``await change(version)`` makes a new one current and returns the
    extra fields of the reply (e.g. how many entries were purged)."""

    def __init__(self, admin_key: str | None, current, change) -> None:
        check_key("--admin-key (FIVEFOLD_ADMIN_KEY)", admin_key)
        self.admin_key, self.current, self.change = admin_key, current, change

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/admin/prompt-version", self.get_prompt_version, methods=["GET"])
        app.add_api_route("/admin/prompt-version", self.set_prompt_version, methods=["POST"])

    def authorize(self, request: Request) -> None:
        if self.admin_key is None:
            raise APIError(403, "admin endpoints are disabled: start the server with --admin-key "
                                "(or FIVEFOLD_ADMIN_KEY)", code="admin_disabled")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_key}".encode()):
            raise APIError(401, "invalid or missing admin key (Authorization: Bearer ADMIN_KEY)",
                           code="invalid_admin_key")

    async def get_prompt_version(self, request: Request):
        self.authorize(request)
        return {"object": "prompt_version", "version": self.current()}

    async def set_prompt_version(self, request: Request):
        from pydantic import ValidationError

        self.authorize(request)  # before the body is even read: no validation message for the unauthorized
        try:
            body = PromptVersionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            if first.get("type") == "json_invalid":
                raise APIError(400, "malformed JSON body") from None
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise APIError(422, f"{where}: {first.get('msg', 'invalid')}", where) from None
        previous, version = self.current(), check_label("version", body.version)
        extra = await self.change(version)
        return {"object": "prompt_version", "version": version, "previous": previous, **extra}


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
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestLog)  # outside the guard: its refusals carry the request id too
    for exc_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    ServerInfoAPI(model_name, metrics_text, is_healthy).register(app)
    return app


async def await_unless_disconnected(request: Request, awaitables: list):
    """The results of ``awaitables``; if the client goes away first, cancel them all (a queued
    request is dropped, a running one aborted by its own cleanup) and stop this handler
    (:class:`ClientGone`, answered 499)."""
    done = asyncio.gather(*awaitables)
    # Once the client is gone its children are cancelled and `done` ends with their CancelledError,
    # which nobody awaits: retrieve it, or asyncio logs "exception was never retrieved" for it.
    done.add_done_callback(lambda f: f.cancelled() or f.exception())
    while not done.done():
        await asyncio.wait([done], timeout=0.5)
        if not done.done() and await request.is_disconnected():
            for a in awaitables:
                a.cancel()
            await asyncio.gather(*awaitables, return_exceptions=True)
            raise ClientGone
    return done.result()
