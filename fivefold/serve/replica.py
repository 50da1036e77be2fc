"""One engine replica: the single-engine server app, run inside a Ray Serve deployment.

A replica is exactly what ``fivefold serve`` runs with one engine (``create_llm_server``:
validation, queue limits, result cache, streaming, metrics), loaded in its own process. The
front (fivefold/serve/cluster.py) does not re-implement any of it: it forwards each HTTP
request it routed here through :meth:`EngineReplica.handle`, which calls the app in-process
(``call_asgi``) and streams the response back, status first.

The class is plain Python; cluster.py wraps it with ``ray.serve.deployment`` when it
deploys, so importing this module needs no Ray.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

from fivefold.serve.config import ServerConfig


async def call_asgi(app, method: str, path: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[tuple[int, list[tuple[str, str]]] | bytes]:
    """Run one HTTP request through an ASGI ``app`` in this process: yield
    ``(status, headers)`` once, then the body chunks as the app sends them.

    Leaving the iteration early (the caller's client went away) is a disconnect for the
    app: its ``receive`` answers ``http.disconnect``, so a streaming response stops and
    its engine requests are aborted, exactly as when a socket closes."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query.encode(), "root_path": "", "server": ("replica", 0), "client": ("front", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_pending = [True]

    async def receive():
        if body_pending[0]:
            body_pending[0] = False
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    finished = False
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned (or raised) without another message
                getter.cancel()
                task.result()
                raise RuntimeError("the app ended without completing its response")
            message = getter.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        disconnected.set()
        if not finished:
            try:  # give the app the moment it needs to abort its engine requests
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except BaseException:
                task.cancel()


class EngineReplica:
    """The body of a Ray Serve replica: one engine and its app (see the module doc)."""

    def __init__(self, server: ServerConfig, replica_id: str) -> None:
        from fivefold.serve.app import create_llm_server

        self.replica_id = replica_id
        # The front checked the API key and the body size, and owns the prompt version; the replica trusts it.
        self.engine, self.app = create_llm_server(server, behind_front=True)

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes):
        """Stream one forwarded HTTP request's response: ``(status, headers)``, then bytes."""
        async for item in call_asgi(self.app, method, path, headers, body):
            yield item

    def info(self) -> dict:
        """What the front's health watch reads: the process (a new one means a restart) and
        the batch capacity the router weighs load against."""
        return {"pid": os.getpid(), "max_num_seqs": self.engine.max_num_seqs}

    def metrics_text(self) -> str:
        """This replica's Prometheus exposition (the front aggregates and labels them)."""
        from prometheus_client import generate_latest

        return generate_latest(self.engine.metrics.registry).decode()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.engine.is_running:
            raise RuntimeError(f"{self.replica_id}: the engine thread is not running")

    def __del__(self) -> None:  # Ray Serve's graceful shutdown ends here: free the engine
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
