"""Speculative decoding (fivefold/engine/speculative.py): proposers, verification, and the
engine with speculation against the engine without it (greedy: token for token; sampled: the
same distribution, by a chi-square test)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from fivefold.compress.llm_prune import every_other_layer_student
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.engine.sequence import Sequence
from fivefold.engine.speculative import NgramProposer, can_speculate, num_proposals_allowed, verify
from fivefold.errors import FivefoldError
from fivefold.models.forward import sequence_logits
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, save_random_hf_model


def run_engine(engine: LLMEngine, prompts, params) -> list[list[int]]:
    """Every request to completion; integrity of the pool (and the draft's) checked after each step."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.kv_cache.check_integrity([s.seq for s in engine.requests.values()])
        draft_pool = getattr(engine.proposer, "kv_cache", None)
        if draft_pool is not None:
            draft_pool.check_integrity([shadow for shadow, _ in engine.proposer.shadows.values()])
    assert engine.kv_cache.num_used_blocks == 0
    if draft_pool is not None:
        assert draft_pool.num_free_blocks == draft_pool.num_blocks and not engine.proposer.shadows
    return [done[i] for i in ids]


# --- proposer and verification units ----------------------------------------------------------------

def test_ngram_proposer_continues_the_most_recent_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    #               0  1  2  3  4  5  6  7  8  9
    assert p.propose_one([5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7], 3) == [1, 5, 6]  # [5 6 7] last seen at 5
    assert p.propose_one([5, 6, 7, 8, 9, 5, 6, 7], 4) == [8, 9, 5, 6]
    assert p.propose_one([1, 2, 3, 4], 2) == []  # no earlier occurrence of any suffix
    assert p.propose_one([3, 1, 2, 3], 5) == [1, 2, 3]  # shorter than k at the end of the tokens
    assert NgramProposer(min_n=2, max_n=3).propose_one([3, 1, 2, 3], 2) == []  # a 1-gram is below min_n


def _seq(tokens, num_prompt, **params) -> Sequence:
    seq = Sequence("s", tokens[:num_prompt], SamplingParams(**params))
    seq.token_ids = list(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_greedy_verification_keeps_the_agreeing_prefix_then_the_targets_token():
    seq = _seq([1, 2, 3], 2, temperature=0)
    seq.spec_token_ids = [7, 8, 9]
    logits = torch.full((4, 12), -5.0)
    for row, best in enumerate([7, 8, 4, 11]):  # agrees with 7 and 8, not with 9
        logits[row, best] = 5.0
    assert verify(logits, [seq]) == [[7, 8, 4]]
    logits[2, 4], logits[2, 9] = -5.0, 5.0  # now every proposal agrees: the bonus token is row 3's
    assert verify(logits, [seq]) == [[7, 8, 9, 11]]


def test_rows_that_need_per_position_state_do_not_speculate():
    assert can_speculate(_seq([1, 2, 3], 2))
    assert not can_speculate(_seq([1, 2, 3], 2, logprobs=1))
    assert not can_speculate(_seq([1, 2, 3], 2, presence_penalty=0.5))
    prefill = _seq([1, 2, 3], 3)
    prefill.num_computed_tokens = 1
    assert not can_speculate(prefill)
    seq = _seq([1, 2, 3, 4], 2, max_tokens=4)  # 2 of 4 output tokens written: 1 proposal + the bonus
    assert num_proposals_allowed(seq, 4, max_model_len=100) == 1
    assert num_proposals_allowed(seq, 4, max_model_len=6) == 1
    assert num_proposals_allowed(seq, 4, max_model_len=5) == 0


def test_config_refuses_unknown_methods_and_a_draft_without_a_model(tmp_path):
    with pytest.raises(FivefoldError, match="speculative must be one of ngram, draft"):
        EngineConfig(speculative="medusa")
    with pytest.raises(FivefoldError, match=r"num_speculative_tokens must be in \[1, 16\]"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    save_random_hf_model("qwen2", tmp_path, seed=0)
    with pytest.raises(FivefoldError, match="needs draft_model"):
        LLMEngine(load_model(str(tmp_path)), EngineConfig(speculative="draft"))


# --- greedy: token for token the output without speculation ----------------------------------------

def _copying_prompts(rng: random.Random, num: int) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup finds matches) mixed with random ones."""
    prompts = []
    for i in range(num):
        phrase = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(4, 12))]
        prompts.append(phrase * rng.randint(2, 4) if i % 3 else [rng.randrange(3, TINY_VOCAB)
                                                                 for _ in range(rng.randint(2, 40))])
    return prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_is_token_identical_under_preemption_and_prefix_cache(tmp_path, arch):
    """A small pool (preemption), a shared prefix (prefix hits), chunked prefill, rows with
    logprobs or sampling in the same batch (they do not speculate), for both proposers."""
    save_random_hf_model(arch, tmp_path / "t", seed=3)
    save_random_hf_model(arch, tmp_path / "d", seed=4)  # another random model: its proposals mostly wrong
    target = load_model(str(tmp_path / "t"))
    c = target.config
    bytes_per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 4
    rng = random.Random(1)
    prompts = _copying_prompts(rng, 18)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(6, 30), ignore_eos=True,
                             logprobs=2 if i % 7 == 3 else None) for i in range(len(prompts))]
    options = dict(block_size=4, kv_cache_memory_bytes=40 * bytes_per_block, max_num_batched_tokens=48,
                   max_num_seqs=12)
    reference = run_engine(LLMEngine(target, EngineConfig(**options)), prompts, params)
    for method, draft in [("ngram", None), ("draft", load_model(str(tmp_path / "d"))), ("draft", target)]:
        engine = LLMEngine(target, EngineConfig(speculative=method, prompt_lookup_min=1, **options), draft=draft)
        assert run_engine(engine, prompts, params) == reference, (method, draft is target)
        stats = engine.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0, stats
        if draft is target:  # a draft equal to the target is always right
            assert stats["spec_acceptance_rate"] == 1.0, stats
        assert stats["spec_mean_accepted_length"] == pytest.approx(
            1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"])


def test_greedy_speculation_on_the_default_model_is_token_identical(smollm2):
    """SmolLM2 rewriting a pydoc passage: prompt lookup, and its every-other-layer student as the
    draft (untrained here: identity does not depend on the draft's quality)."""
    from pydoc_data.topics import topics

    passage = topics["assert"][:600]
    tok = smollm2.tokenizer
    prompt = tok.encode(f"Repeat the following text exactly.\n\n{passage}\n\nRepeated text:\n\n{passage[:80]}")
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    reference = run_engine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20)), [prompt], params)
    engine = LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20, speculative="ngram"))
    assert run_engine(engine, [prompt], params) == reference
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    engine = LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20, speculative="draft",
                                             num_speculative_tokens=2), draft=every_other_layer_student(smollm2))
    assert run_engine(engine, [prompt], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]) == \
        [reference[0][:16]]


