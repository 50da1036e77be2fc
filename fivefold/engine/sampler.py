"""Next-token selection for a batch of sequences: the owner of randomness.

Rows are processed together where the operation is the same for every row
(logit bias, penalties, grammar masks, temperature, top-k/top-p/min-p masks), and drawn one row at a time
with the row's own generator, so a seeded request gets the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.engine.sequence import Sequence
from fivefold.engine.structured_output import apply_grammar_masks


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled token logprob, [(token_id, logprob), ...] top-N) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output, CTRL rule), presence and frequency (output only, OpenAI rule)."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = seq.output_token_ids
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[1]).float()
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Add each row's logit_bias (OpenAI's rule: to the logits, before penalties and sampling)."""
    for row, seq in enumerate(seqs):
        if seq.params.logit_bias:
            ids, values = zip(*seq.params.logit_bias)
            logits[row, list(ids)] += torch.tensor(values, dtype=logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], offsets: list[int] | None = None) -> torch.Tensor:
    """-inf on each row's min_tokens_ban while fewer than params.min_tokens tokens are out (offsets:
    tokens each row comes after its sequence's last one, for speculative verification)."""
    for row, seq in enumerate(seqs):
        if seq.min_tokens_ban and seq.num_output_tokens + (offsets[row] if offsets else 0) < seq.params.min_tokens:
            logits[row, list(seq.min_tokens_ban)] = float("-inf")
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask (set to -inf) tokens outside each row's top-k, then nucleus top-p, then min-p, each on
    what the one before kept (vLLM's and transformers' order: top-p's mass is that of the top-k)."""
    top_k = [s.params.top_k for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
        ranks = torch.arange(vocab).unsqueeze(0)
        remove = ranks >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)  # renormalised over the top-k
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= torch.tensor(top_p).unsqueeze(1)
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def token_logprobs(raw: torch.Tensor, token_ids: list[int], num_top: list[int | None]):
    """Per row: (log-probability of ``token_ids[row]``, its top ``num_top[row]`` as (id, logprob)
    pairs), or None where ``num_top[row]`` is None. ``raw``: logits [rows, vocab]. The sampled
    tokens' logprobs and the prompt tokens' (ModelRunner) both come from here."""
    if all(n is None for n in num_top):
        return [None] * len(token_ids)
    logp = raw.log_softmax(dim=-1)
    out = []
    for row, (n, token) in enumerate(zip(num_top, token_ids)):
        if n is None:
            out.append(None)
            continue
        top = logp[row].topk(n) if n else None
        tops = list(zip(top.indices.tolist(), top.values.tolist())) if n else []
        out.append((float(logp[row, token]), tops))
    return out


class Sampler:
    """logits [num_seqs, vocab] (float32) -> one token per sequence."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        raw = logits
        logits = self.adjusted_logits(logits, seqs)
        token_ids = logits.argmax(dim=-1).tolist()
        probs = self.probabilities(logits, seqs)
        if probs is not None:
            for row, seq in enumerate(seqs):
                if not seq.params.is_greedy:
                    token_ids[row] = int(torch.multinomial(probs[row], 1, generator=seq.generator))
        return SamplerOutput(token_ids, token_logprobs(raw, token_ids, [s.params.logprobs for s in seqs]))

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, seqs: list[Sequence], offsets: list[int] | None = None) -> torch.Tensor:
        """Logit bias, penalties, min_tokens and grammar masks applied (a copy when any applies); row i
        is of seqs[i], ``offsets[i]`` tokens after its last one (speculative verification)."""
        raw = logits
        if any(s.params.logit_bias for s in seqs):
            logits = apply_logit_bias(logits.clone(), seqs)
        if any(s.min_tokens_ban for s in seqs):
            logits = apply_min_tokens(logits.clone() if logits is raw else logits, seqs, offsets)
        if any(s.params.has_penalties for s in seqs):
            logits = apply_penalties(logits.clone() if logits is raw else logits, seqs)
        grammars = [s.grammar for s in seqs]
        if any(g is not None for g in grammars):
            with torch.profiler.record_function("fivefold::grammar_mask"):
                logits = logits.clone() if logits is raw else logits
                apply_grammar_masks(logits, grammars)
        return logits

    @staticmethod
    def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """The distribution each sampled row draws from (temperature, then top-k/top-p/min-p), or
        None when every row is greedy; greedy rows' entries are not meaningful."""
        greedy = [s.params.is_greedy for s in seqs]
        if all(greedy):
            return None
        temps = torch.tensor([s.params.temperature if not g else 1.0 for s, g in zip(seqs, greedy)])
        # A tiny repetition penalty or temperature can push a logit past float32's range; an inf
        # would turn softmax into NaN. Saturate instead: the largest logits stay the largest.
        finfo = torch.finfo(logits.dtype)
        scaled = torch.nan_to_num(logits / temps.unsqueeze(1), nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
        return apply_top_k_top_p_min_p(scaled, seqs).softmax(dim=-1)
