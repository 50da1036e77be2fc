"""Structured output: each constrained request's grammar, and its token mask in the sampler.

The grammar engine is llguidance (PyPI, no dependencies). It was picked over xgrammar by
measurement on this CPU (`benchmarks/structured_output.py`: SmolLM2's 49,152-token vocabulary,
a nested JSON schema, 2 Zen 4 cores): per-token mask 62-162 us (median) against xgrammar
0.2.9's 208-216 us; schema compile 0.8-2 ms against 4.5-9.7 ms; and xgrammar pulls in triton
and apache-tvm-ffi. llguidance builds tables lazily, and a first mask can take ~2 s: the
server pays that at start (:meth:`GrammarCompiler.warm_up`).

Flow: the engine checks a request's :class:`StructuredOutputs` at ``add_request`` (a bad schema
or regex is refused there, by name) and hands its grammar to :class:`GrammarWorker`, whose
threads compile it and compute each next-token mask while the engine steps; a sequence whose
mask is not ready yet sits out the step (the engine waits a few milliseconds for it first), so a
costly grammar slows only its own request. Each step the sampler copies one bitmask row per
constrained sequence and masks the other tokens' logits to -inf, batched with unconstrained rows
(which are left alone); the engine feeds the sampled token back (:meth:`Grammar.advance`) and
stops the request when the grammar is complete.

One request's grammar can never stop the engine: llguidance's parser limits
(:data:`PARSER_LIMITS`) bound each piece of work, each request has a budget of grammar time
(``EngineConfig.grammar_budget_s``), and any failure (a limit, the budget, a token refused)
ends that request alone with ``finish_reason="error"`` and a message naming the cause.
"""

from __future__ import annotations

import json
import os
import threading
import time

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


# llguidance's parser limits, set deliberately (its defaults let one mask of an ambiguous grammar run
# for seconds): the Earley items of one mask step (~20k/ms) and of one row, the lexer's fuel, the
# grammar's size. A grammar past a limit fails with llguidance's message naming it.
PARSER_LIMITS = dict(step_max_items=20_000, max_items_in_row=2_000, initial_lexer_fuel=1_000_000,
                     step_lexer_fuel=200_000, max_lexer_states=100_000, max_grammar_size=200_000,
                     verbose_errors=False)
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (objects and arrays); deeper ones are refused by name
NUM_GRAMMAR_THREADS = 4
GRAMMAR_THREAD_NICENESS = 10  # grammar work yields the cores to the model's threads


