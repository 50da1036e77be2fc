"""Queue admission: the one place that decides whether a request may wait for the engine.

A request is admitted when the queue (requests accepted but not yet scheduled) stays within
``max_queued_requests`` and ``max_queued_tokens`` with it; a batched request is admitted
whole or not at all. Its entries leave the queue when the engine schedules it, when it
finishes or is aborted, or when it has waited ``queue_timeout`` seconds (then it fails with a
503). Handlers reach this through ``EngineClient.admit``; the engine's thread sweeps it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from fivefold.errors import OverloadedError


@dataclass
class QueueEntry:
    """One queued request (a choice): its prompt's size, when it was accepted, and whether it
    has reached the engine (before that it is on its way through the engine's inbox)."""

    num_prompt_tokens: int
    accepted: float
    is_in_engine: bool = False


class QueueAdmission:
    """The queue's limits and its entries. Thread-safe: handlers reserve and release on the
    event loop, the engine's thread marks and sweeps."""

    def __init__(self, max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 queue_timeout: float | None = None) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.queue_timeout = queue_timeout
        self._entries: dict[str, QueueEntry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        """Whether the request holds a place (it was admitted, and has not left the queue)."""
        return request_id in self._entries

    def reserve(self, request_ids: list[str], num_prompt_tokens: int) -> None:
        """Take places for these requests (each with a prompt of ``num_prompt_tokens``), or raise
        OverloadedError naming the limit."""
        self.reserve_all([(request_ids, num_prompt_tokens)])

    def reserve_all(self, groups: list[tuple[list[str], int]]) -> None:
        """Take places for every (request ids, prompt tokens of each) group, or for none of them
        (OverloadedError naming the limit)."""
        with self._lock:
            num_requests = len(self._entries)
            num_tokens = sum(e.num_prompt_tokens for e in self._entries.values())
            for ids, num_prompt_tokens in groups:  # group by group: the first limit reached is named
                num_requests += len(ids)
                num_tokens += len(ids) * num_prompt_tokens
                if self.max_queued_requests is not None and num_requests > self.max_queued_requests:
                    raise OverloadedError(f"too many queued requests: the limit is {self.max_queued_requests}")
                if self.max_queued_tokens is not None and num_tokens > self.max_queued_tokens:
                    raise OverloadedError(f"too many queued prompt tokens: the limit is {self.max_queued_tokens}")
            now = time.monotonic()
            for ids, num_prompt_tokens in groups:
                for request_id in ids:
                    self._entries[request_id] = QueueEntry(num_prompt_tokens, now)

    def release(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._entries.pop(request_id, None)

    def mark_in_engine(self, request_id: str) -> None:
        """The request reached the engine: from now on the sweep may judge it."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                entry.is_in_engine = True

    def sweep(self, is_waiting: Callable[[str], bool]) -> list[tuple[str, float]]:
        """Drop the entries of requests in the engine that are no longer waiting (scheduled,
        finished or gone); drop and return (request id, seconds waited) of those that waited
        past the timeout, for the caller to abort and fail."""
        now = time.monotonic()
        with self._lock:
            entries = list(self._entries.items())
        expired = []
        for request_id, entry in entries:
            if not entry.is_in_engine:
                continue  # still on its way through the inbox
            if is_waiting(request_id):
                if self.queue_timeout is None or now - entry.accepted <= self.queue_timeout:
                    continue
                expired.append((request_id, now - entry.accepted))
            self.release([request_id])
        return expired

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
