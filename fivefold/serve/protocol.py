"""OpenAI request shapes (pydantic). Types are checked here (422 when wrong); ranges
are checked by SamplingParams (400 naming the limit), the one place the offline API
shares. The ranges are still published in the OpenAPI schema (``bounded``), so clients
and the schema fuzzer (tests/serve/test_fuzz.py) see every limit and reach it.

No field is dropped silently: the models keep unknown fields (``extra="allow"``) and
:func:`unsupported_fields` names every one that is set, with the reason when it is an
OpenAI or vLLM field this server does not implement (the server answers 400). The table of
fields and what happens to each is in the README ("OpenAI API coverage")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fivefold.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    StructuredOutputs,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)


def bounded(default: Any, **schema: Any) -> Any:
    """A field whose JSON-schema bounds (``minimum``, ``maxItems``, ...) are documented, not
    enforced here: SamplingParams refuses a value outside them with a 400 naming the limit."""
    return Field(default, json_schema_extra=schema)


StopString = Annotated[str, Field(json_schema_extra={"minLength": 1, "maxLength": MAX_STOP_CHARS})]
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


# OpenAI and vLLM request fields that are refused when set (not None, not empty), with why.
REFUSED_FIELDS = {
    "suffix": "suffix (fill-in-the-middle insertion) is not supported",
    "functions": "functions is deprecated by OpenAI; send tools",
    "function_call": "function_call is deprecated by OpenAI; send tool_choice",
    "audio": "audio output is not supported: the served model is text-only",
    "modalities": "modalities is not supported: the served model answers in text only",
    "prediction": "prediction (predicted outputs) is not supported",
    "web_search_options": "web_search_options is not supported",
    "reasoning_effort": "reasoning_effort is not supported: the served model has no reasoning mode",
    "store": "store is not supported: completions are not stored",
    "metadata": "metadata is only used with store, which is not supported",
    "service_tier": "service_tier is not supported",
    "top_a": "top_a is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "guided_decoding_backend": "guided_decoding_backend is not selectable: the server has one grammar engine",
    "chat_template": "a request's own chat_template is not accepted: the model's template is used",
    "documents": "documents is not supported",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported: the served model is text-only",
    "priority": "priority is not supported: requests are served first come, first served",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported; use logit_bias",
    "bad_words": "bad_words is not supported; use logit_bias",
    "lora_request": "LoRA adapters are not supported",
    "kv_transfer_params": "kv_transfer_params is not supported",
    "prompt_logprobs": "prompt_logprobs is not a server field here: send echo with logprobs for the prompt's logprobs",
}


def unsupported_fields(req: BaseModel) -> tuple[str, str] | None:
    """(field, message) of the first field set in ``req`` that the server does not implement,
    or None. Unknown fields get OpenAI's own message."""
    for name, value in (req.model_extra or {}).items():
        if value is None or (isinstance(value, (list, dict, str)) and not value):
            continue  # clients send unused fields as null (or empty): nothing is asked of us
        if name in REFUSED_FIELDS:
            return name, REFUSED_FIELDS[name]
        return name, f"Unrecognized request argument supplied: {name}"
    return None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema with {"name", "schema", "strict"}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingFields(BaseModel):
    # Unknown fields are kept, so that unsupported_fields can name them (a 400), not dropped.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = bounded(None, minimum=1)
    temperature: float = bounded(1.0, minimum=0, maximum=2)
    top_p: float = bounded(1.0, exclusiveMinimum=0, maximum=1)
    n: int = bounded(1, minimum=1, maximum=16)
    stop: StopString | Annotated[list[StopString], Field(json_schema_extra={"maxItems": MAX_STOP_STRINGS})] | None = None
    seed: int | None = bounded(None, minimum=SEED_MIN, maximum=SEED_MAX)
    presence_penalty: float = bounded(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = bounded(0.0, minimum=-2, maximum=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions, as vLLM names them
    top_k: int = bounded(0, minimum=-1)
    min_p: float = bounded(0.0, minimum=0, maximum=1)
    repetition_penalty: float = bounded(1.0, exclusiveMinimum=0, maximum=2)
    ignore_eos: bool = False
    min_tokens: int = bounded(0, minimum=0)  # vLLM's: EOS and stop_token_ids masked until then
    logit_bias: dict[str, float] | None = bounded(None, maxProperties=MAX_LOGIT_BIAS_TOKENS)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = bounded(None, minimum=1, maximum=16)
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, as vLLM's llguidance backend takes it
    structured_outputs: dict[str, Any] | None = None

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                         forced: tuple[str, StructuredOutputs] | None = None) -> SamplingParams:
        """The SamplingParams of these fields (raises InvalidRequestError naming a value out of range)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop or (), ignore_eos=self.ignore_eos,
            logprobs=logprobs, n=self.n, logit_bias=self.logit_bias or (), stop_token_ids=self.stop_token_ids or (),
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs_of(self, forced),
            min_tokens=self.min_tokens,
        )


PromptText = Annotated[str, Field(json_schema_extra={"minLength": 1})]
PromptTokens = Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
MAX_PROMPTS = 64  # prompts in one completions request (each runs n choices)


class CompletionRequest(_SamplingFields):
    # One prompt, or a batch of them (OpenAI's four forms: text, texts, token ids, token-id lists).
    prompt: PromptText | PromptTokens | \
        Annotated[list[PromptText], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_PROMPTS})] | \
        Annotated[list[PromptTokens], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_PROMPTS})]
    logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = False
    # max_tokens 0 is accepted with echo (score a prompt: its logprobs, no new tokens), as OpenAI does.
    max_tokens: int | None = bounded(None, minimum=0)

    @property
    def is_scoring(self) -> bool:
        """max_tokens 0: the prompt is scored (its logprobs), nothing generated; valid only with echo."""
        return self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """The engine's parameters of this request: max_tokens 16 when not given; a scored prompt
        runs one token (the engine always samples one; the answer drops it); echo with logprobs
        asks for the prompt's logprobs too."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self._sampling_params(1 if self.is_scoring else max_tokens, self.logprobs,
                                     prompt_logprobs=self.logprobs if self.echo else None)


