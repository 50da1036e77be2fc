"""The engine: a step is schedule, run the model, commit the computed tokens, sample, check stops.

Synchronous and single-threaded; the async server wraps it.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.detokenizer import IncrementalDetokenizer
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.model_runner import ModelRunner
from fivefold.engine.outputs import CompletionOutput, RequestOutput
from fivefold.engine.sampler import Sampler
from fivefold.engine.scheduler import Scheduler
from fivefold.engine.sequence import Sequence
from fivefold.engine.stop_strings import StopStringTracker, stop_prefix_len  # noqa: F401 (re-exported)
from fivefold.engine.speculative import SpeculativeStats, can_speculate, make_proposer, num_proposals_allowed, verify
from fivefold.engine.structured_output import GrammarCompiler
from fivefold.errors import FivefoldError, InvalidRequestError
from fivefold.models.loader import LoadedModel
from fivefold.sampling_params import SamplingParams


# How long a step waits, in all, for grammar masks still being computed before it leaves their
# sequences out: ordinary masks take 0.1-2 ms, so they make the step; a costly grammar does not hold
# the other requests back by more than this.
GRAMMAR_WAIT_S = 0.005


@dataclass
class _RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    prompt: str | None
    stops: StopStringTracker
    text: str = ""
    num_emitted_chars: int = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft: LoadedModel | None = None) -> None:
        """``draft``: the draft model of ``speculative="draft"`` when it is already loaded (else
        ``config.draft_model`` is loaded)."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(self.config.max_model_len or loaded.config.max_model_len, loaded.config.max_model_len)
        self.runner = ModelRunner(loaded.model, self.config)
        self._fit_context_to_pool()
        self.kv_cache = KVCacheManager(self.runner.num_blocks, self.config.block_size,
                                       self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_cache, self.max_model_len)
        self.sampler = Sampler()
        self.proposer = make_proposer(self.config, draft, self.runner.num_blocks, loaded.config.vocab_size,
                                      loaded.model.dtype)
        self.spec_stats = SpeculativeStats()
        self.requests: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None

    def _fit_context_to_pool(self) -> None:
        """The longest context is what the KV pool holds for one sequence: a model's own limit (128K
        tokens for Llama 3) beyond the pool is clipped with a one-line note, as vLLM does; an explicit
        ``max_model_len`` beyond it is refused, naming both sizes and the options."""
        pool_tokens = self.runner.num_blocks * self.config.block_size
        if self.max_model_len <= pool_tokens:
            return
        pool = f"the KV pool ({self.runner.num_blocks} blocks of {self.config.block_size} tokens, " \
               f"{self.config.kv_cache_bytes() / 1e9:.2f} GB)"
        if self.config.max_model_len is not None:
            raise FivefoldError(f"max_model_len {self.max_model_len} is more than {pool} holds for one sequence "
                                f"({pool_tokens} tokens): lower --max-model-len or raise --kv-cache-memory-bytes")
        warnings.warn(f"fivefold: max_model_len clipped from the model's {self.max_model_len} to {pool_tokens} tokens, "
                      f"what {pool} holds for one sequence (--kv-cache-memory-bytes for more)", stacklevel=3)
        self.max_model_len = pool_tokens

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        validated: bool = False,
    ) -> str:
        """Queue a request. ``prompt`` takes vLLM's forms: text, token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}``. Raises InvalidRequestError if it is none of them, or can
        never run. ``validated``: the caller (the server's admission) already ran :meth:`validate`
        and :meth:`check_prompt_ids` on these token ids with these params (n = 1), so they are
        taken as given instead of checked twice."""
        params = params or SamplingParams()
        if validated:
            text, token_ids = None, list(prompt)
        else:
            if params.n != 1:
                raise InvalidRequestError(f"n={params.n} is not supported by the engine; send n separate requests")
            text, token_ids = self._prompt_tokens(prompt)
            self.validate(len(token_ids), params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        seq = Sequence(request_id, token_ids, params)
        if params.min_tokens:
            seq.min_tokens_ban = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(params.stop_token_ids)))
        if params.structured_outputs is not None:
            seq.grammar = self.grammar_compiler.compile(params.structured_outputs, self.config.grammar_budget_s)
            seq.grammar.start()
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, token_ids)
        self.requests[request_id] = _RequestState(seq, detokenizer, text, StopStringTracker(params.stop))
        self.scheduler.add(seq)
        return request_id

    def _prompt_tokens(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt in any of vLLM's forms, each id checked."""
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            elif keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
                prompt = prompt["prompt_token_ids"]
            else:
                raise InvalidRequestError(
                    f"a prompt dict must be {{'prompt': str}} or {{'prompt_token_ids': list[int]}}; got keys "
                    f"{sorted(map(str, keys))}")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise InvalidRequestError(
                f"a prompt must be a str, a list of token ids, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}; "
                f"got {type(prompt).__name__}")
        self.check_prompt_ids(prompt)
        return None, list(prompt)

    def check_prompt_ids(self, token_ids) -> None:
        """Raise InvalidRequestError naming the first prompt token id outside the vocabulary."""
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise InvalidRequestError if a request can never run: token ids its params name outside
        the vocabulary, or a prompt + max_tokens that cannot fit the context or the KV pool."""
        params.check_token_ids(self.loaded.config.vocab_size)
        self.validate_lengths(num_prompt_tokens, params.max_tokens)
        if params.structured_outputs is not None:
            self.grammar_compiler.check(params.structured_outputs)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (made at first use; the server
        makes it at start, see :meth:`warm_up_structured_output`)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer.hf, self.loaded.config.vocab_size,
                                                     self.tokenizer.eos_token_ids)
        return self._grammar_compiler

    def warm_up_structured_output(self) -> bool:
        """Build the grammar engine's tables for this tokenizer now (~2-3 s), not in a request.
        False when this tokenizer cannot take grammars (its requests are then refused by name)."""
        try:
            self.grammar_compiler.warm_up()
        except InvalidRequestError:
            return False
        return True

    def validate_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Worst-case admission check: prompt + max_tokens must fit the context and the KV pool."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty; at least one token is required")
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens; the maximum context length is {self.max_model_len}"
            )
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"maximum context length {self.max_model_len}"
            )
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if total > capacity:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens can never fit the KV cache ({capacity} tokens); "
                f"raise kv_cache_memory_bytes"
            )

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting, mid-prefill, mid-decode); its blocks are freed now."""
        state = self.requests.pop(request_id, None)
        if state is not None and not state.seq.is_finished:
            state.seq.finish("abort")
            state.seq.metrics.finished_time = time.monotonic()
            self._finish(state.seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def run_to_completion(self, prompts: list, params: list[SamplingParams | None],
                          on_finished: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Add every prompt (with its params), step until all are finished; the final outputs in
        prompt order. ``on_finished`` sees each output as its request finishes (a progress bar)."""
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
        return [final[i] for i in ids]

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every sequence that got tokens."""
        settled = self._settle_grammars()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return settled
        result = self.runner.execute(batch.scheduled)
        for request_id, (start, entries) in result.prompt_logprobs.items():
            seq = self.requests[request_id].seq
            # A recompute after preemption covers positions again: keep the first computation.
            for position, (logprob, top) in enumerate(entries, start + 1):
                if position > len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append({"token_id": seq.prompt_token_ids[position], "logprob": logprob,
                                                "top": top})
        self.scheduler.commit_computed(batch)
        if not result.sampling:
            return settled
        with torch.profiler.record_function("fivefold::sampling"):  # named so the profiler can attribute it
            new_tokens = self._sample(result.logits, result.sampling)
        now = time.monotonic()
        outputs = settled
        for seq, (token_ids, logprobs) in zip(result.sampling, new_tokens):
            state = self.requests[seq.request_id]
            if seq.spec_token_ids:
                self.spec_stats.num_drafts += 1
                self.spec_stats.num_draft_tokens += len(seq.spec_token_ids)
                self.spec_stats.num_accepted_tokens += len(token_ids) - 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            emitted = []
            for token_id, logprob in zip(token_ids, logprobs):
                self._append(state, token_id, logprob)
                emitted.append(token_id)
                if seq.is_finished:
                    break
            if seq.is_finished:
                seq.metrics.finished_time = now
                self._finish(seq)
                del self.requests[seq.request_id]
            elif seq.spec_token_ids:
                self.scheduler.commit_accepted(seq, len(token_ids) - 1)
            outputs.append(self._output(state, emitted))
        return outputs

    def _propose(self) -> None:
        """Give each decoding row that can speculate its proposals for this step."""
        k = self.config.num_speculative_tokens
        requests = [(seq, n) for seq in self.scheduler.running
                    if can_speculate(seq) and (n := num_proposals_allowed(seq, k, self.max_model_len)) > 0]
        if not requests:
            return
        with torch.profiler.record_function("fivefold::propose"):
            drafts = self.proposer.propose(requests)
        for (seq, _), draft in zip(requests, drafts):
            seq.spec_token_ids = draft

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[list[int], list]]:
        """Per sequence: (new tokens, their logprob entries or None). Rows with proposals are
        verified (speculative.verify); the others sampled as usual, in one call each."""
        plain = [i for i, seq in enumerate(seqs) if not seq.spec_token_ids]
        if len(plain) == len(seqs):
            sampled = self.sampler(logits, seqs)
            return [([t], [lp]) for t, lp in zip(sampled.token_ids, sampled.logprobs)]
        found: list = [None] * len(seqs)
        first_rows = [0]
        for seq in seqs:
            first_rows.append(first_rows[-1] + len(seq.spec_token_ids) + 1)
        if plain:
            sampled = self.sampler(logits[[first_rows[i] for i in plain]], [seqs[i] for i in plain])
            for i, t, lp in zip(plain, sampled.token_ids, sampled.logprobs):
                found[i] = ([t], [lp])
        spec = [i for i, seq in enumerate(seqs) if seq.spec_token_ids]
        rows = [r for i in spec for r in range(first_rows[i], first_rows[i + 1])]
        for i, kept in zip(spec, verify(logits[rows], [seqs[i] for i in spec])):
            found[i] = (kept, [None] * len(kept))  # speculating rows ask for no logprobs (can_speculate)
        return found

    def _append(self, state: _RequestState, token_id: int, logprob) -> None:
        """One new token: to the sequence, its logprobs, text and grammar; then the stop checks."""
        seq = state.seq
        seq.token_ids.append(token_id)
        if logprob is not None:
            seq.logprobs.append({"token_id": token_id, "logprob": logprob[0], "top": logprob[1]})
        delta = state.detokenizer.add([token_id])
        state.text += delta
        if seq.params.stop:
            state.stops.feed(delta)
        self._check_stop(state, token_id)
        if not seq.is_finished and seq.grammar is not None:
            seq.grammar.advance(token_id)  # in the background: the sequence sits out steps until it is done

    def _settle_grammars(self) -> list[RequestOutput]:
        """Before scheduling: wait a little (GRAMMAR_WAIT_S in all) for the grammar work in flight, then
        finish the requests whose grammar is complete (its EOS, even with ignore_eos) or failed; their
        outputs. A grammar still working is left to a later step."""
        outputs = []
        deadline = time.monotonic() + GRAMMAR_WAIT_S
        for state in [s for s in self.requests.values() if s.seq.grammar is not None]:
            seq, grammar = state.seq, state.seq.grammar
            grammar.wait(deadline - time.monotonic())
            if grammar.error is not None:
                seq.finish("error", grammar.error)
            elif grammar.is_complete and seq.num_output_tokens:
                seq.finish("stop", seq.token_ids[-1])
            else:
                continue
            seq.metrics.finished_time = time.monotonic()
            self._finish(seq)
            del self.requests[seq.request_id]
            outputs.append(self._output(state, []))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _check_stop(self, state: _RequestState, token_id: int) -> None:
        seq, params = state.seq, state.seq.params
        if seq.num_output_tokens < params.min_tokens:  # nothing stops it early (EOS was masked anyway)
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish("length")
            return
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            seq.finish("stop", token_id)
        elif token_id in params.stop_token_ids:
            seq.finish("stop", token_id)
        for stop in params.stop:
            # Only the tail can hold a new match: the last delta plus len(stop) - 1 characters before it.
            start = max(0, state.num_emitted_chars - len(stop) + 1)
            idx = state.text.find(stop, start)
            if idx >= 0:
                state.text = state.text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.finish("stop", stop)
                return
        if seq.is_finished:
            return
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _output(self, state: _RequestState, new_token_ids: list[int]) -> RequestOutput:
        seq = state.seq
        # Until the request finishes, a tail that could still grow into a stop string is held back, so a
        # streaming client never receives text that the final answer cuts (vLLM holds back the same way).
        num_visible = len(state.text) if seq.is_finished else len(state.text) - state.stops.holdback
        num_visible = max(num_visible, state.num_emitted_chars)
        delta = state.text[state.num_emitted_chars:num_visible]
        state.num_emitted_chars = num_visible
        completion = CompletionOutput(
            index=0,
            text=state.text[:num_visible],
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            delta_text=delta,
            delta_token_ids=new_token_ids,
            num_cached_tokens=seq.num_cached_tokens,
            prompt=state.prompt,
            metrics=seq.metrics,
            prompt_logprobs=None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs],
        )

    def stats(self) -> dict:
        """Engine-wide counters: requests running and waiting, KV pool use, prefix cache,
        preemptions, reservations, speculation (the server's metrics read these)."""
        kv, res = self.kv_cache, self.scheduler.preallocation.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_evictable_blocks": kv.num_evictable_blocks,
            "num_used_blocks": kv.num_used_blocks,
            "prefix_cache_queries": kv.stats.num_queries,
            "prefix_cache_hits": kv.stats.num_hits,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_reservations": res.num_reservations,
            "num_reservations_too_small": res.num_too_small,
            "num_reservations_too_large": res.num_too_large,
            "num_reserved_blocks_unused": res.num_unused_blocks,
            "weight_bytes": self.runner.weight_bytes,
            "kv_cache_bytes": self.runner.num_blocks * self.config.block_size * self.runner.kv_bytes_per_token,
            **self.spec_stats.as_dict(),
        }
