"""OpenAI request shapes (pydantic). Types are checked here (422 when wrong); ranges
are checked by SamplingParams (400 naming the limit), the one place the offline API
shares. The ranges are still published in the OpenAPI schema (``bounded``), so clients
and the schema fuzzer (tests/serve/test_fuzz.py) see every limit and reach it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fivefold.sampling_params import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, SEED_MAX, SEED_MIN


def bounded(default: Any, **schema: Any) -> Any:
    """A field whose JSON-schema bounds (``minimum``, ``maxItems``, ...) are documented, not
    enforced here: SamplingParams refuses a value outside them with a 400 naming the limit."""
    return Field(default, json_schema_extra=schema)


StopString = Annotated[str, Field(json_schema_extra={"minLength": 1, "maxLength": MAX_STOP_CHARS})]
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str, Field(json_schema_extra={"minLength": 1})] | \
        Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
    logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=0)
    max_completion_tokens: int | None = bounded(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body: one string, strings, one token-id list, or token-id lists."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class PromptVersionRequest(BaseModel):
    """``POST /admin/prompt-version``: the result cache's new prompt version."""

    model_config = ConfigDict(extra="forbid")

    version: str