class Grammar:
    """One request's grammar state, worked on by :class:`GrammarWorker`'s threads, never the engine's.

    The engine asks for the next token's mask with :meth:`start` (compile and first mask) and
    :meth:`advance` (take the sampled token, then compute the next mask); both return at once.
    Until the work is done the grammar is not :attr:`is_ready` and the scheduler leaves its
    sequence out of the batch, so a slow grammar delays its own request only. ``error`` is set
    (and stays) when llguidance reports one, or when the request's grammar work exceeds
    ``budget_s`` seconds (CPU time in the worker, or wall time of one unfinished piece of work).
    """

    def __init__(self, compiler: "GrammarCompiler", grammar_text: str, kind: str, budget_s: float) -> None:
        self._compiler, self._text, self.kind, self.budget_s = compiler, grammar_text, kind, budget_s
        self._matcher = None
        self._mask = compiler.allocate_mask(1)
        self._done = threading.Event()
        self._done.set()
        self._started_at: float | None = None  # when the unfinished piece of work was submitted
        self.cpu_seconds = 0.0
        self.error: str | None = None
        self.is_complete = False  # the grammar accepts no further token: the request is done

    # -- called by the engine thread ---------------------------------------------------------
    def start(self) -> None:
        """Compile and compute the first mask in the background."""
        self._submit(None)

    def advance(self, token_id: int) -> None:
        """Take the sampled token (one the mask allowed) and compute the next mask, in the background."""
        self._submit(token_id)

    @property
    def is_ready(self) -> bool:
        """The mask for the next token is there, or the grammar is finished (complete or failed)."""
        self._check_overdue()
        return self._done.is_set() or self.error is not None

    @property
    def has_mask(self) -> bool:
        """The next token's mask is computed and the grammar is neither complete nor failed."""
        return self._done.is_set() and self.error is None and not self.is_complete

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :attr:`is_ready`."""
        self._done.wait(max(0.0, timeout))
        return self.is_ready

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Copy the allowed next tokens into ``bitmask[row]`` (int32 words, bit t = token t)."""
        bitmask[row].copy_(self._mask[0])

    def _check_overdue(self) -> None:
        started = self._started_at
        if self.error is None and not self._done.is_set() and started is not None \
                and time.monotonic() - started > self.budget_s:
            self.error = self._budget_message()

    def _budget_message(self) -> str:
        return (f"the {self.kind} constraint exceeded its budget of {self.budget_s:g} s of grammar work (compile and "
                f"token masks); simplify the grammar (less ambiguity, fewer short alternatives)")

    def _submit(self, token_id: int | None) -> None:
        if self.error is not None:
            return
        self._done.clear()
        self._started_at = time.monotonic()
        self._compiler.worker.submit(self._work, token_id)

    # -- called by a worker thread -----------------------------------------------------------
    def _work(self, token_id: int | None) -> None:
        llg = _llguidance()
        began = time.thread_time()
        try:
            if self._matcher is None:
                self._matcher = llg.LLMatcher(self._compiler.llg_tokenizer, self._text, log_level=0,
                                              limits=llg.LLParserLimits(**PARSER_LIMITS))
            matcher = self._matcher
            if token_id is not None and not matcher.is_error() and not matcher.consume_token(token_id):
                self._fail(f"the grammar refused token {token_id}: {matcher.get_error().strip()[:300]}")
            elif not matcher.is_error():
                if matcher.is_stopped():
                    self.is_complete = True
                else:
                    llg.torch.fill_next_token_bitmask(matcher, self._mask, 0)
            if matcher.is_error():
                self._fail(f"the {self.kind} constraint failed: {matcher.get_error().strip()[:300]}")
        except Exception as exc:  # llguidance refusing at the API level: this request's failure only
            self._fail(f"the {self.kind} constraint failed: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.cpu_seconds += time.thread_time() - began
            if self.error is None and self.cpu_seconds > self.budget_s:
                self.error = self._budget_message()
            self._started_at = None
            self._done.set()

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message


class GrammarWorker:
    """A few threads, below the model's in priority, that do every request's grammar work.

    llguidance drops the GIL while it compiles and computes masks, so this work runs beside the
    engine's step instead of inside it; a grammar whose mask takes seconds holds one of these
    threads, not the engine. The threads' nice value is raised (Linux, best effort) so that the
    model's threads keep the cores when both want them."""

    def __init__(self, num_threads: int = NUM_GRAMMAR_THREADS) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="fivefold-grammar",
                                        initializer=self._lower_priority)

    @staticmethod
    def _lower_priority() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_THREAD_NICENESS)
        except (AttributeError, OSError):  # not Linux, or not allowed: same priority as the model
            pass

    def submit(self, fn, *args) -> None:
        self._pool.submit(fn, *args)


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
        self.worker = GrammarWorker()

    @property
    def llg_tokenizer(self):
        return self._tokenizer

    def warm_up(self) -> None:
        """Pay llguidance's one-time first mask for this tokenizer now, not in a request."""
        with self._lock:
            if not self._is_warm:
                grammar = self.compile(StructuredOutputs(json_object=True), budget_s=600.0)
                grammar.start()
                grammar.wait(600.0)
                self._is_warm = True

    def grammar_text(self, spec: StructuredOutputs) -> str:
        """llguidance's grammar for ``spec`` (its own JSON form)."""
        llg = _llguidance()
        defaults = {"whitespace_flexible": spec.whitespace_flexible}
        kind = spec.kind
        try:
            if kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(json_schema_text(spec.json), defaults=defaults)
            if kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=defaults)
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "grammar":
                return llg.LLMatcher.grammar_from_lark(spec.grammar)
            # choice: a Lark rule of string literals (JSON escapes are Lark's), not a regex to escape
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        except InvalidRequestError:
            raise
        except Exception as exc:  # llguidance's converters raise ValueError (or panic) on what they refuse
            raise InvalidRequestError(f"the {kind} constraint does not compile: {str(exc).strip()[:300]}") from None

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidRequestError naming the problem if ``spec`` does not compile."""
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(self.grammar_text(spec), self._tokenizer,
                                               limits=llg.LLParserLimits(**PARSER_LIMITS))
        if error:
            raise InvalidRequestError(f"the {spec.kind} constraint does not compile: {error.strip()[:300]}")

    def compile(self, spec: StructuredOutputs, budget_s: float) -> Grammar:
        """A grammar for ``spec`` (InvalidRequestError if its text cannot be built); the matcher is made,
        and the first mask computed, in the background once :meth:`Grammar.start` is called."""
        return Grammar(self, self.grammar_text(spec), spec.kind, budget_s)

    def allocate_mask(self, num_rows: int) -> torch.Tensor:
        return _llguidance().torch.allocate_token_bitmask(num_rows, self.vocab_size)


def json_schema_text(schema: str) -> str:
    """A JSON schema's text, checked: valid JSON, an object, at most
    :data:`MAX_SCHEMA_DEPTH` levels of objects and arrays. InvalidRequestError names the problem."""
    depth, deepest, in_string, escaped = 0, 0, False, False
    for ch in schema:  # the depth first, without recursion: json.loads would raise RecursionError
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        elif ch in "]}":
            depth -= 1
    try:
        parsed = json.loads(schema)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"a JSON schema must be an object, got {type(parsed).__name__} {schema[:40]!r}")
    return json.dumps(parsed)


def apply_grammar_masks(logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar forbids; rows
    whose grammar is None are left as they are. Each grammar's mask is already computed (the
    scheduler runs only ready grammars)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    llg = _llguidance()
    bitmask = llg.torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        grammars[i].fill_mask(bitmask, j)
    constrained = logits[rows]
    llg.torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits[rows] = constrained
