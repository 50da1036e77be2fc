"""min_tokens (vLLM's field): until that many tokens are out, EOS and stop_token_ids cannot be
sampled and stop strings do not end the request. A logit_bias of +100 on the stopping token makes
it the model's certain choice at every step, so the request's length is exact: one token without
min_tokens, min_tokens + 1 with it, the same with ngram speculation on."""

import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.errors import InvalidRequestError
from fivefold.sampling_params import SamplingParams
from tests.engine.test_speculative import run_engine


def _outputs(engine, prompt, params):
    ids = engine.add_request(prompt, params)
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished[ids]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_eos_and_stop_token_ids_wait_for_min_tokens(smollm2, speculative):
    eos = smollm2.tokenizer.eos_token_ids[0]
    prompt = smollm2.tokenizer.encode("one two three four five six seven eight nine ten one two three four")
    options = {"kv_cache_memory_bytes": 64 << 20} | ({"speculative": speculative, "prompt_lookup_min": 1}
                                                     if speculative else {})
    stop_id = smollm2.tokenizer.encode(" seven")[0]
    engine = LLMEngine(smollm2, EngineConfig(**options))
    for min_tokens in (0, 5):
        out = _outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens,
                                                      logit_bias={eos: 100}))
        tokens = out.outputs[0].token_ids
        assert len(tokens) == min_tokens + 1 and tokens[-1] == eos and eos not in tokens[:-1]
        assert out.outputs[0].finish_reason == "stop"
        out = _outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens,
                                                      stop_token_ids=[stop_id], logit_bias={stop_id: 100}))
        tokens = out.outputs[0].token_ids
        assert len(tokens) == min_tokens + 1 and tokens[-1] == stop_id and stop_id not in tokens[:-1]
        assert engine.kv_cache.num_used_blocks == 0
    # max_tokens still ends it: min_tokens == max_tokens gives exactly max_tokens, none of them EOS
    assert run_engine(engine, [prompt], [SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                                        logit_bias={eos: 100})])[0].count(eos) == 0


def test_stop_strings_do_not_end_the_request_before_min_tokens(smollm2):
    prompt = smollm2.tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,")
    engine = LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=64 << 20))
    free = _outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    text = free.outputs[0].text
    stop = text.strip()[:2]  # appears in the first tokens
    early = _outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    late = _outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                                   min_tokens=len(free.outputs[0].token_ids)))
    assert len(early.outputs[0].token_ids) < len(free.outputs[0].token_ids)
    assert late.outputs[0].token_ids == free.outputs[0].token_ids and late.outputs[0].finish_reason == "length"


def test_min_tokens_is_checked():
    with pytest.raises(InvalidRequestError, match=r"min_tokens must be in \[0, max_tokens = 4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
