"""Offline throughput: Fivefold against transformers, one run, same weights (float32).

Workloads, 64 prompts cut from pydoc_data.topics (fixed seed):
  (a) uniform: 128 prompt tokens, 128 output tokens, EOS ignored;
  (b) mixed: prompt lengths 16-512, output lengths 16-256, EOS ignored.
Systems:
  hf-one-at-a-time  transformers generate, one request at a time (a fixed subset of --subset requests; its rate is reported)
  hf-padded-batch   transformers generate, all 64 as one left-padded batch, run to the longest output
  fivefold          LLM.generate on the continuous-batching engine
Throughput counts requested output tokens only (a padded batch's extra tokens are waste).

    .venv/bin/python benchmarks/offline_throughput.py [--workloads a,b] [--subset 8] [--skip-hf-batch]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.eval.text import corpus_ids  # noqa: E402
from fivefold.llm import LLM  # noqa: E402
from fivefold.models import load_model, resolve_model_path  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.sampling_params import SamplingParams  # noqa: E402

NUM_PROMPTS = 64


def workload(name: str, ids: list[int], seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(NUM_PROMPTS):
        if name == "a":
            plen, olen = 128, 128
        else:
            plen, olen = rng.randint(16, 512), rng.randint(16, 256)
        start = rng.randrange(0, len(ids) - plen)
        requests.append((ids[start:start + plen], olen))
    return requests


def run_fivefold(llm: LLM, requests) -> float:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, show_progress=True)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in requests]
    return elapsed


def run_hf_one_at_a_time(model, requests) -> float:
    start = time.perf_counter()
    for prompt, olen in requests:
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=olen, min_new_tokens=olen, do_sample=False,
                           pad_token_id=2)
    return time.perf_counter() - start


def run_hf_padded_batch(model, requests) -> float:
    width = max(len(p) for p, _ in requests)
    ids = torch.full((len(requests), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, _) in enumerate(requests):  # left padding, as decoder-only generation needs
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    longest = max(o for _, o in requests)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=2)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--workloads", default="a,b")
    ap.add_argument("--subset", type=int, default=8, help="requests run by the one-at-a-time baseline")
    ap.add_argument("--skip-hf-batch", action="store_true")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = resolve_model_path(args.model)
    hf = (AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
          if path.suffix == ".gguf" else AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)).eval()
    llm = LLM(load_model(args.model, "float32"), kv_cache_memory_bytes=4 << 30)
    ids = corpus_ids(llm.tokenizer)

    results = []
    for name in args.workloads.split(","):
        requests = workload(name, ids)
        total_out = sum(o for _, o in requests)
        row = {"workload": name, "num_requests": len(requests), "output_tokens": total_out,
               "prompt_tokens": sum(len(p) for p, _ in requests)}
        llm.engine.kv_cache.reset_prefix_cache()  # no carry-over between workloads
        before = llm.engine.stats()
        t = run_fivefold(llm, requests)
        row["fivefold_tok_s"] = round(total_out / t, 1)
        subset = requests[: args.subset]
        t = run_hf_one_at_a_time(hf, subset)
        row["hf_one_at_a_time_tok_s"] = round(sum(o for _, o in subset) / t, 1)
        if not args.skip_hf_batch:
            t = run_hf_padded_batch(hf, requests)
            row["hf_padded_batch_tok_s"] = round(total_out / t, 1)
            row["vs_padded_batch"] = round(row["fivefold_tok_s"] / row["hf_padded_batch_tok_s"], 2)
        row["vs_one_at_a_time"] = round(row["fivefold_tok_s"] / row["hf_one_at_a_time_tok_s"], 2)
        after = llm.engine.stats()
        row["engine_stats"] = {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                                 "num_preemptions")}
        results.append(row)

    table = Table(title=f"offline throughput, {args.model} float32, {NUM_PROMPTS} prompts, output tokens/s")
    for col in ("workload", "fivefold", "hf one-at-a-time", "hf padded batch", "vs one-at-a-time", "vs padded batch"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["workload"], f"{r['fivefold_tok_s']:.1f}", f"{r['hf_one_at_a_time_tok_s']:.1f}",
                      f"{r.get('hf_padded_batch_tok_s', float('nan')):.1f}", f"{r['vs_one_at_a_time']:.1f}x",
                      f"{r.get('vs_padded_batch', float('nan')):.2f}x")
    Console(width=130).print(table)
    print(json_line({"benchmark": "offline_throughput", "model": args.model, "results": results}))


if __name__ == "__main__":
    main()
