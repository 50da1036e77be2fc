"""Structured output: each constrained request's grammar, and its token mask in the sampler.

The grammar engine is llguidance (PyPI, no dependencies). It was picked over xgrammar by
measurement on this CPU (`benchmarks/structured_output.py`: SmolLM2's 49,152-token vocabulary,
a nested JSON schema, 2 Zen 4 cores): per-token mask 62-162 us (median) against xgrammar
0.2.9's 208-216 us; schema compile 0.8-2 ms against 4.5-9.7 ms; and xgrammar pulls in triton
and apache-tvm-ffi. llguidance builds tables lazily, and a first mask can take ~2 s: the
server pays that at start (:meth:`GrammarCompiler.warm_up`).

Flow: the engine compiles a request's :class:`StructuredOutputs` into a matcher at
``add_request`` (a bad schema or regex is refused there, by name); each step the sampler fills
one bitmask row per constrained sequence and masks the other tokens' logits to -inf, batched
with unconstrained rows (which are left alone); the engine feeds the sampled token back
(:meth:`Grammar.advance`) and stops the request when the grammar is complete.
"""

from __future__ import annotations

import json
import threading

import torch

from fivefold.errors import InvalidRequestError
from fivefold.sampling_params import StructuredOutputs


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:  # a declared dependency; missing only in a hand-made environment
        raise InvalidRequestError("structured output needs llguidance (pip install llguidance)") from None
    return llguidance


class Grammar:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit t = token t)."""
        _llguidance().torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def advance(self, token_id: int) -> None:
        """Take the sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """The grammar accepts no further token: the request is done."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer; owns llguidance's view of it."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        llg = _llguidance()
        try:
            # n_vocab is the model's: the mask covers every logit column, padding ids included.
            self._tokenizer = llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                    eos_token=list(eos_token_ids) or None)
        except (ValueError, TypeError) as exc:  # e.g. a word-level tokenizer: no byte decoding to match against
            raise InvalidRequestError(f"structured output is not available for this model's tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self._lock = threading.Lock()  # the server validates on its event loop while the engine steps
        self._is_warm = False

    def warm_up(self) -> None:
        """Pay llguidance's one-time first mask for this tokenizer now, not in a request."""
        with self._lock:
            if not self._is_warm:
                grammar = self.compile(StructuredOutputs(json_object=True))
                grammar.fill_mask(self.allocate_mask(1), 0)
                self._is_warm = True

    def grammar_text(self, spec: StructuredOutputs) -> str:
        """llguidance's grammar for ``spec`` (its own JSON form)."""
        llg = _llguidance()
        defaults = {"whitespace_flexible": spec.whitespace_flexible}
        kind = spec.kind
        if kind == "json":
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=defaults)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "grammar":
            return llg.LLMatcher.grammar_from_lark(spec.grammar)
        # choice: a Lark rule of string literals (JSON escapes are Lark's), not a regex to escape
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidRequestError naming the problem if ``spec`` does not compile."""
        error = _llguidance().LLMatcher.validate_grammar(self.grammar_text(spec), self._tokenizer)
        if error:
            raise InvalidRequestError(f"the {spec.kind} constraint does not compile: {error.strip()[:300]}")

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for ``spec`` (InvalidRequestError if it does not compile)."""
        matcher = _llguidance().LLMatcher(self._tokenizer, self.grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {spec.kind} constraint does not compile: {matcher.get_error().strip()[:300]}")
        return Grammar(matcher)

    def allocate_mask(self, num_rows: int) -> torch.Tensor:
        return _llguidance().torch.allocate_token_bitmask(num_rows, self.vocab_size)


def apply_grammar_masks(logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar forbids; rows
    whose grammar is None are left as they are."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    llg = _llguidance()
    bitmask = llg.torch.allocate_token_bitmask(len(rows), logits.shape[1])
    # One row after another: llguidance's parallel fill (its own thread pool) measured slower here,
    # 2.5 ms against 1.4 ms for 8 rows, its threads contending with torch's on 2 cores.
    for j, i in enumerate(rows):
        grammars[i].fill_mask(bitmask, j)
    constrained = logits[rows]
    llg.torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits[rows] = constrained
