"""OpenAI request shapes (pydantic). Types are checked here (422 when wrong); ranges
are checked by SamplingParams (400 naming the limit)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions, as vLLM names them
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=0)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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