class ChatMessage(BaseModel):
    """One turn. ``content`` is a string, a list of parts (``{"type": "text", "text": ...}``; other
    part types are refused by name), or null on an assistant turn that carries ``tool_calls``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
# what the server passes the template itself: a request cannot override it
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                         "chat_template", "continue_final_message", "return_dict"})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=0)
    tools: Annotated[list[Tool], Field(json_schema_extra={"maxItems": MAX_TOOLS})] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = bounded(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    # extra variables for the chat template (vLLM's; e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = bounded(None, maxProperties=MAX_TEMPLATE_KWARGS)

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, checked: at most MAX_TEMPLATE_KWARGS names, none of the variables
        the server sets itself (400 naming it)."""
        from fivefold.errors import InvalidRequestError

        kwargs = self.chat_template_kwargs or {}
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} names, got {len(kwargs)}")
        taken = sorted(set(kwargs) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs: {taken[0]} is set by the server, not by the request")
        return kwargs

    def to_sampling_params(self, max_tokens: int,
                           forced: tuple[str, StructuredOutputs] | None = None) -> SamplingParams:
        """The engine's parameters of this request, with ``max_tokens`` (the caller's: it defaults
        to the rest of the context after the rendered prompt) and ``forced``, the (field, grammar)
        of a tool call that tool_choice forces."""
        top = self.top_logprobs if self.top_logprobs is not None else 0
        return self._sampling_params(max_tokens, top if self.logprobs else None, forced=forced)


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body: one string, strings, one token-id list, or token-id lists."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: cut each input to this many tokens instead of refusing it (-1: the model's limit)
    truncate_prompt_tokens: int | None = None


class EmbedRequest(BaseModel):
    """TEI's ``POST /embed`` body: ``inputs`` (a string or strings), ``truncate`` (cut inputs
    over the model's limit instead of a 413/400), ``normalize`` (L2, default true)."""

    model_config = ConfigDict(extra="forbid")

    inputs: str | list[str]
    truncate: bool = False
    truncation_direction: Literal["Right", "right"] = "Right"
    normalize: bool = True


class PromptVersionRequest(BaseModel):
    """``POST /admin/prompt-version``: the result cache's new prompt version."""

    model_config = ConfigDict(extra="forbid")

    version: str


IMAGE_PART_TYPES = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file")


def message_text(message: ChatMessage) -> str | None:
    """The text of a message's content: a string as is; text parts joined by newlines (vLLM's
    rule); None for null content. Raises InvalidRequestError for any other part type."""
    from fivefold.errors import InvalidRequestError

    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in IMAGE_PART_TYPES:
            raise InvalidRequestError(f"messages: content part {i} is of type '{kind}': the served model takes "
                                      "text only (parts of type 'text')")
        else:
            raise InvalidRequestError(f"messages: content part {i} must be {{'type': 'text', 'text': str}}, "
                                      f"got type {kind!r}")
    return "\n".join(texts)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


def structured_outputs_of(req, forced: tuple[str, StructuredOutputs] | None = None) -> StructuredOutputs | None:
    """The output constraint a request asks for, from whichever of OpenAI's ``response_format``
    and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
    ``structured_outputs`` it uses, or ``forced`` ((field, grammar): a tool call that tool_choice
    forces); at most one. Raises InvalidRequestError naming the field when malformed."""
    from fivefold.errors import InvalidRequestError

    asked = [forced] if forced is not None else []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputs(json_object=True)))
        else:
            schema = (fmt.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format: type json_schema needs json_schema.schema, a JSON schema "
                                          "object")
            asked.append(("response_format", StructuredOutputs(json=schema)))
    if req.guided_json is not None:
        asked.append(("guided_json", StructuredOutputs(json=req.guided_json)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutputs(regex=req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutputs(choice=tuple(req.guided_choice))))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", StructuredOutputs(grammar=req.guided_grammar)))
    if req.structured_outputs:
        known = {"json", "json_object", "regex", "choice", "grammar", "whitespace_flexible"}
        unknown = sorted(set(req.structured_outputs) - known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unsupported key(s) {unknown}; supported: {sorted(known)}")
        try:
            asked.append(("structured_outputs", StructuredOutputs(**req.structured_outputs)))
        except TypeError as exc:
            raise InvalidRequestError(f"structured_outputs: {exc}") from None
    if len(asked) > 1:
        raise InvalidRequestError(f"ask for one output constraint, not {len(asked)}: {[name for name, _ in asked]}")
    if not asked:
        return None
    name, spec = asked[0]
    if spec.json is not None:  # a scalar, an array or a schema nested too deep: refused here, naming the field
        from fivefold.engine.structured_output import json_schema_text

        try:
            json_schema_text(spec.json)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{name}: {exc}") from None
    return spec
