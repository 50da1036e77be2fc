"""Tool calling: the chat template's tool-call format, its parser (whole and streamed), and the
grammar that forces a call when ``tool_choice`` asks for one.

The format is chosen by the model's chat template, as vLLM's ``--tool-call-parser`` is: a
template that writes ``<tool_call>`` (Qwen2/2.5/3, Hermes, and the like) gets the Hermes
format, one JSON object per call between the tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``: ``"none"`` (the tools are not rendered, nothing is parsed); ``"auto"`` (the model
decides; calls found in its text are returned as ``tool_calls``, the rest as content);
``"required"`` (at least one call, forced by a grammar over the tools' schemas); a named function
(exactly that call, forced the same way). A template that does not render tools gets a 400
naming the problem, rather than tools the model never sees.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from fivefold.engine.stop_strings import stop_prefix_len
from fivefold.errors import InvalidRequestError
from fivefold.sampling_params import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes tool definitions and Hermes-style calls."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def _call(name: str, arguments) -> dict:
    """One call in OpenAI's shape (arguments as JSON text, as OpenAI sends them)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _parse_block(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _call(value["name"], value.get("arguments", value.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished answer. Without calls the text is the content, as
    is; with calls, the text outside them, trailing whitespace dropped (None if nothing else is
    left). A block that is not a JSON object with a ``name`` (or is unterminated) stays in the
    content, as vLLM's Hermes parser leaves it."""
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1))
        if call is not None:
            kept.append(text[last:match.start()])
            last = match.end()
            calls.append(call)
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).rstrip()
    return (content if content.strip() else None), calls


@dataclass
class ToolCallStream:
    """Splits a streamed answer into content deltas and completed calls, so that what a client
    accumulates equals :func:`parse_tool_calls` of the whole answer.

    Text that could be the start of ``<tool_call>`` is held back until it is known not to be, and
    whitespace until text follows it; a call is emitted whole (id, name and all its arguments in
    one delta) when its closing tag arrives, which OpenAI's streaming clients accumulate like any
    other delta."""

    pending: str = ""  # not yet known to be content or a call
    whitespace: str = ""  # content that is whitespace so far, held until text follows it
    num_calls: int = 0

    def feed(self, delta: str, is_final: bool = False) -> tuple[str, list[dict]]:
        """(content to emit now, calls completed now)."""
        self.pending += delta
        content, calls = [], []
        while True:
            start = self.pending.find(OPEN)
            end = self.pending.find(CLOSE, start) if start >= 0 else -1
            if start < 0 or end < 0:
                if is_final:  # no call, or an unterminated one, which was text after all
                    keep = 0
                elif start >= 0:
                    keep = len(self.pending) - start
                else:
                    keep = stop_prefix_len(self.pending, (OPEN,))
                content.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            block_end = end + len(CLOSE)
            call = _parse_block(self.pending[start + len(OPEN):end].strip())
            content.append(self.pending[:block_end] if call is None else self.pending[:start])
            if call is not None:
                calls.append(call)
            self.pending = self.pending[block_end:]
        self.num_calls += len(calls)
        text = self.whitespace + "".join(content)
        if text.strip():  # trailing whitespace waits for what follows it
            stripped = text.rstrip()
            text, self.whitespace = stripped, text[len(stripped):]
        else:
            text, self.whitespace = "", text
        if is_final and self.num_calls == 0:
            text, self.whitespace = text + self.whitespace, ""
        return text, calls


def forced_call_grammar(tools: list[dict], tool_choice, parallel: bool) -> StructuredOutputs | None:
    """The grammar of the answer ``tool_choice`` forces (None for auto and none): Hermes blocks
    whose JSON is ``{"name": <one of the tools>, "arguments": <its parameters schema>}``, written
    compactly; one call, or one or more for ``"required"`` with parallel calls allowed."""
    if tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
    else:
        chosen = tools
    alternatives = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    repeat = ' ("\\n" call)*' if parallel and not isinstance(tool_choice, dict) else ""
    lark = (f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN + chr(10))} args {json.dumps(chr(10) + CLOSE)}\n"
            f"args: %json {json.dumps(schema)}")
    return StructuredOutputs(grammar=lark)


def template_tool_call(call: dict, where: str = "tool_calls[0]") -> dict:
    """An assistant turn's tool call as chat templates take it: OpenAI sends ``arguments`` as JSON
    text, templates (Qwen's among them) expect a mapping, so valid JSON is parsed (vLLM does too).
    InvalidRequestError naming ``where`` when ``function`` is not an object with a string name."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function must be an object {{'name': str, 'arguments': str}}, got "
                                  f"{json.dumps(function)[:60]}")
    function = dict(function)
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def check_tool_request(tools: list[dict] | None, tool_choice, chat_template: str | None) -> str | dict:
    """The effective tool_choice ("none", "auto", "required" or the named-function dict), or
    InvalidRequestError naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools: the request has none")
        return "none"
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: function names must be unique, got {names}")
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise InvalidRequestError(f"tool_choice names function '{choice['function']['name']}', which is not among "
                                  f"the tools {names}")
    if choice != "none" and not template_renders_tools(chat_template):
        raise InvalidRequestError("this model's chat template does not render tools (no <tool_call> format in it): "
                                  "tool calling needs a model whose template supports tools")
    return choice
