"""The offline API on the built-in model: stop conditions, seeds, logprobs and metrics
through the whole engine (tokenizer, detokenizer, scheduler, sampler)."""

from __future__ import annotations

import math

import pytest

from fivefold.errors import FivefoldError, InvalidRequestError
from fivefold.llm import LLM
from fivefold.sampling_params import SamplingParams

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def greedy(llm):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]


def test_outputs_carry_text_ids_reason_and_metrics(llm, greedy):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy.token_ids and len(greedy.token_ids) == 24
    assert out.outputs[0].text == llm.tokenizer.decode(greedy.token_ids)
    assert out.outputs[0].finish_reason == "length"
    m = out.metrics
    assert 0 <= m.queue_time <= m.ttft and m.decode_time > 0


def test_stop_string_truncates_text(llm, greedy):
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), text
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def _stream(llm, params):
    """Drive the engine step by step as the server does; return the deltas and the final output."""
    rid = llm.engine.add_request(PROMPT, params)
    deltas, final = [], None
    while final is None:
        for out in llm.engine.step():
            if out.request_id == rid:
                deltas.append(out.delta_text)
                assert out.outputs[0].text == "".join(deltas)  # the cumulative text is what was streamed
                final = out if out.finished else None
    return deltas, final.outputs[0]


def test_streaming_never_sends_text_that_a_stop_string_cuts(llm, greedy):
    """Every stop string that straddles a token boundary: a client that concatenates the streamed deltas
    gets exactly the non-streamed answer, and never sees text that the answer later cuts."""
    text, num_straddling = greedy.text, 0
    pieces = [llm.tokenizer.decode(greedy.token_ids[:i]) for i in range(len(greedy.token_ids) + 1)]
    bounds = {len(p) for p in pieces}
    for start in range(0, len(text) - 6, 3):
        stop = text[start: start + 6]
        if not any(start < b < start + 6 for b in bounds) or not stop.strip():
            continue
        num_straddling += 1
        for keep in (False, True):
            params = SamplingParams(temperature=0, max_tokens=24, stop=[stop, "@@never@@"], ignore_eos=True,
                                    include_stop_str_in_output=keep)
            whole = llm.generate(PROMPT, params)[0].outputs[0]
            deltas, final = _stream(llm, params)
            assert "".join(deltas) == whole.text == final.text, (stop, deltas)
            assert whole.text == text[: text.index(stop) + (len(stop) if keep else 0)]
    assert num_straddling >= 5


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(llm, greedy):
    """A stop string that shares a prefix with the text but never completes: nothing is lost at the end."""
    text = greedy.text
    stop = text[-3:] + "\u2603"  # the text's last characters, then one that never comes
    deltas, final = _stream(llm, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))
    assert final.finish_reason == "length" and "".join(deltas) == text
    assert deltas[-1].endswith(text[-3:])  # held back until the request finished


@pytest.mark.parametrize("text, stops, expected", [
    ("abc", ["cde"], 1), ("abcd", ["cdx"], 2), ("abc", ["abc"], 0), ("xab", ["abab"], 2),
    ("aab", ["aabx", "bq"], 3), ("", ["a"], 0), ("zz", ["y"], 0), ("aa", ["aaa"], 2),
])
def test_stop_prefix_len(text, stops, expected):
    from fivefold.engine.llm_engine import stop_prefix_len
    assert stop_prefix_len(text, stops) == expected


def test_stop_token_id(llm, greedy):
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_seed_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (5, 20, 9)]
    batch = llm.generate(["Hello", PROMPT, "Once upon a time", "def f(x):"], [others[0], seeded, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=43,
                                                     ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_logprobs(llm, greedy):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for entry, token in zip(out.logprobs, greedy.token_ids):
        assert entry["token_id"] == token
        top_ids = [t for t, _ in entry["top"]]
        assert top_ids[0] == token and len(top_ids) == 3  # greedy: the sampled token is the most likely
        assert math.isclose(entry["logprob"], entry["top"][0][1], rel_tol=1e-6) and entry["logprob"] <= 0


def test_penalties_change_greedy_output(llm, greedy):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              frequency_penalty=2.0, presence_penalty=2.0))[0].outputs[0]
    assert out.token_ids != greedy.token_ids


def test_eos_stops_unless_ignored(llm):
    chat = llm.chat_prompt([{"role": "user", "content": "Say hi."}])
    out = llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.tokenizer.eos_token_ids
    ignored = llm.generate([chat], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3,
                                                  ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(out.token_ids) + 3


def test_requests_that_can_never_fit_are_refused(llm):
    # the model's 8192-token context is clipped to what the 128 MB pool holds for one sequence
    pool_tokens = llm.engine.runner.num_blocks * 16
    assert llm.engine.max_model_len == pool_tokens < 8192
    with pytest.raises(InvalidRequestError, match=f"exceeds the maximum context length {pool_tokens}"):
        llm.generate(PROMPT, SamplingParams(max_tokens=9000))
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate([[]], SamplingParams())
    with pytest.warns(UserWarning, match="max_model_len clipped from the model's 8192 to 64 tokens"):
        small = LLM(llm.loaded, kv_cache_memory_bytes=4 * 16 * 46080)  # 4 blocks = 64 tokens
    with pytest.raises(InvalidRequestError, match="exceeds the maximum context length 64"):
        small.generate(PROMPT, SamplingParams(max_tokens=100))
    with pytest.raises(FivefoldError, match=r"max_model_len 100 is more than the KV pool \(4 blocks of 16 tokens"):
        LLM(llm.loaded, kv_cache_memory_bytes=4 * 16 * 46080, max_model_len=100)


def test_vllm_prompt_forms_give_the_same_tokens_and_bad_ones_are_refused_at_add_request(llm):
    """str, token ids, {"prompt": str} and {"prompt_token_ids": [...]} (vLLM's TextPrompt and
    TokensPrompt) run the same greedy request; anything else fails in add_request, naming the forms,
    and leaves nothing queued."""
    params = SamplingParams(temperature=0, max_tokens=6)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], params)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, params)  # one dict is one prompt, not its keys
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    vocab = llm.loaded.config.vocab_size
    for bad, match in [({"text": text}, "prompt dict must be"), ({"prompt": ids}, "prompt dict must be"),
                       ({"prompt_token_ids": ids, "prompt": text}, "prompt dict must be"),
                       (3.5, "a prompt must be"), ([1, "two"], "a prompt must be"), ([True], "a prompt must be"),
                       ([vocab], f"outside the vocabulary \\[0, {vocab}\\)"), ([-1], "outside the vocabulary")]:
        with pytest.raises(InvalidRequestError, match=match):
            llm.engine.add_request(bad, params)
    assert not llm.engine.has_unfinished
