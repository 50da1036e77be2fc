"""A request's state inside the engine: tokens, progress counters and KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fivefold.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fivefold.engine.structured_output import Grammar


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life; durations derive from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # one object per request: compared (and removed from queues) by identity
class Sequence:
    """One generation stream.

    Progress is counted, not flagged: each step computes
    ``num_tokens - num_computed_tokens`` tokens (or a chunk of them), so a
    prefill, a chunked prefill and a recompute after preemption are one mechanism.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (stop_reason: the message)
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_published_blocks: int = 0  # full blocks already inserted into the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_reserved_tokens: int = 0  # capacity reserved up front by the pre-allocation policy
    is_reservation_exceeded: bool = False
    metrics: "RequestMetrics" = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    _prompt_block_hashes: list[int] | None = field(default=None, repr=False)
    generator: torch.Generator | None = None
    logprobs: list[dict] = field(default_factory=list)
    # entries of prompt tokens 1.. (SamplingParams.prompt_logprobs), in order, each computed once
    prompt_logprobs: list[dict] = field(default_factory=list)
    grammar: "Grammar | None" = None  # SamplingParams.structured_outputs, compiled (structured_output.py)
    # Proposed continuation of token_ids (speculative decoding): computed this step after the last
    # token, verified against the target's logits, then dropped; never counted in num_tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    # tokens masked while fewer than params.min_tokens are out: EOS and stop_token_ids (the engine sets it)
    min_tokens_ban: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed % 2**64)  # torch takes uint64

    def prompt_block_hashes(self, block_size: int) -> list[int]:
        """Prefix hashes of the prompt's full blocks (computed once)."""
        if self._prompt_block_hashes is None:
            from fivefold.engine.prefix_cache import prefix_block_hashes

            self._prompt_block_hashes = prefix_block_hashes(self.prompt_token_ids, block_size)
        return self._prompt_block_hashes

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_scheduled_tokens_wanted(self) -> int:
        """Tokens a step would compute for this sequence: the uncomputed ones plus the proposals."""
        return self.num_uncomputed_tokens + len(self.spec_token_ids)

    @property
    def is_ready(self) -> bool:
        """Whether the sequence can run a step: no grammar, or its next mask is computed."""
        return self.grammar is None or self.grammar.has_mask

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
