"""The int8 KV cache against the float32 one, in one run: capacity, long-context decode, quality.

SmolLM2-135M (float32 weights), the engine's defaults otherwise:

  capacity     tokens of KV cache per GiB of kv_cache_memory_bytes (ModelRunner's pool)
  decode @2k   single-stream decode tok/s of a --context-token held-out prompt (64 new tokens,
               greedy, EOS ignored; best of two runs), and the same for --batch sequences at once
  quality      teacher-forced through the paged cache (prompt logprobs, 64-token chunks so every
               chunk after the first reads its context from the cache): held-out perplexity and
               top-1 agreement with the float cache over --windows 256-token windows

llama.cpp (``~/peers/llamacpp``, ``../shared/PEERS.md``) on the built-in Q4_1 GGUF with its f16 and
q8_0 KV caches (flash attention on, which its quantized V cache needs), decode at the same context,
when installed; skipped, and said so, otherwise.

    .venv/bin/python benchmarks/kv_cache_int8.py [--context 2048] [--batch 4] [--windows 16]

Prints the table and one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers import run_in_venv  # noqa: E402

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.eval.language import engine_teacher_forced, entries_perplexity, top1_agreement  # noqa: E402
from fivefold.eval.text import corpus_ids, corpus_prompts, text_windows  # noqa: E402
from fivefold.models import load_model, resolve_model_path  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402

GIB = 1 << 30
NEW_TOKENS = 64

LLAMACPP_SCRIPT = r'''
import json, sys, time
import numpy as np
from llama_cpp import Llama
spec = json.load(open(sys.argv[1]))
out = {}
for name, kv_type in (("llamacpp-f16-kv", 1), ("llamacpp-q8_0-kv", 8)):
    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_ctx=spec["n_ctx"], verbose=False,
                flash_attn=True, type_k=kv_type, type_v=kv_type)
    eos = llm.token_eos()
    def no_eos(ids, logits):
        logits[eos] = -np.inf
        return logits
    best = 0.0
    for _ in range(2):
        stamps = []
        for tok in llm.generate(spec["prompt"], temp=0.0, top_k=1, logits_processor=[no_eos], reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == spec["new"]:
                break
        best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    out[name] = best
    del llm
print("RESULT " + json.dumps(out), flush=True)
'''


def decode_tok_s(loaded, prompts, kv_cache_dtype: str) -> float:
    from fivefold.eval.language import decode_rate
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams

    # Every prompt prefilled in the first step, so the decode span holds decode steps only.
    llm = LLM(loaded, kv_cache_dtype=kv_cache_dtype, max_num_seqs=len(prompts), enable_prefix_caching=False,
              kv_cache_memory_bytes=float(GIB), max_num_batched_tokens=sum(map(len, prompts)))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return max(decode_rate(llm.generate(prompts, params)) for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of the long-context decode")
    ap.add_argument("--batch", type=int, default=4, help="sequences of the batched long-context decode")
    ap.add_argument("--windows", type=int, default=16, help="held-out 256-token windows of the quality check")
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.model_runner import kv_bytes_per_token, kv_pool_num_blocks

    console = Console(width=160)
    loaded = load_model(DEFAULT_LLM)
    results: dict[str, dict] = {}
    prompts = corpus_prompts(corpus_ids(loaded.tokenizer, "heldout"), args.batch, args.context, seed=0)
    windows = text_windows(loaded.tokenizer, "heldout", args.windows, 256, seed=1)
    entries = {}
    for dtype in ("auto", "int8"):
        config = EngineConfig(kv_cache_dtype=dtype, kv_cache_memory_bytes=GIB)
        name = "float32 KV" if dtype == "auto" else "int8 KV"
        results[name] = {"tokens_per_gib": kv_pool_num_blocks(loaded.model, config) * config.block_size,
                         "bytes_per_token": kv_bytes_per_token(loaded.model, dtype)}
        console.print(f"  {name}: decode at {args.context} tokens ...")
        results[name]["decode_single"] = decode_tok_s(loaded, prompts[:1], dtype)
        results[name]["decode_batch"] = decode_tok_s(loaded, prompts, dtype)
        entries[dtype] = engine_teacher_forced(loaded, windows, kv_cache_dtype=dtype)
        results[name]["perplexity"] = entries_perplexity(entries[dtype])
    results["int8 KV"]["top1_agreement"] = top1_agreement(entries["auto"], entries["int8"])
    skipped = []
    if Path(args.llamacpp_python).exists():
        try:
            peer = run_in_venv(Path(args.llamacpp_python), LLAMACPP_SCRIPT,
                               {"gguf": str(resolve_model_path(DEFAULT_LLM)), "threads": current_platform().num_cores,
                                "n_ctx": args.context + NEW_TOKENS + 16, "prompt": prompts[0], "new": NEW_TOKENS},
                               timeout=900)
            for name, tok_s in peer.items():
                results[name] = {"decode_single": tok_s}
        except Exception as exc:  # a broken peer install is reported, not fatal
            skipped.append(f"llama.cpp: {exc}")
    else:
        skipped.append(f"llama.cpp: not installed ({args.llamacpp_python})")

    f, q = results["float32 KV"], results["int8 KV"]
    table = Table(title=f"KV cache: float32 vs int8 (SmolLM2, float32 weights), decode at {args.context} tokens")
    for col in ("cache", "KV bytes/token", "tokens per GiB", f"decode tok/s, 1 x {args.context}",
                f"decode tok/s, {args.batch} x {args.context}", "held-out ppl (chunked, teacher-forced)",
                "top-1 agreement"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for name, r in results.items():
        table.add_row(name, f"{r['bytes_per_token']:,}" if "bytes_per_token" in r else "-",
                      f"{r['tokens_per_gib']:,}" if "tokens_per_gib" in r else "-",
                      f"{r['decode_single']:.1f}", f"{r['decode_batch']:.1f}" if "decode_batch" in r else "-",
                      f"{r['perplexity']:.4f}" if "perplexity" in r else "-",
                      f"{r['top1_agreement']:.2%}" if "top1_agreement" in r else "-")
    console.print(table)
    console.print(f"int8 / float32: {q['tokens_per_gib'] / f['tokens_per_gib']:.2f}x tokens per GiB, decode "
                  f"{q['decode_single'] / f['decode_single']:.2f}x (1 seq), {q['decode_batch'] / f['decode_batch']:.2f}x "
                  f"({args.batch} seqs), perplexity {q['perplexity'] / f['perplexity'] - 1:+.3%}")
    for line in skipped:
        console.print(f"skipped {line}")
    print(json_line({"benchmark": "kv_cache_int8", "context": args.context, "batch": args.batch,
                     "windows": args.windows, "results": results, "skipped": skipped,
                     "ratios": {"tokens_per_gib": q["tokens_per_gib"] / f["tokens_per_gib"],
                                "decode_single": q["decode_single"] / f["decode_single"],
                                "decode_batch": q["decode_batch"] / f["decode_batch"],
                                "perplexity": q["perplexity"] / f["perplexity"] - 1}}))


if __name__ == "__main__":
    main()
