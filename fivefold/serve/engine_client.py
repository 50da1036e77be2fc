"""What the HTTP handlers need from an engine, as a protocol: :class:`EngineClient`.

The handlers (completions.py, chat.py, tokenization.py and their shared base, generation.py)
depend on this and nothing else of the engine: they never reach into an LLMEngine, its
scheduler or its KV cache. :class:`fivefold.serve.async_engine.AsyncEngine` implements it over
an LLMEngine run by its own thread; a test can serve a fake that implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from fivefold.engine.outputs import RequestOutput
    from fivefold.models.config import ModelConfig
    from fivefold.models.tokenizer import Tokenizer
    from fivefold.sampling_params import SamplingParams
    from fivefold.serve.metrics import ServerMetrics


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the server sees it.

    The life of a request: ``await admit(...)`` once (validation and a place in the queue, or the
    error that refuses it: InvalidRequestError, OverloadedError), then ``generate(...)`` for each
    of its choices; leaving a ``generate`` iteration early aborts that choice."""

    metrics: ServerMetrics | None  # the server's Prometheus metrics, kept by the engine's thread

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig:
        """The served model's configuration (vocab_size, ...)."""

    @property
    def model_path(self) -> Path:
        """Where the served weights were loaded from (their content names the model in cache keys)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""

    @property
    def max_num_seqs(self) -> int:
        """How many sequences the engine runs in one batch."""

    @property
    def is_running(self) -> bool:
        """Whether the engine can still serve (false after shutdown or a fatal error)."""

    async def admit(self, prompts: list[list[int]], params: SamplingParams, request_ids: list[list[str]]) -> None:
        """Validate a request once (every prompt with ``params``; off the event loop) and take its
        places in the queue, ``request_ids[p]`` for prompt p's choices: all of them, or none
        and the error that refuses it."""

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The outputs of one admitted choice (``params.n`` is 1), after every step that adds
        a token; leaving the iteration early aborts it."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict:
        """The engine's counters (as ``LLMEngine.stats()``)."""

    def shutdown(self, timeout: float = 5.0) -> None: ...
