"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.engine.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob), ...]}


@dataclass
class RequestOutput:
    """The state of one request after a step; ``delta_*`` hold what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None  # queue_time, ttft, decode_time (seconds)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (no context)
    prompt_logprobs: list[dict | None] | None = None
