"""Prefix cache: 64 requests sharing a 512-token system prompt, each with its own
32-token question, all arriving at once; the engine with and without the prefix cache.

Reports median TTFT, prefill tokens actually computed, and total time, float32.

    .venv/bin/python benchmarks/prefix_cache.py [--requests 64] [--system-tokens 512] [--question-tokens 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.engine.config import EngineConfig  # noqa: E402
from fivefold.engine.llm_engine import LLMEngine  # noqa: E402
from fivefold.models import load_model  # noqa: E402
from fivefold.eval.text import corpus_ids  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.sampling_params import SamplingParams  # noqa: E402


def run(loaded, prompts: list[list[int]], enable_prefix_caching: bool, max_tokens: int) -> dict:
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory_bytes=4 << 30, enable_prefix_caching=enable_prefix_caching))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    ttfts, outputs = [], {}
    while engine.has_unfinished:
        outs = engine.step()
        for o in outs:
            if len(o.outputs[0].token_ids) == 1:
                ttfts.append(o.metrics.ttft)
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    computed = stats["prefix_cache_queries"] - stats["prefix_cache_hits"]
    return {"prefix_cache": enable_prefix_caching, "median_ttft_s": round(statistics.median(ttfts), 3),
            "p90_ttft_s": round(sorted(ttfts)[int(0.9 * len(ttfts)) - 1], 3),
            "prefill_tokens_computed": computed, "prompt_tokens": stats["prefix_cache_queries"],
            "total_s": round(elapsed, 2), "outputs": [outputs[k] for k in sorted(outputs)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    loaded = load_model(args.model, "float32")
    ids = corpus_ids(loaded.tokenizer)
    rng = random.Random(0)
    system = ids[: args.system_tokens]
    prompts = []
    for _ in range(args.requests):
        start = rng.randrange(args.system_tokens, len(ids) - args.question_tokens)
        prompts.append(system + ids[start:start + args.question_tokens])
    without = run(loaded, prompts, False, args.max_tokens)
    with_cache = run(loaded, prompts, True, args.max_tokens)
    assert with_cache["outputs"] == without["outputs"], "the prefix cache changed greedy outputs"
    table = Table(title=f"{args.requests} requests, {args.system_tokens}-token shared system prompt + "
                        f"{args.question_tokens}-token question, {args.max_tokens} output tokens")
    for col in ("prefix cache", "median TTFT s", "p90 TTFT s", "prefill tokens computed", "total s"):
        table.add_column(col, justify="right")
    for r in (without, with_cache):
        table.add_row("on" if r["prefix_cache"] else "off", f"{r['median_ttft_s']:.2f}", f"{r['p90_ttft_s']:.2f}",
                      f"{r['prefill_tokens_computed']} / {r['prompt_tokens']}", f"{r['total_s']:.1f}")
    Console(width=130).print(table)
    ratio = without["median_ttft_s"] / with_cache["median_ttft_s"]
    print(f"median TTFT speedup with the prefix cache: {ratio:.1f}x")
    for r in (without, with_cache):
        del r["outputs"]
    print(json_line({"benchmark": "prefix_cache", "model": args.model, "ttft_speedup": round(ratio, 2),
                      "results": [without, with_cache]}))


if __name__ == "__main__":
    main()
