"""Prompt logprobs (SamplingParams.prompt_logprobs, the server's echo) against transformers,
through chunked prefill and next to prefix-cached requests; logit_bias through the sampler."""

from __future__ import annotations

import pytest
import torch

from fivefold.engine.config import EngineConfig
from fivefold.errors import InvalidRequestError
from fivefold.llm import LLM
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, save_random_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = save_random_hf_model("llama", directory)
    return hf, load_model(str(directory))


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, vocab]


@pytest.mark.parametrize("chunk", [512, 7])  # whole prompt in one step; chunked prefill over 7-token steps
def test_prompt_logprobs_match_transformers(tiny, chunk):
    hf, loaded = tiny
    llm = LLM(loaded, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=chunk, block_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 23, 40)]
    # The same prompt again, first without prompt logprobs: its blocks are in the prefix cache,
    # and the request that asks for prompt logprobs must still compute (not reuse) them.
    llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=2))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))
    for ids, out in zip(prompts, outs):
        ref = reference_logprobs(hf, ids)
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for pos, e in enumerate(entries[1:], 1):
            assert e["token_id"] == ids[pos]
            assert e["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
            top = ref[pos - 1].topk(3)
            assert [t for t, _ in e["top"]] == top.indices.tolist()
        assert out.num_cached_tokens == 0
    llm.engine.kv_cache.check_integrity()


def test_logit_bias_forces_and_forbids_tokens(tiny):
    _, loaded = tiny
    llm = LLM(loaded, kv_cache_memory_bytes=4 << 20)
    prompt = [5, 9, 11, 40]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={"77": 100}))[0]
    assert forced.outputs[0].token_ids == [77] * 6
    banned = set(base)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                logit_bias={t: -100 for t in banned}))[0].outputs[0].token_ids
    assert not banned & set(out)
    # sampled rows too, batched with an unbiased row
    sampled = llm.generate([prompt, prompt], [SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                             logit_bias={"300": 100}),
                                              SamplingParams(temperature=1.0, seed=3, max_tokens=8)])
    assert sampled[0].outputs[0].token_ids == [300] * 8 and sampled[1].outputs[0].token_ids != [300] * 8


def test_bad_logit_bias_and_prompt_logprobs_are_refused(tiny):
    _, loaded = tiny
    llm = LLM(loaded, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(InvalidRequestError, match=r"logit_bias names token id 9999, outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={9999: 1}))
    with pytest.raises(InvalidRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 200})
    with pytest.raises(InvalidRequestError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
