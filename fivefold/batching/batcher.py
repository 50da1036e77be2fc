"""A dynamic batcher for models that answer in one forward pass (encoders, classifiers, CNNs).

Requests queue in length buckets; one worker thread owns the model and runs one batch at
a time. A bucket's requests become a batch when one of these holds:

- it holds ``max_batch_size`` requests, or enough that padding them to the longest
  reaches ``max_batch_tokens`` (the tokens the forward really computes);
- its oldest request has waited ``max_queue_delay``.

When several buckets are ready, the one holding the oldest request goes first, so no
request waits behind a stream of newer ones; inside a bucket, requests leave in arrival
order. A batch takes its bucket's requests oldest first while the size and padded-token
limits hold; if it has room left, it is topped up with the longest requests of shorter
buckets while real / padded tokens stays at or above ``min_padding_efficiency`` (a
short request padded into a batch costs little; running it alone later costs a whole
forward). Lengths past the last bucket boundary share one overflow bucket.

Each request gets a ``concurrent.futures.Future`` (``submit``; asyncio wraps it with
``asyncio.wrap_future``). Cancelling it while queued removes it (it never runs). A request
still queued after ``request_timeout`` fails with QueueTimeoutError. ``submit_many``
refuses with OverloadedError when the queue would exceed ``max_queued_requests``. A
request longer than ``max_batch_tokens`` can never run and is refused with
InvalidRequestError.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from fivefold.batching.config import BatcherConfig
from fivefold.errors import EngineDeadError, InvalidRequestError, OverloadedError, QueueTimeoutError

log = logging.getLogger("fivefold.batcher")


_arrival_order = itertools.count()


@dataclass
class _Request:
    payload: Any
    length: int
    arrival: float
    deadline: float | None
    future: Future = field(default_factory=Future)
    order: int = field(default_factory=lambda: next(_arrival_order))  # breaks ties of equal arrival times


@dataclass
class BatchRecord:
    """One executed batch: what the metrics and the tests look at."""

    size: int
    real_tokens: int
    padded_tokens: int  # size x longest length in the batch
    queue_times: list[float]
    execution_time: float


class DynamicBatcher:
    """Batches calls of ``run_batch(payloads) -> results`` (one result per payload, in order).

    ``delay`` is the resolved ``max_queue_delay`` in seconds (pass it when the config says
    "auto": see ``fivefold.batching.encoder.measure_auto_delay``). ``on_batch`` is called
    from the worker thread with each :class:`BatchRecord` (metrics); ``on_reject`` with the
    reason of each refusal.
    """

    def __init__(self, run_batch: Callable[[list], Sequence], config: BatcherConfig, delay: float | None = None,
                 on_batch: Callable[[BatchRecord], None] | None = None,
                 on_reject: Callable[[str], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        if delay is None:
            if config.max_queue_delay == "auto":
                raise ValueError("max_queue_delay is 'auto': measure it and pass delay=")
            delay = float(config.max_queue_delay)
        self.config, self.delay = config, delay
        self._run_batch = run_batch
        self._on_batch, self._on_reject = on_batch, on_reject
        self.on_fatal = on_fatal
        self.fatal_error: EngineDeadError | None = None
        self._current: list[_Request] = []  # the batch the worker has taken off the queues
        self._boundaries = list(config.length_buckets or ())
        self._buckets = [deque() for _ in range(len(self._boundaries) + 1)]
        self._num_queued = 0
        self._cond = threading.Condition()
        self._stopped = False
        self.history: deque[BatchRecord] = deque(maxlen=config.history_size)
        self._thread = threading.Thread(target=self._loop, name="fivefold-batcher", daemon=True)
        self._thread.start()
        # Timeouts must fire while the worker is busy in the model: a second thread reaps them.
        self._reaper = threading.Thread(target=self._reap_loop, name="fivefold-batcher-timeouts", daemon=True)
        self._reaper.start()

    # ---- submission (any thread) ----

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def is_running(self) -> bool:
        """False after shutdown or after the worker failed (``/health`` then answers 503)."""
        return self._thread.is_alive() and not self._stopped and self.fatal_error is None

    def submit(self, payload: Any, length: int, timeout: float | None = None) -> Future:
        """Queue one request of ``length`` tokens; its future resolves to its result."""
        return self.submit_many([(payload, length)], timeout)[0]

    def submit_many(self, items: Sequence[tuple[Any, int]], timeout: float | None = None) -> list[Future]:
        """Queue several requests at once, all or none (one HTTP request with several inputs)."""
        timeout = timeout if timeout is not None else self.config.request_timeout
        for _, length in items:
            if length > self.config.max_batch_tokens:
                self._reject("too_long")
                raise InvalidRequestError(f"input of {length} tokens exceeds max_batch_tokens "
                                          f"({self.config.max_batch_tokens})")
        now = time.monotonic()
        requests = [_Request(p, n, now, None if timeout is None else now + timeout) for p, n in items]
        with self._cond:
            if self.fatal_error is not None:
                raise self.fatal_error
            if self._stopped:
                raise OverloadedError("the batcher is shut down")
            limit = self.config.max_queued_requests
            if limit is not None and self._num_queued + len(requests) > limit:
                self._reject("queue_full")
                raise OverloadedError(f"{self._num_queued} requests are queued and this adds {len(requests)}; "
                                      f"the limit is {limit} (max_queued_requests)")
            for r in requests:
                self._buckets[bisect.bisect_left(self._boundaries, r.length)].append(r)
                r.future.add_done_callback(self._forget_if_cancelled(r))
            self._num_queued += len(requests)
            self._cond.notify_all()
        return [r.future for r in requests]

    def shutdown(self) -> None:
        """Stop the worker; requests still queued fail with OverloadedError."""
        with self._cond:
            self._stopped = True
            pending = [r for bucket in self._buckets for r in bucket]
            for bucket in self._buckets:
                bucket.clear()
            self._num_queued = 0
            self._cond.notify_all()
        for r in pending:
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(OverloadedError("the server is shutting down"))
        self._thread.join(10)
        self._reaper.join(10)

    # ---- the worker (the only thread that runs the model) ----

    def _forget_if_cancelled(self, request: _Request):
        def callback(future: Future) -> None:
            if future.cancelled():
                with self._cond:
                    bucket = self._buckets[bisect.bisect_left(self._boundaries, request.length)]
                    try:
                        bucket.remove(request)
                        self._num_queued -= 1
                    except ValueError:
                        pass  # already taken into a batch
        return callback

    def _reject(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)

    def _expire(self, now: float) -> None:
        """Fail the queued requests whose timeout has passed (called with the lock held)."""
        for bucket in self._buckets:
            expired = [r for r in bucket if r.deadline is not None and r.deadline <= now]
            for r in expired:
                bucket.remove(r)
                self._num_queued -= 1
                if r.future.set_running_or_notify_cancel():
                    r.future.set_exception(QueueTimeoutError(
                        f"request waited {now - r.arrival:.3f} s in the queue; the limit is "
                        f"{r.deadline - r.arrival:.3f} s (request_timeout)"))
                self._reject("timeout")

    def _is_full(self, bucket: deque) -> bool:
        if len(bucket) >= self.config.max_batch_size:
            return True
        longest = max(r.length for r in bucket)
        return len(bucket) * longest >= self.config.max_batch_tokens

    def _next_batch(self) -> list[_Request] | None:
        """Take the next batch, or None (called with the lock held). Timeouts are the reaper's."""
        now = time.monotonic()
        ready = [b for b in self._buckets if b and (self._is_full(b) or now - b[0].arrival >= self.delay)]
        if not ready:
            return None
        bucket = min(ready, key=lambda b: b[0].order)
        batch, longest = [], 0
        while bucket and len(batch) < self.config.max_batch_size:
            longest_if_added = max(longest, bucket[0].length)
            if batch and longest_if_added * (len(batch) + 1) > self.config.max_batch_tokens:
                break
            batch.append(bucket.popleft())
            longest = longest_if_added
        self._top_up(batch, longest, self._buckets.index(bucket))
        self._num_queued -= len(batch)
        return batch

    def _top_up(self, batch: list[_Request], longest: int, bucket_index: int) -> None:
        """Add the longest requests of shorter buckets while padding efficiency and limits hold."""
        target = self.config.min_padding_efficiency
        if not target or not self._boundaries:
            return
        real = sum(r.length for r in batch)
        for shorter in reversed(self._buckets[:bucket_index]):
            for r in sorted(shorter, key=lambda r: -r.length):
                if len(batch) >= self.config.max_batch_size or longest * (len(batch) + 1) > self.config.max_batch_tokens:
                    return
                if (real + r.length) / (longest * (len(batch) + 1)) < target:
                    return  # the rest are shorter still
                shorter.remove(r)
                batch.append(r)
                real += r.length

    def _wait_time(self) -> float | None:
        deadlines = [b[0].arrival + self.delay for b in self._buckets if b]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _reap_loop(self) -> None:
        with self._cond:
            while not self._stopped:
                self._expire(time.monotonic())
                deadlines = [r.deadline for b in self._buckets for r in b if r.deadline is not None]
                self._cond.wait(max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    batch = self._next_batch()
                    while batch is None and not self._stopped:
                        self._cond.wait(self._wait_time())
                        batch = self._next_batch()
                    if self._stopped:
                        return
                    self._current = batch
                self._execute(batch)
                self._current = []
        except BaseException as exc:  # a bug outside the model call: fail every request, never hang one
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail the batch in hand and everything queued with EngineDeadError (500), refuse new
        requests the same way, then call ``on_fatal`` (the server exits non-zero)."""
        log.error("the batcher thread failed; failing every queued request", exc_info=exc)
        with self._cond:
            self.fatal_error = EngineDeadError.from_exception(exc)
            pending = self._current + [r for bucket in self._buckets for r in bucket]
            for bucket in self._buckets:
                bucket.clear()
            self._num_queued = 0
        for r in pending:
            if not r.future.done() and (r.future.running() or r.future.set_running_or_notify_cancel()):
                r.future.set_exception(self.fatal_error)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _execute(self, batch: list[_Request]) -> None:
        started = time.monotonic()
        live = [r for r in batch if r.future.set_running_or_notify_cancel()]  # drops cancelled ones
        if not live:
            return
        try:
            results = self._run_batch([r.payload for r in live])
            if len(results) != len(live):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(live)} inputs")
        except Exception as exc:  # the model failed: every request of the batch gets the error
            for r in live:
                r.future.set_exception(exc)
            return
        elapsed = time.monotonic() - started
        lengths = [r.length for r in live]
        record = BatchRecord(len(live), sum(lengths), len(live) * max(lengths),
                             [started - r.arrival for r in live], elapsed)
        for r, result in zip(live, results):
            r.future.set_result(result)
        self.history.append(record)
        if self._on_batch is not None:
            self._on_batch(record)
