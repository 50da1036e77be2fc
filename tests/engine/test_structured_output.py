"""Structured output on the built-in model: every output parses and validates against its
schema (nested objects, enums, arrays), greedy and sampled, batched with unconstrained rows;
regex and choice constraints; bad grammars refused by name; the mask's cost attributed to
the profiler's sampling category."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fivefold.errors import InvalidRequestError
from fivefold.llm import LLM
from fivefold.sampling_params import SamplingParams, StructuredOutputs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["engineer", "artist", "doctor"]}}, "required": ["name", "age", "role"],
    "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 16},
                                                "last": {"type": "string", "maxLength": 16}},
               "required": ["first", "last"], "additionalProperties": False},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title", "author", "year"], "additionalProperties": False}
ARRAY = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 4}},
    "required": ["colors", "scores"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                                    "ok": {"type": "boolean"}},
                                   "required": ["id", "ok"], "additionalProperties": False},
        "minItems": 1, "maxItems": 3}
# Every string, number and array is bounded, so that a sampled output always closes within max_tokens
# (an unbounded integer lets a sampled model write digits until it runs out).
SCHEMAS = {"person": PERSON, "nested": NESTED, "array": ARRAY, "list": LIST}


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, kv_cache_memory_bytes=64 << 20)


def chat(llm, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_every_output_validates_against_its_schema(llm):
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        prompt = chat(llm, f"Give an example {name} as JSON.")
        for seed in (None, 1, 2):  # greedy, then two sampled draws
            greedy = seed is None
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0 if greedy else 1.0, seed=seed, max_tokens=160,
                                         structured_outputs=StructuredOutputs(json=schema)))
            schemas.append(schema)
    prompts.append(chat(llm, "Say hello."))  # an unconstrained row in the same batches
    params.append(SamplingParams(temperature=0, max_tokens=24))
    outs = llm.generate(prompts, params)
    for out, schema in zip(outs[:-1], schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text  # ended by the grammar, not by max_tokens
        jsonschema.validate(json.loads(c.text), schema)
    plain = llm.generate([prompts[-1]], params[-1])[0].outputs[0].text
    assert outs[-1].outputs[0].text == plain  # the unconstrained row is untouched by its neighbours' masks


def test_json_object_regex_and_choice(llm):
    prompt = chat(llm, "Answer.")
    outs = llm.generate([prompt] * 4, [
        SamplingParams(temperature=1.0, seed=5, max_tokens=120, structured_outputs=StructuredOutputs(json_object=True)),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                       structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                       structured_outputs=StructuredOutputs(choice=("yes", "no", "it \"depends\""))),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                       structured_outputs=StructuredOutputs(choice=("alpha", "beta"))),
    ])
    texts = [o.outputs[0].text for o in outs]
    obj = json.loads(texts[0]) if outs[0].outputs[0].finish_reason == "stop" else {}
    assert isinstance(obj, dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[1]), texts[1]
    assert texts[2] in ("yes", "no", 'it "depends"')
    assert texts[3] in ("alpha", "beta") and outs[3].outputs[0].finish_reason == "stop"  # done even with ignore_eos


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json='{"type": "object"'), "the JSON schema is not valid JSON"),
    (StructuredOutputs(json={"type": "frobnicated"}), "the json constraint does not compile"),
    (StructuredOutputs(regex="([a-z"), "the regex constraint does not compile"),
])
def test_bad_grammars_are_refused_at_add_request(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished


def test_structured_outputs_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one of json, json_object, regex, choice"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="choice must be 1-256 non-empty strings"):
        StructuredOutputs(choice=())


def test_mask_cost_is_in_the_profilers_sampling_category(smollm2):
    from fivefold.profile.llm_profile import profile_llm
    from fivefold.profile.roofline import MachinePeaks

    peaks = MachinePeaks(bandwidth=30e9, flops={"float32": 100e9})
    report = profile_llm(smollm2, "decode", batch=2, seq=32, num_iterations=3, peaks=peaks, structured_output="json")
    mask = next(o for o in report.ops if o.name == "fivefold::grammar_mask")
    assert mask.category == "sampling" and mask.num_calls == 1 and mask.self_s > 0
    # the region's own time (the grammar engine is not a torch op) is sampling, not overhead
    assert report.category_s["sampling"] >= mask.self_s
    assert "JSON-constrained" in report.label
