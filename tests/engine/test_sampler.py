"""The sampler: each filter and penalty against a hand-computed expectation, and the
per-request seed contract (same seed and prompt, same output, whatever the batch)."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from fivefold.engine.sequence import Sequence
from fivefold.errors import InvalidRequestError
from fivefold.sampling_params import SamplingParams


def seq(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Sequence:
    s = Sequence("r", list(prompt), params)
    s.token_ids.extend(output)
    return s


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [seq(SamplingParams(temperature=0)), seq(SamplingParams(temperature=0))])
    assert out.token_ids == [1, 0]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    def kept(**kw):
        masked = apply_top_k_top_p_min_p(logits.clone(), [seq(SamplingParams(**kw))])
        return torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.5) == [0]  # 0.5 reaches p by itself
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_p=0.76) == [0, 1, 2]
    assert kept(min_p=0.4) == [0, 1]  # threshold 0.4 * 0.5 = 0.2
    assert kept() == [0, 1, 2, 3]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    out = apply_penalties(logits.clone(), [s])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # seen tokens: positive /2, negative *2
    s = seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 3], output=[2, 2, 1])
    out = apply_penalties(logits.clone(), [s])
    # prompt tokens are not penalised; token 2 seen twice, token 1 once
    assert torch.allclose(out, torch.tensor([[2.0, -2.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.5, 0.5]]))


def test_seeded_sampling_is_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler()(logits[2:3].clone(), [seq(p)]).token_ids[0]
    others = [seq(SamplingParams(temperature=0.8)) for _ in range(5)]
    batch = others[:2] + [seq(p)] + others[2:]
    assert Sampler()(logits.clone(), batch).token_ids[2] == alone
    # The seed decides: over draws, a different seed differs at least once.
    a = [Sampler()(logits[2:3].clone(), [s]).token_ids[0] for s in [seq(SamplingParams(seed=7))] * 20]
    b = [Sampler()(logits[2:3].clone(), [s]).token_ids[0] for s in [seq(SamplingParams(seed=8))] * 20]
    assert a != b


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = seq(SamplingParams(temperature=1.0, seed=0))
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[Sampler()(logits.clone(), [s]).token_ids[0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.03 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_logprobs_of_sampled_and_top_n():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    out = Sampler()(logits, [seq(SamplingParams(temperature=0, logprobs=2))])
    sampled, top = out.logprobs[0]
    assert math.isclose(sampled, math.log(0.6), rel_tol=1e-5)
    assert [t for t, _ in top] == [0, 1] and math.isclose(top[1][1], math.log(0.3), rel_tol=1e-5)


@pytest.mark.parametrize("kw, message", [
    ({"temperature": -1}, "temperature must be in [0, 2]"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"stop": [""]}, "stop must be at most 16 non-empty strings"),
])
def test_out_of_range_parameters(kw, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kw)
    assert message in str(err.value)


def test_top_k_then_top_p_then_min_p_match_transformers_warpers():
    """Top-p's mass is taken over the top-k survivors (renormalised), as vLLM and transformers do."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from fivefold.engine.sampler import apply_top_k_top_p_min_p
    from fivefold.engine.sequence import Sequence
    from fivefold.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    for k, p, min_p in [(5, 0.5, 0.0), (20, 0.9, 0.0), (3, 0.6, 0.0), (50, 0.3, 0.05), (0, 0.7, 0.0), (10, 1.0, 0.2)]:
        logits = torch.randn(4, 64, generator=g) * 3
        seqs = [Sequence(f"s{i}", [1], SamplingParams(top_k=k, top_p=p, min_p=min_p)) for i in range(4)]
        ours = apply_top_k_top_p_min_p(logits.clone(), seqs)
        warpers = ([TopKLogitsWarper(k)] if k else []) + [TopPLogitsWarper(p)] + \
            ([MinPLogitsWarper(min_p)] if min_p else [])
        ref = LogitsProcessorList(warpers)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (k, p, min_p)


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 5e-324, "temperature": 1.0},  # what the schema fuzzer sent: seen logits overflow
    {"repetition_penalty": 1e-30, "temperature": 0.5, "top_p": 0.9, "min_p": 0.1},
    {"temperature": 2e-5, "top_k": 3},  # just above the greedy threshold: logits x 5e4
    {"temperature": 1e-300},  # below it: greedy
])
def test_extreme_parameters_in_range_give_a_token_not_an_error(kw):
    logits = torch.randn(2, 50) * 30
    logits[:, 5] = 1e38  # a logit already near float32's limit
    seqs = [seq(SamplingParams(seed=i, **kw), prompt=(1, 2, 5, 7)) for i in range(2)]
    out = Sampler()(logits.clone(), seqs)
    assert all(0 <= t < 50 for t in out.token_ids)
    if kw.get("temperature", 1.0) < 1e-5:
        assert seqs[0].params.is_greedy and out.token_ids == logits.argmax(dim=-1).tolist()
