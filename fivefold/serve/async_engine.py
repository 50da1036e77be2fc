"""The async front of the engine: one thread owns the engine and runs its step loop;
coroutines submit requests and read their outputs from asyncio queues.

Only the engine thread touches the LLMEngine (one owner per resource). Requests and
aborts reach it through a thread-safe inbox (:class:`AddRequest`, :class:`AbortRequest`);
what it has for a request goes back to that request's event loop with
``call_soon_threadsafe`` (:class:`NewOutput`, :class:`RequestFailed`).

:class:`AsyncEngine` is the server's :class:`~fivefold.serve.engine_client.EngineClient`: a
request is validated once, by ``admit`` in a worker thread, and the engine thread adds it
without validating it again.

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
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fivefold.engine.llm_engine import LLMEngine
from fivefold.engine.outputs import RequestOutput
from fivefold.errors import EngineDeadError, QueueTimeoutError
from fivefold.sampling_params import SamplingParams
from fivefold.serve.admission import QueueAdmission
from fivefold.serve.metrics import ServerMetrics
from fivefold.serve.operations import note_output

log = logging.getLogger("fivefold.engine")


@dataclass(frozen=True)
class AddRequest:
    """Inbox: run this request (``validated``: admitted, so already checked against the engine)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    validated: bool


@dataclass(frozen=True)
class AbortRequest:
    """Inbox: drop this request wherever it is."""

    request_id: str


@dataclass(frozen=True)
class NewOutput:
    """Delivered: the request's output after a step that added tokens (finished on the last)."""

    output: RequestOutput


@dataclass(frozen=True)
class RequestFailed:
    """Delivered: the request ends with this error (refused after all, timed out, engine dead)."""

    error: BaseException


class AsyncEngine:
    """An LLMEngine run by its own thread, served to coroutines (see the module doc)."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 queue_timeout: float | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: EngineDeadError | None = None
        self.metrics = metrics
        self.admission = QueueAdmission(max_queued_requests, max_queued_tokens, queue_timeout)
        self._stats = engine.stats()  # the engine thread's latest copy: other threads never read the engine's state
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)
        self._thread.start()

    # -- what the server reads (fixed after start) -------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.loaded.config

    @property
    def model_path(self):
        return self.engine.loaded.path

    @property
    def dtype(self):
        return self.engine.loaded.model.dtype

    @property
    def quantization(self) -> str | None:
        """The int8 scheme the weights carry (a quantized checkpoint or quantization on load), or None."""
        q = self.engine.loaded.quantization
        return None if q is None else q.get("scheme")

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive (false after shutdown or a crash)."""
        return self._thread.is_alive() and not self._stopped.is_set() and self.fatal_error is None

    @property
    def num_queued_requests(self) -> int:
        return len(self.admission)

    def stats(self) -> dict:
        """The engine's counters as of its thread's last step (or abort)."""
        return dict(self._stats)

    # -- requests ------------------------------------------------------------------------------

    async def admit(self, prompts: list[list[int]], params: SamplingParams, request_ids: list[list[str]]) -> None:
        """Validate every prompt with ``params`` (raises InvalidRequestError if the request can
        never run) in a worker thread, then take the queue places of ``request_ids`` (prompt p's
        choices are ``request_ids[p]``), all or none (OverloadedError naming the limit)."""
        def validate_all() -> None:  # reads only fixed limits: safe beside the engine thread
            for ids in prompts:
                self.engine.validate(len(ids), params)

        await asyncio.to_thread(validate_all)  # a grammar's check can take a while: off the event loop
        self.admission.reserve_all([(ids, len(prompt)) for ids, prompt in zip(request_ids, prompts)])

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that adds a token. Leaving the
        iteration early (a client that disconnected) aborts the request."""
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        self._inbox.put(AddRequest(request_id, prompt_token_ids, params, validated=request_id in self.admission))
        self._wake.set()
        finished = False
        try:
            if self.fatal_error is not None:  # set before the failing thread delivers: nobody is missed
                raise self.fatal_error
            while True:
                item: NewOutput | RequestFailed = await out_queue.get()
                if isinstance(item, RequestFailed):
                    raise item.error
                finished = item.output.finished
                if finished:
                    note_output(item.output)  # this request's access line (operations.py)
                yield item.output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self.admission.release([request_id])
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))
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
            self._deliver(request_id, RequestFailed(QueueTimeoutError("the server is shutting down")))

    # -- the engine thread ---------------------------------------------------------------------

    def _deliver(self, request_id: str, item: NewOutput | RequestFailed) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out_queue = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AbortRequest):
                self._abort(message.request_id)
            else:
                self._add(message)

    def _abort(self, request_id: str) -> None:
        if request_id in self.engine.requests:
            self.engine.abort(request_id)
            # The stats (and gauges) must show the freed blocks even if no step follows (the last request left).
            self._stats = self.engine.stats()
            if self.metrics is not None:
                self.metrics.request_aborted(request_id)
                self.metrics.observe_step(self._stats, [])

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(message.prompt_token_ids, message.params, request_id=message.request_id,
                                    validated=message.validated)
        except Exception as exc:  # refused after all (e.g. its grammar fails to compile): tell the waiting coroutine
            self._deliver(message.request_id, RequestFailed(exc))
        self.admission.mark_in_engine(message.request_id)

    def _is_waiting(self, request_id: str) -> bool:
        """Whether the request is in the engine and not scheduled yet."""
        state = self.engine.requests.get(request_id)
        return state is not None and state.seq.metrics.first_scheduled_time is None

    def _update_queue(self) -> None:
        """Drop scheduled or finished requests from the queue; time out the ones waiting too long."""
        for request_id, waited in self.admission.sweep(self._is_waiting):
            self.engine.abort(request_id)
            self._deliver(request_id, RequestFailed(QueueTimeoutError(
                f"request waited {waited:.1f} s in the queue; the limit is {self.admission.queue_timeout} s")))
            if self.metrics is not None:
                self.metrics.request_aborted(request_id)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if len(self.admission):
                    self._update_queue()
                if not self.engine.has_unfinished:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                if self.metrics is not None:
                    self.metrics.observe_step(self._stats, outputs)
                for out in outputs:
                    self._deliver(out.request_id, NewOutput(out))
        except BaseException as exc:  # a bug anywhere in the loop: fail loudly, never hang a request
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.error("the engine thread failed; failing every request in flight", exc_info=exc)
        self.fatal_error = EngineDeadError.from_exception(exc)
        for request_id in list(self._streams):
            try:
                self._deliver(request_id, RequestFailed(self.fatal_error))
            except RuntimeError:  # that request's event loop is closed: nobody waits on it
                pass
        self.admission.clear()
        if self.on_fatal is not None:
            self.on_fatal(exc)