# --- sampled: the target's distribution -------------------------------------------------------------

class _FixedProposer:
    """Always proposes the same tokens: each one accepted sometimes, rejected sometimes."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, requests):
        return [self.tokens[:k] for _, k in requests]

    def release(self, seq):
        pass


def _exact_marginals(model, prompt, temperature, vocab):
    """P(output token 2 = y), P(output token 3 = y) (summed over the tokens before them), and a
    function giving token 2's distribution under a subtly wrong rule for a proposal x: on
    rejection, drawing from p itself instead of p with x removed."""
    def dist(ids):
        return torch.softmax(sequence_logits(model, ids)[-1].double() / temperature, -1).numpy()

    p1 = dist(prompt)
    after = [dist(prompt + [a]) for a in range(vocab)]
    p2 = sum(p1[a] * after[a] for a in range(vocab))
    p3 = sum(p1[a] * after[a][b] * dist(prompt + [a, b]) for a in range(vocab) for b in range(vocab))

    def wrong2(x):
        total = np.zeros(vocab)
        for a in range(vocab):
            wrong = (1 - after[a][x]) * after[a]
            wrong[x] += after[a][x]
            total += p1[a] * wrong
        return total

    return p2, p3, wrong2


def _chi_square_pvalue(counts, p, num) -> float:
    keep = p * num >= 5  # chi-square needs expected counts of at least ~5
    expected, observed = p[keep] * num, counts[keep]
    if not keep.all():
        expected, observed = np.append(expected, p[~keep].sum() * num), np.append(observed, counts[~keep].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_sampled_speculation_keeps_the_target_distribution(tmp_path):
    """A 12-token vocabulary, one proposal (token 2's likeliest) per decoding row: the 2nd and 3rd
    output tokens of 2000 runs against their exact marginals (chi-square); the same counts reject
    the distribution a subtly wrong residual would give (the test has the power to tell)."""
    vocab = 12
    save_random_hf_model("llama", tmp_path, seed=7, vocab_size=vocab)
    loaded = load_model(str(tmp_path))
    prompt = [3, 5, 7, 3, 5]
    temperature = 0.25  # the random model's logits are flat: sharpen them so the proposal matters
    p2, p3, wrong2 = _exact_marginals(loaded.model, prompt, temperature, vocab)
    proposal = int(p2.argmax())
    engine = LLMEngine(loaded, EngineConfig(speculative="ngram", max_num_seqs=250, block_size=4,
                                            kv_cache_memory_bytes=8 << 20))
    engine.proposer = _FixedProposer([proposal, 9])
    torch.manual_seed(0)
    num = 2000
    counts2, counts3 = np.zeros(vocab), np.zeros(vocab)
    for _ in range(0, num, 250):
        outs = run_engine(engine, [prompt] * 250, [SamplingParams(temperature=temperature, max_tokens=3,
                                                                  ignore_eos=True)] * 250)
        for out in outs:
            counts2[out[1]] += 1
            counts3[out[2]] += 1
    stats = engine.stats()
    assert stats["spec_num_drafts"] == num  # token 2 of every run was verified
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats  # both branches of the rule taken
    assert _chi_square_pvalue(counts2, p2, num) > 1e-3, (counts2, (p2 * num).round(1))
    assert _chi_square_pvalue(counts3, p3, num) > 1e-3, (counts3, (p3 * num).round(1))
    assert _chi_square_pvalue(counts2, wrong2(proposal), num) < 1e-3, (counts2, (wrong2(proposal) * num).round(1))
