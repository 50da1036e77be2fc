"""One engine replica: the single-engine server app, run inside a Ray Serve deployment.

A replica is exactly what ``fivefold serve`` runs with one engine (``build_app`` over an
``AsyncEngine``: validation, queue limits, result cache, streaming, metrics), loaded in
its own process. The front (fivefold/serve/cluster.py) does not re-implement any of it:
it forwards each HTTP request it routed here through :meth:`EngineReplica.handle`, which
calls the app in-process (``call_asgi``) and streams the response back, status first.

The class is plain Python; cluster.py wraps it with ``ray.serve.deployment`` when it
deploys, so importing this module needs no Ray.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import AsyncIterator

from fivefold.errors import FivefoldError


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to build its engine and app (sent to every replica)."""

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
    max_body_bytes: int = 1 << 20
    num_threads: int = 1  # torch threads: the replica's share of the node's cores

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise FivefoldError(f"a replica needs at least 1 thread, got {self.num_threads}")


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

    def __init__(self, spec: ReplicaSpec, replica_id: str) -> None:
        import torch

        from fivefold.cache.result_cache import make_result_cache
        from fivefold.llm import LLM
        from fivefold.serve.app import build_app
        from fivefold.serve.async_engine import AsyncEngine
        from fivefold.serve.metrics import ServerMetrics

        torch.set_num_threads(spec.num_threads)
        self.replica_id = replica_id
        llm = LLM(spec.model, spec.dtype, **spec.engine_options)
        self.engine = AsyncEngine(llm.engine, ServerMetrics(spec.served_model_name),
                                  max_queued_requests=spec.max_queued_requests,
                                  max_queued_tokens=spec.max_queued_tokens, queue_timeout=spec.queue_timeout)
        cache = None if spec.result_cache is None else make_result_cache(
            spec.result_cache, spec.result_cache_entries, spec.result_cache_bytes, spec.prompt_version)
        # The front checked the API key and the body size; the replica trusts it.
        self.app = build_app(self.engine, spec.served_model_name, max_body_bytes=spec.max_body_bytes,
                             result_cache=cache, prompt_version=spec.prompt_version)

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes):
        """Stream one forwarded HTTP request's response: ``(status, headers)``, then bytes."""
        async for item in call_asgi(self.app, method, path, headers, body):
            yield item

    def info(self) -> dict:
        """Identity and load: what the front's router and health watch read."""
        sched = self.engine.engine.scheduler
        config = self.engine.engine.config
        return {"replica_id": self.replica_id, "pid": os.getpid(), "num_running": len(sched.running),
                "num_waiting": len(sched.waiting), "max_num_seqs": config.max_num_seqs,
                "block_size": config.block_size}

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
