"""Profiling an LLM on its serving path: engine steps, not a bare forward.

prefill: ``batch`` prompts of ``seq`` tokens each, computed in one engine step (the
step's token budget is raised to fit them) and one token sampled for each.
decode: ``batch`` sequences with ``seq``-token contexts, one new token each per step.
Prompts are cut from pydoc_data's English text (fivefold/eval/text.py); prefix caching is off so that every
iteration computes what it claims to. ``structured_output="json"`` constrains every decoding
sequence by :data:`PROFILE_SCHEMA` (a JSON object whose one string is long enough never to
close within the profiled steps), so the grammar mask runs each step.
"""

from __future__ import annotations

from fivefold.eval.text import corpus_ids, corpus_prompts
from fivefold.profile.profiler import ProfileReport, profile

MODES = ("prefill", "decode")
PROFILE_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 512}},
                  "required": ["text"], "additionalProperties": False}


def profile_llm(loaded, mode: str = "decode", batch: int = 1, seq: int = 128, num_iterations: int = 4,
                trace_path=None, peaks=None, structured_output: str = "none", **engine_options) -> ProfileReport:
    """Profile ``num_iterations`` engine steps of ``mode`` on ``loaded`` (a LoadedModel)."""
    from fivefold.engine.model_runner import kv_bytes_per_token
    from fivefold.errors import FivefoldError
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams, StructuredOutputs

    if mode not in MODES:
        raise FivefoldError(f"--mode must be one of {', '.join(MODES)}, got '{mode}'")
    if structured_output not in ("none", "json"):
        raise FivefoldError(f"--structured-output must be none or json, got '{structured_output}'")
    if structured_output != "none" and mode != "decode":
        raise FivefoldError("--structured-output applies to --mode decode (a prefill step samples once)")
    if batch < 1 or seq < 1 or num_iterations < 1:
        raise FivefoldError("--batch, --seq and --iterations must be >= 1")
    if seq + num_iterations * 3 + 8 > loaded.config.max_model_len:
        raise FivefoldError(f"--seq {seq} does not fit the model's context of {loaded.config.max_model_len} tokens")
    engine_options.setdefault("enable_prefix_caching", False)
    engine_options.setdefault("max_num_seqs", max(batch, 1))
    engine_options.setdefault("max_num_batched_tokens", max(2048, batch * seq))
    token_bytes = kv_bytes_per_token(loaded.model, engine_options.get("kv_cache_dtype", "auto"))
    engine_options.setdefault("kv_cache_memory_bytes", float(max(256 << 20, 2 * batch * (seq + 64) * token_bytes)))
    llm = LLM(loaded, **engine_options)
    engine = llm.engine
    ids = corpus_ids(llm.tokenizer)
    seeds = iter(range(1_000_000))
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    label = f"{mode}, batch {batch}, {seq} tokens"

    if mode == "prefill":
        def step():
            for prompt in corpus_prompts(ids, batch, seq, seed=next(seeds)):
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            engine.step()
            assert not engine.has_unfinished, "the prefill did not fit one step"

        return profile(step, num_iterations=num_iterations, num_warmup=1, dtype=dtype, label=label,
                       trace_path=trace_path, peaks=peaks)

    warmup = 2
    grammar = StructuredOutputs(json=PROFILE_SCHEMA) if structured_output == "json" else None
    params = SamplingParams(temperature=0, max_tokens=2 * (num_iterations + warmup) + 2, ignore_eos=True,
                            structured_outputs=grammar)
    if grammar is not None:
        engine.warm_up_structured_output()
        label += ", JSON-constrained"
    for prompt in corpus_prompts(ids, batch, seq):
        engine.add_request(prompt, params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything first: the profiled steps are pure decode
    return profile(engine.step, num_iterations=num_iterations, num_warmup=warmup, dtype=dtype, label=label,
                   trace_path=trace_path, peaks=peaks)

