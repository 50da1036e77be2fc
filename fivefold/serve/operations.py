"""What operators need around the routes, as vLLM's and llama-server's users know it: the
request id, the access log and CORS (``fivefold serve --enable-log-requests``,
``--allowed-origins``; TLS and the log levels are uvicorn's and the CLI's).

Request id: a client's ``X-Request-Id`` (1-128 characters of ``A-Z a-z 0-9 . _ : -``) is kept,
anything else replaced by a generated ``req-<32 hex>``; either way it is returned in the
response's ``X-Request-Id`` header, in OpenAI-style error bodies (``error.request_id``) and in the
access log line. The access log is one line per request on the ``fivefold.access`` logger::

    request_id=req-3f.. method=POST route=/v1/completions status=200 prompt_tokens=12
    completion_tokens=32 ttft_ms=41.2 total_ms=512.0

(tokens and TTFT where the request generated; never the prompt text).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid

ACCESS_LOGGER = "fivefold.access"
REQUEST_ID = contextvars.ContextVar("fivefold_request_id", default=None)
# the fields the generation routes add to this request's access line (a dict, shared by the tasks
# a streaming response runs in, which copy the context but not the dict)
REQUEST_FIELDS = contextvars.ContextVar("fivefold_request_fields", default=None)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_for(given: str | None) -> str:
    """The client's id when it is a valid one, else a new one."""
    if given and _CLIENT_ID.fullmatch(given):
        return given
    return f"req-{uuid.uuid4().hex}"


def note_output(output) -> None:
    """Record a finished RequestOutput's token counts and TTFT for this request's access line (a
    request with n choices or several prompts adds them up; the TTFT is the first one's)."""
    fields = REQUEST_FIELDS.get()
    if fields is None:
        return
    fields["prompt_tokens"] = fields.get("prompt_tokens", 0) + len(output.prompt_token_ids)
    fields["completion_tokens"] = fields.get("completion_tokens", 0) + sum(len(o.token_ids) for o in output.outputs)
    ttft = getattr(output.metrics, "ttft", None)
    if ttft is not None:
        fields["ttft_ms"] = min(fields.get("ttft_ms", float("inf")), round(ttft * 1e3, 1))


class RequestLog:
    """Pure ASGI middleware, around every route (build_base_app installs it): the request id
    (see the top) and, when the ``fivefold.access`` logger is enabled for INFO
    (:func:`enable_access_log`), the access line once the response is done."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.logger = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = request_id_for(headers.get(b"x-request-id", b"").decode("latin-1"))
        fields: dict = {}
        id_token, fields_token = REQUEST_ID.set(rid), REQUEST_FIELDS.set(fields)
        start, status = time.monotonic(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.inner(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(id_token)
            REQUEST_FIELDS.reset(fields_token)
            if self.logger.isEnabledFor(logging.INFO):
                extra = "".join(f" {k}={v}" for k, v in fields.items())
                self.logger.info("request_id=%s method=%s route=%s status=%s%s total_ms=%.1f", rid,
                                 scope.get("method"), scope.get("path"), status[0] or "-", extra,
                                 (time.monotonic() - start) * 1e3)


def enable_access_log(stream=None) -> None:
    """One access line per request on ``stream`` (default stderr): ``--enable-log-requests``."""
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s fivefold.access %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def allow_origins(app, origins: list[str]) -> None:
    """CORS for ``origins`` (``["*"]``: any), outermost: a browser's preflight (OPTIONS, sent
    without the API key) is answered before the key is asked for; the responses expose
    X-Request-Id to the page."""
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["X-Request-Id"])


# off unless asked for: --log-level debug alone does not print a line per request
logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)
