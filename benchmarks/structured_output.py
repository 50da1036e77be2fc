"""Structured output: the grammar engines' cost on this CPU, and what a constraint costs a decode step.

1. Engines, on the default model's tokenizer (49,152 tokens) and a nested JSON schema: schema
   compile time, the one-time tokenizer set-up, and the per-token mask (median over the
   tokens of a valid instance, each mask computed then applied to a logits row). llguidance
   (the engine fivefold uses) and, when importable, xgrammar (not a dependency: put it on
   PYTHONPATH to compare, e.g. `pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi`).
2. Engine path: sampled decode tokens/s at batch 1 and 8, unconstrained against every row
   constrained (the same prompt, its KV blocks in the prefix cache so that both runs are
   decode, and the same number of tokens: the constraint is fivefold profile's JSON object
   whose string cannot close within them); then the validity rate of outputs constrained by
   the nested schema (json.loads + jsonschema), sampled, until the grammar ends them.

    .venv/bin/python benchmarks/structured_output.py [--tokens 64]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.llm import LLM  # noqa: E402
from fivefold.models import load_model  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.profile.llm_profile import PROFILE_SCHEMA  # noqa: E402
from fivefold.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                 "zip": {"type": "string", "maxLength": 10}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "W1"}}


def time_llguidance(hf, vocab_size: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
    setup = time.perf_counter() - start
    warm = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'))
    mask = lt.allocate_token_bitmask(1, vocab_size)
    start = time.perf_counter()
    lt.fill_next_token_bitmask(warm, mask, 0)  # the one-time first mask of a tokenizer
    setup += time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": True}))
    compile_s = time.perf_counter() - start
    logits, times = torch.randn(1, vocab_size), []
    for token in ids:
        start = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        lt.apply_token_bitmask_inplace(logits, mask)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return {"engine": "llguidance", "version": getattr(llguidance, "__version__", "?"), "setup_s": setup,
            "compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(times) * 1e6,
            "mask_us_max": max(times) * 1e6}


def time_xgrammar(hf, vocab_size: int, ids: list[int]) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size),
                                   max_threads=torch.get_num_threads())
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    compile_s = time.perf_counter() - start
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size)
    logits, times = torch.randn(1, vocab_size), []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    return {"engine": "xgrammar", "version": getattr(xgr, "__version__", "?"), "setup_s": setup,
            "compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(times) * 1e6,
            "mask_us_max": max(times) * 1e6}


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, outs


def main() -> None:
    import jsonschema
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    args = ap.parse_args()

    loaded = load_model(args.model)
    hf, vocab_size = loaded.tokenizer.hf, loaded.config.vocab_size
    ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
    engines = [r for r in (time_llguidance(hf, vocab_size, ids), time_xgrammar(hf, vocab_size, ids)) if r]

    llm = LLM(loaded, kv_cache_memory_bytes=float(256 << 20))
    llm.engine.warm_up_structured_output()
    question = "Describe a person (name, age, tags, address) as JSON."
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    rows = []
    for batch in (1, 8):
        prompts = [prompt] * batch
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up; the prompt is now cached
        rates = {}
        for name, grammar in (("unconstrained", None), ("constrained", StructuredOutputs(json=PROFILE_SCHEMA))):
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens, ignore_eos=True,
                                     structured_outputs=grammar) for i in range(batch)]
            rates[name], outs = decode_rate(llm, prompts, params)
            assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        # validity: the nested schema, sampled; its bounded strings and arrays make every output close
        outs = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=i, max_tokens=4 * args.tokens,
                                                     structured_outputs=StructuredOutputs(json=SCHEMA))
                                      for i in range(batch)])
        valid = 0
        for o in outs:
            try:
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        rows.append({"batch": batch, "unconstrained_tok_s": rates["unconstrained"],
                     "constrained_tok_s": rates["constrained"],
                     "step_cost_share": 1 - rates["constrained"] / rates["unconstrained"], "valid": valid,
                     "num_outputs": len(outs), "mean_tokens": statistics.mean(len(o.outputs[0].token_ids) for o in outs)})

    console = Console(width=140)
    table = Table(title=f"grammar engines on {args.model}'s tokenizer ({vocab_size} tokens), {len(ids)}-token instance")
    for col in ("engine", "version", "tokenizer set-up s", "schema compile ms", "mask us (median)", "mask us (max)"):
        table.add_column(col, justify="right")
    for e in engines:
        table.add_row(e["engine"], str(e["version"]), f"{e['setup_s']:.2f}", f"{e['compile_ms']:.2f}",
                      f"{e['mask_us_median']:.0f}", f"{e['mask_us_max']:.0f}")
    console.print(table)
    if len(engines) == 1:
        console.print("xgrammar is not importable here: only llguidance measured")
    table = Table(title=f"sampled decode, {args.tokens} tokens per row, every row JSON-constrained (llguidance) or "
                        "none; validity over the nested schema")
    for col in ("batch", "unconstrained tok/s", "constrained tok/s", "cost", "valid (nested schema)",
                "mean tokens (nested)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['unconstrained_tok_s']:.1f}", f"{r['constrained_tok_s']:.1f}",
                      f"{r['step_cost_share']:.1%}", f"{r['valid']}/{r['num_outputs']}", f"{r['mean_tokens']:.0f}")
    console.print(table)
    print(json_line({"benchmark": "structured_output", "engines": engines, "decode": rows}))


if __name__ == "__main__":
    main()
