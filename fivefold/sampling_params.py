"""Per-request sampling parameters (the OpenAI set plus vLLM's usual extensions)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fivefold.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # bounds the per-token scan for a stop string (and its held-back prefix)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024

GREEDY_TEMPERATURE = 1e-5  # below it, sampling is greedy (see SamplingParams.is_greedy)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64


def wrap_seed(seed: int) -> int:
    """``seed`` wrapped into the int64 range (choice i of a request is seeded with seed + i)."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


MAX_CHOICES = 256  # alternatives of a structured_outputs choice


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain a request's output to a grammar (vLLM's ``StructuredOutputsParams``): exactly one
    of ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of the given strings) or ``grammar`` (Lark syntax, llguidance's
    dialect: rules, string literals, regexes, ``%json {schema}``). JSON is written compactly (no whitespace
    between tokens) unless ``whitespace_flexible``: a model may then pad with whitespace until it
    runs out of tokens. The grammar engine is fivefold/engine/structured_output.py."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [name for name, on in (("json", self.json is not None), ("json_object", self.json_object),
                                       ("regex", self.regex is not None), ("choice", self.choice is not None),
                                       ("grammar", self.grammar is not None)) if on]
        if len(given) != 1:
            raise InvalidRequestError(f"structured outputs take exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {given or 'none'}")
        if isinstance(self.json, dict):  # stored as text, so the params stay hashable; key order is kept,
            object.__setattr__(self, "json", json.dumps(self.json))  # since properties are written in it
        if self.json is not None and not isinstance(self.json, str):
            raise InvalidRequestError(f"a json schema must be an object or its JSON text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or len(choice) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError(f"choice must be 1-{MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", choice)

    @property
    def kind(self) -> str:
        """Which constraint: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or under 1e-5) means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    repetition_penalty follows the CTRL/transformers rule over prompt and output;
    presence/frequency penalties follow OpenAI's, over the output only. ``logprobs``
    asks for the sampled token's log-probability plus the top N (from the model's
    raw distribution, before temperature and penalties, as vLLM does by default).
    ``prompt_logprobs`` asks for the same of every prompt token after the first (vLLM's field;
    the first has no context and gets None); such a request skips the prefix cache, since
    tokens served from it are never run through the model. ``logit_bias`` maps token ids to
    values in [-100, 100] added to the logits before anything else (OpenAI's rule); a dict is
    accepted and stored as sorted (id, bias) pairs so the params stay hashable.
    ``structured_outputs`` constrains the output to a grammar (:class:`StructuredOutputs`); the
    request stops when the grammar is complete. ``min_tokens`` (vLLM's): until that many tokens
    are out, EOS and ``stop_token_ids`` are masked from sampling and stop strings do not end the
    request (``max_tokens`` and a complete grammar still do).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"),
            (0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 to disable), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
             f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}"),
            (all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
             f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias keys must be token ids >= 0"),
            (len(self.stop) <= MAX_STOP_STRINGS and all(self.stop),
             f"stop must be at most {MAX_STOP_STRINGS} non-empty strings"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"each stop string must be at most {MAX_STOP_CHARS} characters"),
            (1 <= self.n <= 16, f"n must be in [1, 16], got {self.n}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer), got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE: dividing logits by a temperature that
        small overflows float32, and the distribution is argmax to within rounding (vLLM's rule)."""
        return self.temperature < GREEDY_TEMPERATURE

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise InvalidRequestError if a token id the params name is outside [0, vocab_size)."""
        for what, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{what} names token id {bad}, outside the vocabulary [0, {vocab_size})")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict (keys may be strings of digits,
    as JSON sends them) or pairs."""
    items = bias.items() if isinstance(bias, dict) else (bias or ())
    pairs = []
    for key, value in items:
        try:
            token = int(key)
            value = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {key!r}: {value!r}") from None
        if isinstance(key, bool) or not (isinstance(key, int) or str(key).strip().lstrip("-").isdigit()):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}")
        pairs.append((token, value))
    return tuple(sorted(pairs))
