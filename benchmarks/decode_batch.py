"""Decode tokens/s at several batch sizes, and the share of a decode step spent outside matmuls.

B requests of 128 prompt tokens each are prefilled, then ``--steps`` pure decode
steps are timed. The matmul share is the matmul kernels' time per step
(torch.profiler, over a few extra steps) divided by the unprofiled step time.

    .venv/bin/python benchmarks/decode_batch.py [--batches 1,8,32,64] [--steps 16] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.engine.config import EngineConfig  # noqa: E402
from fivefold.engine.llm_engine import LLMEngine  # noqa: E402
from fivefold.models import load_model  # noqa: E402
from fivefold.eval.text import corpus_ids  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.profile.ops import category_of_name  # noqa: E402
from fivefold.sampling_params import SamplingParams  # noqa: E402


def prompts_from_pydoc(num: int, length: int, tokenizer) -> list[list[int]]:
    ids = corpus_ids(tokenizer)
    stride = max(length, (len(ids) - length) // max(1, num))
    return [ids[i * stride: i * stride + length] for i in range(num)]


def matmul_ms_per_step(engine: LLMEngine, num_steps: int) -> float:
    """Matmul kernel time per step from torch.profiler. Only the kernels' own time is
    taken from the profiled run: the profiler's per-op overhead would inflate the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
    # The profiler's own op classes, so the streaming and int8 kernels (fivefold::stream_linear,
    # int8_weight_linear, ...) count as matmuls as they do in `fivefold profile`.
    mm_us = sum(e.self_cpu_time_total for e in prof.key_averages() if category_of_name(e.key) == "matmul")
    return mm_us / 1e3 / num_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    loaded = load_model(args.model, args.dtype)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = LLMEngine(loaded, EngineConfig(kv_cache_memory_bytes=2 << 30, max_num_seqs=max(64, batch)))
        params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        for p in prompts_from_pydoc(batch, 128, loaded.tokenizer):
            engine.add_request(p, params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()  # warm
        start = time.perf_counter()
        for _ in range(args.steps - 4):
            engine.step()
        step_s = (time.perf_counter() - start) / (args.steps - 4)
        share = min(1.0, matmul_ms_per_step(engine, 3) / (step_s * 1e3))
        rows.append({"batch": batch, "step_ms": round(step_s * 1e3, 2), "tok_s": round(batch / step_s, 1),
                     "matmul_share": round(share, 3), "outside_matmul_share": round(1 - share, 3)})
        del engine
    table = Table(title=f"decode steps, {args.model} {args.dtype}, 128-token prompts, {torch.get_num_threads()} threads")
    for col in ("batch", "step ms", "tok/s", "matmul share", "outside matmuls"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}", f"{r['matmul_share']:.0%}",
                      f"{r['outside_matmul_share']:.0%}")
    Console(width=120).print(table)
    print(json_line({"benchmark": "decode_batch", "model": args.model, "dtype": args.dtype, "results": rows}))


if __name__ == "__main__":
    main()
