"""``POST /v1/chat/completions``: messages rendered by the model's chat template, ``n`` choices,
``logprobs``/``top_logprobs``, and tool calls (tool_calls.py: parsed from the text, forced by a
grammar when ``tool_choice`` asks for one)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from fivefold.serve.generation import GenerationAPI, usage
from fivefold.serve.http_base import APIError
from fivefold.serve.logprobs import LogprobBodies, new_entries
from fivefold.serve.protocol import MAX_TOOLS, ChatCompletionRequest, NamedToolChoice, message_text
from fivefold.serve.tool_calls import (
    ToolCallStream,
    check_tool_request,
    forced_call_grammar,
    parse_tool_calls,
    template_tool_call,
)


def chat_messages(req) -> list[dict]:
    """The messages as the chat template takes them: content as text, tool fields kept."""
    if not req.messages:
        raise APIError(400, "messages is empty; at least one message is required", "messages")
    rendered = []
    for i, m in enumerate(req.messages):
        text = message_text(m)
        if text is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages[{i}]: content is required (null only on an assistant message with "
                                "tool_calls)", f"messages.{i}.content")
        one = {"role": m.role, "content": text or ""}  # templates test content, or print None
        one |= {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None}
        if m.tool_calls:
            one["tool_calls"] = [template_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]
        rendered.append(one)
    return rendered


@dataclass
class ChatShaper:
    """The chat fields of one request's choices and chunks (see ChoiceShaper); with tools, the
    calls parsed from each choice's text (streamed: as each call completes)."""

    prompts: list[list[int]]
    n: int
    calls_tools: bool
    logprobs: LogprobBodies
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

    @staticmethod
    def finish_reason(out, has_calls: bool) -> str | None:
        reason = out.outputs[0].finish_reason
        return "tool_calls" if has_calls and reason == "stop" else reason

    def choice(self, out, k: int) -> dict:
        text = out.outputs[0].text
        content, calls = parse_tool_calls(text) if self.calls_tools else (text, [])
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        return {"message": message, "logprobs": self.logprobs.chat(out.outputs[0].logprobs),
                "finish_reason": self.finish_reason(out, bool(calls))}

    def delta(self, out, k: int) -> dict:
        if not self.calls_tools:
            delta = {"content": out.delta_text}
        else:
            stream = self.streams.setdefault(k, ToolCallStream())
            content, calls = stream.feed(out.delta_text, out.finished)
            delta = {"content": content} if content or not calls else {}
            if calls:
                first = stream.num_calls - len(calls)
                delta["tool_calls"] = [{"index": first + j, **c} for j, c in enumerate(calls)]
        has_calls = self.calls_tools and self.streams[k].num_calls > 0
        return {"delta": delta, "logprobs": self.logprobs.chat(new_entries(out)),
                "finish_reason": self.finish_reason(out, has_calls)}

    def usage(self, outs: list) -> dict:
        return usage(self.prompts, outs, self.n)


class ChatAPI(GenerationAPI):
    """The chat surface over an EngineClient."""

    kind, id_prefix, object_name, chunk_object = "chat", "chatcmpl", "chat.completion", "chat.completion.chunk"
    streams_role = True

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self.check_request(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tools and len(tools) > MAX_TOOLS:
            raise APIError(400, f"tools: at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
        asked = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
        choice = check_tool_request(tools, asked, self.tokenizer.hf.chat_template)
        calls_tools = choice != "none"
        template_kwargs = req.template_kwargs()
        prompt_ids = await asyncio.to_thread(lambda: self.tokenizer.apply_chat_template(
            chat_messages(req), add_generation_prompt=True, tools=tools if calls_tools else None,
            template_kwargs=template_kwargs))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context
            max_tokens = max(1, self.client.max_model_len - len(prompt_ids))
        forced = forced_call_grammar(tools, choice, req.parallel_tool_calls) if calls_tools else None
        params = req.to_sampling_params(max_tokens, forced=("tool_choice", forced) if forced is not None else None)
        shaper = ChatShaper([prompt_ids], params.n, calls_tools, self.logprobs)
        return await self.respond(req, request, [prompt_ids], params, shaper)
