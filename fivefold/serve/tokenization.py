"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: behind the API key, and held to the limits
of a request (a prompt or token list longer than the context is refused with a 400)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from fivefold.serve.chat import chat_messages
from fivefold.serve.engine_client import EngineClient
from fivefold.serve.http_base import APIError, check_model
from fivefold.serve.logprobs import token_text
from fivefold.serve.protocol import DetokenizeRequest, TokenizeRequest


class TokenizeAPI:
    """The tokenizer surface over an EngineClient."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client, self.model_name, self.tokenizer = client, model_name, client.tokenizer

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, req: TokenizeRequest):
        """vLLM's shape: {"count", "max_model_len", "tokens", "token_strs"}. Behind the API key, and held
        to the limits of a request: a prompt longer than the context is refused (400)."""
        check_model(req.model, self.model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if req.prompt is None and req.add_special_tokens:
            raise APIError(400, "add_special_tokens applies to a prompt: the chat template writes the special "
                                "tokens of messages itself", "add_special_tokens")
        ids = await asyncio.to_thread(self.token_ids, req)
        max_model_len = self.client.max_model_len
        if len(ids) > max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the maximum context length is {max_model_len}",
                           "prompt" if req.prompt is not None else "messages")
        strs = await asyncio.to_thread(lambda: [token_text(self.tokenizer, t) for t in ids]) \
            if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    def token_ids(self, req: TokenizeRequest) -> list[int]:
        """The prompt's token ids, or the messages' as the chat template renders them."""
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return self.tokenizer.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)

    async def detokenize(self, req: DetokenizeRequest):
        check_model(req.model, self.model_name)
        vocab_size = self.client.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
        max_model_len = self.client.max_model_len
        if len(req.tokens) > max_model_len:
            raise APIError(400, f"{len(req.tokens)} tokens; the maximum context length is {max_model_len}", "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens, skip_special_tokens=False)}
