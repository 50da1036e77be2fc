"""Speculative decoding: propose k tokens cheaply, verify them in one pass of the target.

A decode step streams every weight once for one token per sequence; verifying k proposed
tokens costs one pass over k + 1 positions, nearly the same bytes, and yields between 1 and
k + 1 tokens. Two proposers:

- :class:`NgramProposer` (prompt lookup): the last n tokens (n from ``prompt_lookup_max`` down
  to ``prompt_lookup_min``) are looked up in the prompt and the output so far; the tokens that
  followed their most recent earlier occurrence are proposed. Free, and strong where the
  output copies the input (rewriting, summarising, code edits).
- :class:`DraftProposer`: a smaller model with the same tokenizer (e.g. the every-other-layer
  student ``fivefold distill`` writes) runs k greedy decode steps over its own paged KV cache.

Verification (:func:`verify`): the target's logits at the k + 1 positions are processed as the
sampler would (logit bias, temperature, top-k/top-p/min-p). Greedy rows keep proposals while
they equal the target's argmax, then take the argmax: the output is token for token the one
without speculation. Sampled rows use the rejection rule of Leviathan et al. / Chen et al.
with a one-hot proposal (both proposers propose deterministically): proposal x at a position
whose target distribution is p is accepted with probability p(x); on rejection the token is
drawn from p with x removed, renormalised; if every proposal is accepted, a bonus token is
drawn from the last position's p. So P(token = y) = p(y) at every position: the output
distribution is the target's. (A seeded request draws different random numbers than it would
without speculation, so its tokens differ; their distribution does not.)

Rows that speculate: decoding (prompt computed), no logprobs, no penalties, no grammar (their
per-position history would have to be replayed inside one step; such rows decode normally in
the same batch). The scheduler counts proposals in the step's token budget and drops them
first when blocks run short; a preempted row loses its proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.sampler import Sampler
from fivefold.engine.sequence import Sequence
from fivefold.errors import FivefoldError
from fivefold.sampling_params import SamplingParams


@dataclass
class SpeculativeStats:
    """Counters of verified proposals (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications of a row with at least one proposal
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the accepted proposals plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.acceptance_rate, "spec_mean_accepted_length": self.mean_accepted_length}


def can_speculate(seq: Sequence) -> bool:
    """The sequence decodes (its prompt is computed) and needs nothing per position that one
    verification pass cannot give: no logprobs, penalties or grammar."""
    p = seq.params
    return (seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            and p.logprobs is None and not p.has_penalties and seq.grammar is None)


def num_proposals_allowed(seq: Sequence, k: int, max_model_len: int) -> int:
    """Proposals such that accepting all of them plus the bonus token stays within max_tokens
    and the context length."""
    return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1))


class NgramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows[i] = tokens[i:i+n] for every i whose window is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start: start + k].tolist()
        return []

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose_one(seq.token_ids, k) for seq, k in requests]

    def release(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """k greedy steps of a draft model over its own paged KV cache, batched over the rows.

    Each target sequence has a shadow sequence here whose tokens follow the target's: before
    proposing, the shadow's computed prefix is cut to what it shares with the target (the
    rejected proposals' keys are recomputed over), then the new tokens are computed and k
    tokens drawn greedily. The pool holds as many tokens as the target's, plus k per row.
    """

    def __init__(self, draft, target_config: EngineConfig, num_target_blocks: int, vocab_size: int) -> None:
        from fivefold.engine.kv_cache_manager import KVCacheManager
        from fivefold.engine.model_runner import ModelRunner, kv_bytes_per_token

        if draft.config.vocab_size != vocab_size:
            raise FivefoldError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                                f"target's ({vocab_size}): a draft must share the target's tokenizer")
        bs = target_config.block_size
        k = target_config.num_speculative_tokens
        num_blocks = num_target_blocks + target_config.max_num_seqs * (-(-k // bs) + 1)
        config = EngineConfig(
            block_size=bs, kv_cache_memory_bytes=num_blocks * bs * kv_bytes_per_token(draft.model),
            max_num_seqs=target_config.max_num_seqs, enable_prefix_caching=False,
            weight_layout=target_config.weight_layout, decode_attention=target_config.decode_attention,
            hot_path=target_config.hot_path, prefill_attention=target_config.prefill_attention,
            decode_loop=target_config.decode_loop)
        self.runner = ModelRunner(draft.model, config)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, bs, enable_prefix_caching=False)
        self.shadows: dict[str, tuple[Sequence, int]] = {}  # request id -> (shadow, tokens synced)
        self._greedy = SamplingParams(temperature=0.0, max_tokens=1)

    def _shadow(self, seq: Sequence) -> Sequence:
        """The draft's copy of ``seq``, its computed prefix cut to the tokens both still share."""
        entry = self.shadows.get(seq.request_id)
        if entry is None:
            shadow = Sequence(seq.request_id, list(seq.token_ids), self._greedy)
        else:
            shadow, num_synced = entry
            # Tokens up to the last sync are the target's; only the proposals after them can differ.
            # The last token is always computed again: its logits give the first proposal.
            common = min(shadow.num_computed_tokens, seq.num_tokens - 1)
            for i in range(num_synced, common):
                if shadow.token_ids[i] != seq.token_ids[i]:
                    common = i
                    break
            shadow.num_computed_tokens = common
            shadow.token_ids = list(seq.token_ids)
        self.shadows[seq.request_id] = (shadow, seq.num_tokens)
        return shadow

    @torch.inference_mode()
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, Sequence, int]] = []  # (request index, shadow, tokens to compute)
        for i, (seq, k) in enumerate(requests):
            shadow = self._shadow(seq)
            num_new = shadow.num_uncomputed_tokens
            if self.kv_cache.allocate_slots(shadow, num_new, num_lookahead_tokens=k):
                active.append((i, shadow, num_new))  # else (pool full): no proposal this step
        while active:
            result = self.runner.execute([(shadow, n) for _, shadow, n in active])
            tokens = result.logits.argmax(dim=-1).tolist()
            still = []
            for (i, shadow, n), token in zip(active, tokens):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < requests[i][1]:
                    still.append((i, shadow, 1))
            active = still
        return drafts

    def release(self, seq: Sequence) -> None:
        entry = self.shadows.pop(seq.request_id, None)
        if entry is not None:
            self.kv_cache.free(entry[0])


def make_proposer(config: EngineConfig, draft, num_target_blocks: int, vocab_size: int, dtype):
    """The proposer ``config.speculative`` names, or None."""
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if draft is None:
        from fivefold.models.loader import load_model

        if not config.draft_model:
            raise FivefoldError("speculative='draft' needs draft_model: a model with the target's tokenizer "
                                "(e.g. the directory `fivefold distill --out DIR` writes)")
        draft = load_model(config.draft_model, dtype)
    return DraftProposer(draft, config, num_target_blocks, vocab_size)


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[list[int]]:
    """The tokens each row keeps: its accepted proposals, then one token of the target's.

    logits: [sum(len(seq.spec_token_ids) + 1), vocab], row block i holding seqs[i]'s positions
    (the last computed token's, then each proposal's) in order.
    """
    rows = [seq for seq in seqs for _ in range(len(seq.spec_token_ids) + 1)]
    offsets = [j for seq in seqs for j in range(len(seq.spec_token_ids) + 1)]
    logits = Sampler.adjusted_logits(logits, rows, offsets)
    argmax = logits.argmax(dim=-1).tolist()
    probs = Sampler.probabilities(logits, rows)
    kept: list[list[int]] = []
    first = 0
    for seq in seqs:
        proposals = seq.spec_token_ids
        if seq.params.is_greedy:
            a = 0
            while a < len(proposals) and proposals[a] == argmax[first + a]:
                a += 1
            kept.append(proposals[:a] + [argmax[first + a]])
        else:
            kept.append(_rejection_sample(probs[first: first + len(proposals) + 1], proposals, seq.generator))
        first += len(proposals) + 1
    return kept


def _rejection_sample(probs: torch.Tensor, proposals: list[int], generator) -> list[int]:
    """probs: [len(proposals) + 1, vocab], the target's distribution at each position."""
    for j, x in enumerate(proposals):
        if float(torch.rand((), generator=generator)) < float(probs[j, x]):
            continue
        residual = probs[j].clone()
        residual[x] = 0.0  # max(p - q, 0) for a one-hot q at x
        return proposals[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return proposals + [int(torch.multinomial(probs[len(proposals)], 1, generator=generator))]
