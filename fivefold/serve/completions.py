"""``POST /v1/completions``: one prompt or a batch (text or token ids), ``n`` choices each, with
``echo`` and ``logprobs``; ``max_tokens`` 0 with ``echo`` scores the prompt."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from fivefold.serve.generation import GenerationAPI, usage
from fivefold.serve.http_base import APIError
from fivefold.serve.logprobs import LogprobBodies, new_entries
from fivefold.serve.protocol import CompletionRequest


@dataclass
class CompletionShaper:
    """The completions fields of one request's choices and chunks (see ChoiceShaper).

    Scoring (echo with max_tokens 0) runs one token (the engine always samples one) and drops
    it: the answer holds the prompt and its logprobs only. With ``echo`` the prompt (and its
    logprobs, the first null) goes in front of a choice, and of the first chunk of a stream."""

    req: CompletionRequest
    prompts: list[list[int]]
    texts: list[str]
    n: int
    logprobs: LogprobBodies
    echoed_choices: set[int] = field(default_factory=set)

    def shaped(self, out, k: int, text: str, entries, finish, with_prompt: bool) -> dict:
        if self.req.is_scoring:
            text, entries = "", [] if entries is not None else None
            finish = "length" if finish else None
        if with_prompt:
            text = self.texts[k // self.n] + text
            if self.req.echo and self.req.logprobs is not None:
                first = {"token_id": self.prompts[k // self.n][0], "logprob": None, "top": None}
                entries = [first, *(out.prompt_logprobs or [None])[1:], *(entries or [])]
        return {"text": text, "logprobs": self.logprobs.completion(entries), "finish_reason": finish}

    def choice(self, out, k: int) -> dict:
        c = out.outputs[0]
        return self.shaped(out, k, c.text, c.logprobs, c.finish_reason, self.req.echo)

    def delta(self, out, k: int) -> dict:
        first_chunk = self.req.echo and k not in self.echoed_choices  # the first chunk of a choice carries the prompt
        self.echoed_choices.add(k)
        return self.shaped(out, k, out.delta_text, new_entries(out), out.outputs[0].finish_reason, first_chunk)

    def usage(self, outs: list) -> dict:
        return usage(self.prompts, outs, self.n, 0 if self.req.is_scoring else None)


class CompletionsAPI(GenerationAPI):
    """The completions surface over an EngineClient."""

    kind, id_prefix, object_name, chunk_object = "completions", "cmpl", "text_completion", "text_completion"

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_request(req)
        prompts, texts = await asyncio.to_thread(self.prompts_of, req)  # a large prompt: off the event loop
        if req.is_scoring and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is accepted only with echo, to score the prompt)",
                           "max_tokens")
        params = req.to_sampling_params()
        shaper = CompletionShaper(req, prompts, texts, params.n, self.logprobs)
        return await self.respond(req, request, prompts, params, shaper)

    def prompts_of(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """(token ids, text) of each prompt of a completions request (one, or a batch)."""
        vocab_size = self.client.model_config.vocab_size
        given = req.prompt
        if isinstance(given, list) and not given:  # [] would be a batch of no prompts: an answer with no choices
            raise APIError(400, "prompt is an empty list; give a prompt (text or token ids) or a batch of them",
                           "prompt")
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        prompts, texts = [], []
        for p, one in enumerate(given):
            if isinstance(one, str):
                prompts.append(self.tokenizer.encode(one) if one else [])
                texts.append(one)
                continue
            # The ids are checked here, where they are decoded for echo: the engine takes them as given.
            bad = next((t for t in one if not 0 <= t < vocab_size), None)
            if bad is not None:
                where = "" if len(given) == 1 else f" (prompt {p})"
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size}){where}",
                               "prompt")
            prompts.append(list(one))
            texts.append(self.tokenizer.decode(list(one), skip_special_tokens=False))
        return prompts, texts
