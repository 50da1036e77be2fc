"""The built-in SmolLM2-135M-Instruct GGUF: our engine against transformers on the
same dequantized float32 weights (transformers dequantizes the GGUF itself, so our
GGUF reader, q/k un-permutation and tokenizer are checked independently)."""

from __future__ import annotations

import pytest
import torch

from fivefold.llm import LLM
from fivefold.models import resolve_model_path
from fivefold.sampling_params import SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three primary colors:",
    "Translate to French: The weather is nice today, and I would like to go for a walk in the park with my dog.",
    "In physics, the law of conservation of energy states that energy can neither be created nor destroyed; "
    "it can only be transformed from one form to another. For example, when a ball falls,",
    "Q: What is 12 times 12?\nA:",
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = resolve_model_path("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_gguf_weights_equal_transformers_dequantization(smollm2, hf_reference):
    ours = smollm2.model.state_dict()
    ref = hf_reference.state_dict()
    for layer in (0, 17, 29):
        p = f"model.layers.{layer}."
        qkv = torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(ours[f"layers.{layer}.self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([ref[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
        assert torch.equal(ours[f"layers.{layer}.mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(ours["embed_tokens.weight"], ref["model.embed_tokens.weight"])


def test_greedy_generation_token_identical_to_transformers(smollm2, hf_reference):
    from transformers import AutoTokenizer

    path = resolve_model_path("smollm2-135m-instruct")
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    llm = LLM(smollm2, kv_cache_memory_bytes=256 << 20)
    # Half plain continuations, half through the chat template.
    prompts = [p if i % 2 == 0 else llm.chat_prompt([{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS))  # one batch
    lengths = set()
    for prompt, out in zip(prompts, ours):
        ids = out.prompt_token_ids
        if isinstance(prompt, str):
            assert ids == hf_tok.encode(prompt), "tokenizer differs from transformers' GGUF tokenizer"
        lengths.add(len(ids))
        with torch.no_grad():
            ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                        eos_token_id=llm.tokenizer.eos_token_ids[0], pad_token_id=2)
        ref_new = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref_new, f"prompt {prompt!r}"
    assert len(lengths) == len(PROMPTS), "prompts must have different lengths"


def test_capital_of_france(smollm2):
    llm = LLM(smollm2, kv_cache_memory_bytes=64 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
