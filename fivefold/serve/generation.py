"""The shared path of the two generation surfaces (completions.py, chat.py): request checks,
admission, the result cache, the engine, and the answer as JSON or server-sent events.

A surface turns its request into prompts (token ids) and SamplingParams, and gives a
:class:`ChoiceShaper` for the fields only it has; :meth:`GenerationAPI.respond` does the rest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from fivefold.sampling_params import SamplingParams
from fivefold.serve.choices import choice_request_ids, run_choices, start_stream, stream_events
from fivefold.serve.engine_client import EngineClient
from fivefold.serve.http_base import APIError, check_model
from fivefold.serve.logprobs import LogprobBodies
from fivefold.serve.protocol import unsupported_fields
from fivefold.serve.served_cache import ServedResultCache, cached_events, fresh_ids

# The work one request may ask for in logprobs: choices x (echoed prompt tokens + max_tokens) x
# (1 + logprobs), summed over its prompts. Each entry becomes Python objects and JSON (~100 bytes),
# so this bounds a request's answer to ~100 MB; lm-eval-style scoring (64 prompts of 2k tokens,
# echo, logprobs 1) needs a quarter of it.
MAX_LOGPROB_ENTRIES = 1 << 20


class ChoiceShaper(Protocol):
    """The endpoint's own fields of one request's answer (it may keep per-request state, e.g.
    which streamed choices have had their first chunk)."""

    def choice(self, out, k: int) -> dict:
        """The fields of finished choice k."""

    def delta(self, out, k: int) -> dict:
        """The fields of a stream chunk of choice k."""

    def usage(self, outs: list) -> dict:
        """The answer's usage, from the final outputs of its choices."""


def usage(prompts: list[list[int]], outs: list, n: int, num_completion_tokens: int | None = None) -> dict:
    """OpenAI's usage (every output token counts unless ``num_completion_tokens`` is given), with
    the prompt tokens served from the prefix cache (one choice per prompt counts)."""
    completion = sum(len(o.outputs[0].token_ids) for o in outs) if num_completion_tokens is None \
        else num_completion_tokens
    prompt = sum(len(ids) for ids in prompts)
    cached = sum(outs[p * n].num_cached_tokens for p in range(len(prompts)) if p * n < len(outs))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


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


@dataclass
class Answer:
    """One request's answer in the making: its id, creation time, result-cache key and shaper."""

    api: GenerationAPI
    req: object
    prompts: list[list[int]]
    params: SamplingParams
    shaper: ChoiceShaper
    key: str | None
    id: str
    created: int

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.api.model_name}

    def chunk(self, k: int | None, out) -> dict:
        """A stream chunk of choice k's new output (only the head without an output)."""
        head = self.head(self.api.chunk_object)
        if out is None:
            return head
        body = head | {"choices": [{"index": k, **self.shaper.delta(out, k)}]}
        if self.req.stream_options and self.req.stream_options.continuous_usage_stats:
            # vLLM's continuous_usage_stats: this choice's usage so far
            num_prompt, num_out = len(self.prompts[k // self.params.n]), len(out.outputs[0].token_ids)
            body["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                             "total_tokens": num_prompt + num_out}
        return body

    def role_chunk(self, k: int) -> dict:
        """A chat stream's first chunk of choice k: the assistant's role."""
        return self.head(self.api.chunk_object) | {"choices": [
            {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    async def body(self, outs: list) -> dict:
        """The whole answer from the choices' final outputs (stored in the result cache)."""
        # Detokenizing logprobs of thousands of tokens takes a while: off the event loop.
        choices = await asyncio.to_thread(lambda: [{"index": k, **self.shaper.choice(o, k)}
                                                   for k, o in enumerate(outs)])
        body = self.head(self.api.object_name) | {"choices": choices, "usage": self.shaper.usage(outs)}
        await self.api.cache.store(self.key, body)
        return body


class GenerationAPI:
    """The base of the completions and chat surfaces (see the module doc). Subclasses set the
    result-cache endpoint name (``kind``), the id prefix and the response objects."""

    kind: str
    id_prefix: str
    object_name: str
    chunk_object: str
    streams_role = False  # chat streams open each choice with the assistant's role

    def __init__(self, client: EngineClient, model_name: str, cache: ServedResultCache) -> None:
        self.client, self.model_name, self.cache = client, model_name, cache
        self.tokenizer = client.tokenizer
        self.logprobs = LogprobBodies(client.tokenizer)

    def check_request(self, req) -> None:
        """400 for a field this server does not implement (named), 404 for another model."""
        check_model(req.model, self.model_name)
        refused = unsupported_fields(req)
        if refused is not None:
            raise APIError(400, refused[1], refused[0], "unsupported_field")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} with n={req.n} is not supported: choosing the best of extra "
                                "samples is not implemented (best_of must equal n, or be left out)", "best_of")

    async def validate_and_reserve(self, prompts: list[list[int]], params: SamplingParams, base_id: str) -> None:
        """Refuse an empty prompt or too much logprob work (400s naming them), then admit the
        request: validated once by the engine client, and queued whole or refused."""
        for p, ids in enumerate(prompts):
            if not ids:
                where = "" if len(prompts) == 1 else f" (prompt {p})"
                raise APIError(400, f"the prompt is empty{where}; at least one token is required", "prompt")
        check_work(prompts, params)
        await self.client.admit(prompts, params, choice_request_ids(prompts, params.n, base_id))

    async def respond(self, req, request: Request, prompts: list[list[int]], params: SamplingParams,
                      shaper: ChoiceShaper):
        """The answer: from the result cache, or from the engine after admission; JSON or SSE."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        key, hit, cache_state = await self.cache.lookup(self.kind, req, request)
        headers = {"X-Cache": cache_state}
        if hit is not None:
            body = fresh_ids(hit, self.id_prefix)
            if req.stream:
                return StreamingResponse(cached_events(body, self.chunk_object, include_usage, self.streams_role),
                                         media_type="text/event-stream", headers=headers)
            return JSONResponse(body, headers=headers)
        answer = Answer(self, req, prompts, params, shaper, key, f"{self.id_prefix}-{uuid.uuid4().hex}",
                        int(time.time()))
        await self.validate_and_reserve(prompts, params, answer.id)
        if req.stream:
            started = await start_stream(self.client, request, prompts, params, answer.id)
            first_chunks = (answer.role_chunk,) if self.streams_role else ()
            events = stream_events(started, len(prompts) * params.n, answer.chunk, shaper.usage, include_usage,
                                   first_chunks, on_complete=answer.body)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        outs = await run_choices(self.client, request, prompts, params, answer.id)
        failed = next((o for o in outs if o.outputs[0].finish_reason == "error"), None)
        if failed is not None:  # one choice's grammar failed: the request fails, nothing is cached
            raise APIError(400, str(failed.outputs[0].stop_reason), None, "grammar_error")
        body = await answer.body(outs)
        return await asyncio.to_thread(JSONResponse, body, headers=headers)  # rendering a large body, too
