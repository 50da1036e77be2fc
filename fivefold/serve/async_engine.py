"""The async front of the engine: one thread owns the engine and runs its step loop;
coroutines submit requests and read their outputs from asyncio queues.

Only the engine thread touches the LLMEngine (one owner per resource). Requests and
aborts reach it through a thread-safe inbox; outputs go back to each request's event
loop with ``call_soon_threadsafe``.

Failure: any exception in the engine thread, inside ``step()`` or outside it (inbox,
aborts, queue bookkeeping, delivery, metrics), is fatal. The thread logs the traceback
once, fails every request in flight or on its way with :class:`EngineDeadError` (HTTP 500,
``type: internal_error``), refuses new requests the same way, reports not running
(``/health`` 503) and calls ``on_fatal`` (``fivefold serve`` then shuts the server down
and exits with status 1, for a supervisor to restart; a replica is restarted by Ray
Serve's health check). The engine's state after an unexpected exception is not trusted,
so it is never stepped again.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from fivefold.engine.llm_engine import LLMEngine
from fivefold.engine.outputs import RequestOutput
from fivefold.errors import EngineDeadError, OverloadedError, QueueTimeoutError
from fivefold.sampling_params import SamplingParams
from fivefold.serve.metrics import ServerMetrics

log = logging.getLogger("fivefold.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 queue_timeout: float | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: EngineDeadError | None = None
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.queue_timeout = queue_timeout
        # Requests accepted but not yet scheduled: id -> [prompt tokens, time accepted, is in the engine].
        self._queued: dict[str, list] = {}
        self._queue_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError now if the request can never run (reads only fixed limits)."""
        self.engine.validate(len(prompt_token_ids), params)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive (false after shutdown or a crash)."""
        return self._thread.is_alive() and not self._stopped.is_set() and self.fatal_error is None

    @property
    def num_queued_requests(self) -> int:
        return len(self._queued)

    def reserve_queue(self, request_ids: list[str], num_prompt_tokens: int) -> None:
        """Take places in the queue for these requests, or raise OverloadedError naming the limit."""
        with self._queue_lock:
            num_requests = len(self._queued) + len(request_ids)
            num_tokens = sum(entry[0] for entry in self._queued.values()) + num_prompt_tokens * len(request_ids)
            if self.max_queued_requests is not None and num_requests > self.max_queued_requests:
                raise OverloadedError(f"too many queued requests: the limit is {self.max_queued_requests}")
            if self.max_queued_tokens is not None and num_tokens > self.max_queued_tokens:
                raise OverloadedError(f"too many queued prompt tokens: the limit is {self.max_queued_tokens}")
            now = time.monotonic()
            for request_id in request_ids:
                self._queued[request_id] = [num_prompt_tokens, now, False]

    def release_queue(self, request_ids: list[str]) -> None:
        with self._queue_lock:
            for request_id in request_ids:
                self._queued.pop(request_id, None)

    def _update_queue(self) -> None:
        """Drop scheduled or finished requests from the queue; time out the ones waiting too long."""
        now = time.monotonic()
        with self._queue_lock:
            queued = list(self._queued.items())
        for request_id, (_, accepted, is_in_engine) in queued:
            if not is_in_engine:
                continue  # still on its way through the inbox
            state = self.engine.requests.get(request_id)
            if state is not None and state.seq.metrics.first_scheduled_time is None:
                if self.queue_timeout is None or now - accepted <= self.queue_timeout:
                    continue
                self.engine.abort(request_id)
                self._deliver(request_id, QueueTimeoutError(
                    f"request waited {now - accepted:.1f} s in the queue; the limit is {self.queue_timeout} s"))
                if self.metrics is not None:
                    self.metrics.request_aborted(request_id)
            self.release_queue([request_id])

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that adds a token. Leaving the
        iteration early (a client that disconnected) aborts the request."""
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        self._inbox.put(("add", request_id, prompt_token_ids, params))
        self._wake.set()
        finished = False
        try:
            if self.fatal_error is not None:  # set before the failing thread delivers: nobody is missed
                raise self.fatal_error
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self.release_queue([request_id])
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the step loop, then abort every request still in the engine (freeing its blocks)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        if self.fatal_error is not None:
            return  # the failed thread delivered its errors; the engine's state is not trusted
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, QueueTimeoutError("the server is shutting down"))

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out_queue = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                if request_id in self.engine.requests:
                    self.engine.abort(request_id)
                    if self.metrics is not None:
                        self.metrics.request_aborted(request_id)
                        # The gauges must show the freed blocks even if no step follows (the last request left).
                        self.metrics.observe_step(self.engine, [])
                continue
            prompt_token_ids, params = rest
            try:
                self.engine.add_request(prompt_token_ids, params, request_id=request_id)
            except Exception as exc:  # invalid after all: tell the waiting coroutine
                self._deliver(request_id, exc)
            with self._queue_lock:
                if request_id in self._queued:
                    self._queued[request_id][2] = True

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if self._queued:
                    self._update_queue()
                if not self.engine.has_unfinished:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self.metrics is not None:
                    self.metrics.observe_step(self.engine, outputs)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # a bug anywhere in the loop: fail loudly, never hang a request
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.error("the engine thread failed; failing every request in flight", exc_info=exc)
        self.fatal_error = EngineDeadError.from_exception(exc)
        for request_id in list(self._streams):
            try:
                self._deliver(request_id, self.fatal_error)
            except RuntimeError:  # that request's event loop is closed: nobody waits on it
                pass
        with self._queue_lock:
            self._queued.clear()
        if self.on_fatal is not None:
            self.on_fatal(exc)
