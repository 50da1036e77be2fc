"""A request's choices on the engine: the fan-out (prompt p's choice i is choice p * n + i,
its own engine request with its own seed), running them all to completion, or streaming
them as server-sent events as their tokens come."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request

from fivefold.engine.outputs import RequestOutput
from fivefold.errors import EngineDeadError, OverloadedError
from fivefold.sampling_params import SamplingParams, wrap_seed
from fivefold.serve.engine_client import EngineClient
from fivefold.serve.http_base import await_unless_disconnected

# Outputs (one per step that adds text) a streaming choice may have waiting for a client that
# reads nothing, before its stream is aborted: memory per stream stays bounded.
MAX_STREAM_BACKLOG = 1024


@dataclass(frozen=True)
class ChoiceJob:
    """One choice of a request: its index in the answer, engine request id, prompt and params."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def choice_request_ids(prompts: list[list[int]], n: int, base_id: str) -> list[list[str]]:
    """The engine request ids of each prompt's choices."""
    return [[f"{base_id}-{p * n + i}" for i in range(n)] for p in range(len(prompts))]


def choice_jobs(prompts: list[list[int]], params: SamplingParams, base_id: str) -> list[ChoiceJob]:
    """Every choice of every prompt: prompt p's choice i is index p * n + i, as OpenAI numbers the
    choices of a batched request, and is seeded with seed + i."""
    def one(index: int, ids: list[int], i: int) -> ChoiceJob:
        seed = None if params.seed is None else wrap_seed(params.seed + i)
        return ChoiceJob(index, f"{base_id}-{index}", ids, replace(params, n=1, seed=seed))

    n = params.n
    return [one(p * n + i, ids, i) for p, ids in enumerate(prompts) for i in range(n)]


async def run_choices(client: EngineClient, request: Request, prompts: list[list[int]], params: SamplingParams,
                      base_id: str) -> list[RequestOutput]:
    """Run every choice of every prompt to completion (their final outputs, in choice order);
    abort them all if the client disconnects."""
    async def one(job: ChoiceJob):
        last = None
        async for out in client.generate(job.request_id, job.prompt_token_ids, job.params):
            last = out
        return last

    # A cancelled choice's stream aborts its engine request in its finally block.
    tasks = [asyncio.ensure_future(one(job)) for job in choice_jobs(prompts, params, base_id)]
    return await await_unless_disconnected(request, tasks)


@dataclass
class StartedStream:
    """The choices of a streaming request, running: the first item, the queue of the others
    ((choice index, output, exception or None when the choice is done)) and their tasks."""

    first: tuple
    merged: asyncio.Queue
    tasks: list[asyncio.Future]

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()  # a client that went away: the streams' finally blocks abort the requests


async def start_stream(client: EngineClient, request: Request, prompts: list[list[int]], params: SamplingParams,
                       base_id: str) -> StartedStream:
    """Start every choice and wait for the first output, so that a refusal or a queue
    timeout still gets its HTTP status instead of an error inside a 200 stream. A client that
    leaves before the first token aborts every choice; one that stops reading is cut off once
    MAX_STREAM_BACKLOG outputs per choice wait for it (its choices are aborted)."""
    merged: asyncio.Queue = asyncio.Queue()
    num_jobs = len(prompts) * params.n

    async def pump(job: ChoiceJob):
        try:
            async for out in client.generate(job.request_id, job.prompt_token_ids, job.params):
                if merged.qsize() >= MAX_STREAM_BACKLOG * num_jobs:  # leaving the loop aborts the request
                    raise OverloadedError(f"the client read none of the last {MAX_STREAM_BACKLOG} outputs "
                                          "of a choice: its stream was aborted")
                merged.put_nowait((job.index, out))
        except Exception as exc:
            merged.put_nowait((job.index, exc))
        merged.put_nowait((job.index, None))

    started = StartedStream(None, merged, [asyncio.ensure_future(pump(job))
                                           for job in choice_jobs(prompts, params, base_id)])
    try:
        started.first, = await await_unless_disconnected(request, [asyncio.ensure_future(merged.get())])
    except BaseException:  # the client left (or this handler was cancelled): abort every choice
        started.cancel()
        raise
    if isinstance(started.first[1], Exception):
        started.cancel()
        raise started.first[1]
    return started


def sse(event: dict | str) -> str:
    """One server-sent event."""
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


def error_event(out) -> str | None:
    """The error event of a failed choice (an exception, or a finished output whose grammar
    failed), or None for an ordinary output."""
    if isinstance(out, Exception):
        error_type = "internal_error" if isinstance(out, EngineDeadError) else "server_error"
        return sse({"error": {"message": str(out), "type": error_type}})
    if out.finished and out.outputs[0].finish_reason == "error":  # its grammar failed: not cached
        return sse({"error": {"message": str(out.outputs[0].stop_reason), "type": "invalid_request_error",
                              "param": None, "code": "grammar_error"}})
    return None


async def stream_events(started: StartedStream, num_choices: int, chunk: Callable[[int | None, object], dict],
                        usage_of: Callable[[list], dict], include_usage: bool, first_chunks=(),
                        on_complete: Callable[[list], Awaitable] | None = None) -> AsyncIterator[str]:
    """SSE: ``first_chunks`` (each a function of the choice index) for every choice, then one event
    per new piece of text of any choice (``chunk(k, output)``), then usage (if asked) and [DONE].
    When every choice finished, ``await on_complete(final outputs)``."""
    for k in range(num_choices):
        for event in first_chunks:
            yield sse(event(k))
    finals, remaining, item = {}, num_choices, started.first
    try:
        while True:
            k, out = item
            if out is None:
                remaining -= 1
            elif (error := error_event(out)) is not None:
                yield error
            else:
                if out.finished:
                    finals[k] = out
                yield sse(chunk(k, out))
            if not remaining:
                break
            item = await started.merged.get()
        outs = [finals[k] for k in sorted(finals)]
        if on_complete is not None and len(outs) == num_choices:
            await on_complete(outs)
        if include_usage:
            yield sse(chunk(None, None) | {"choices": [], "usage": usage_of(outs)})
        yield sse("[DONE]")
    finally:
        started.cancel()
