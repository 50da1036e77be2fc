"""Speculative decoding against plain decoding, single stream, in one run on the same prompts.

Workload: fivefold.eval.text.copy_prompts, held-out pydoc passages followed by the same passage
begun again (continuing means copying: a rewrite, a quotation, an edit). Greedy, EOS kept,
``--max-tokens`` new tokens, one request at a time. Systems:

  fivefold          the engine's defaults (float32, C++ decode loop)
  fivefold-ngram    + speculative="ngram" (prompt lookup, k = --k)
  fivefold-draft    + speculative="draft": --draft DIR (the student `fivefold distill` writes), k = --draft-k
  llamacpp / llamacpp-lookup   llama-cpp-python on the built-in Q4_1 GGUF, plain and with its prompt
                    lookup (LlamaPromptLookupDecoding, num_pred_tokens = --k), when installed in
                    ~/peers/llamacpp (``../shared/PEERS.md``); skipped, and said so, otherwise

Speed: decode tokens/s of each request (new tokens after the first over first-to-last token
time), summed over the prompts: total tokens / total time; the best of two passes. Each fivefold
system's greedy tokens are compared with plain fivefold's (identical expected). The share of the
bandwidth roof is tok/s over (copy bandwidth / weight bytes per token): past 100% is what
speculation is for. The acceptance counters are the engine's (fivefold.engine.speculative).

    .venv/bin/python benchmarks/speculative.py [--num-prompts 4] [--max-tokens 128] [--draft DIR]

Prints the table and one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers import gguf_tensor_bytes, run_in_venv  # noqa: E402

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.eval.text import copy_prompts  # noqa: E402
from fivefold.models import load_model, resolve_model_path  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402
from fivefold.profile.roofline import measure_bandwidth  # noqa: E402

LLAMACPP_SCRIPT = r'''
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
spec = json.load(open(sys.argv[1]))
out = {}
for name, draft in (("llamacpp", None), ("llamacpp-lookup", LlamaPromptLookupDecoding(num_pred_tokens=spec["k"]))):
    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_ctx=2048, verbose=False, draft_model=draft)
    best = 0.0
    for _ in range(2):
        tokens = seconds = 0
        for prompt in spec["prompts"]:
            stamps = []
            for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                stamps.append(time.perf_counter())
                if len(stamps) == spec["max_tokens"] or tok == llm.token_eos():
                    break
            tokens += len(stamps) - 1
            seconds += stamps[-1] - stamps[0]
        best = max(best, tokens / seconds)
    out[name] = best
print("RESULT " + json.dumps(out), flush=True)
'''


def run_fivefold(loaded, prompts, max_tokens: int, draft=None, **options) -> dict:
    """Decode tok/s over the prompts (best of two passes), the greedy tokens, the spec counters."""
    from fivefold.eval.language import decode_rate
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams

    llm = LLM(loaded, draft=draft, max_num_seqs=1, kv_cache_memory_bytes=float(256 << 20), **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    best, tokens = 0.0, None
    for _ in range(2):
        outs = [llm.generate(p, params)[0] for p in prompts]
        num = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        seconds = sum((len(o.outputs[0].token_ids) - 1) / decode_rate([o]) for o in outs)
        best = max(best, num / seconds)
        tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.engine.stats()
    return {"tok_s": best, "tokens": tokens, "acceptance_rate": stats["spec_acceptance_rate"],
            "mean_accepted_length": stats["spec_mean_accepted_length"],
            "num_draft_tokens": stats["spec_num_draft_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="proposals per step (ngram, llama.cpp lookup)")
    ap.add_argument("--draft", default=None, help="draft model directory (fivefold distill --out DIR)")
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    loaded = load_model(DEFAULT_LLM)
    prompts = copy_prompts(loaded.tokenizer, args.num_prompts)
    weight_bytes = loaded.config.num_parameters() * 4
    bandwidth = measure_bandwidth()
    roof = bandwidth / weight_bytes  # float32 tokens/s when weights stream at the copy bandwidth
    results: dict[str, dict] = {}
    console.print(f"[bold]{len(prompts)} copy prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
                  f"{args.max_tokens} new tokens, copy bandwidth {bandwidth / 1e9:.1f} GB/s[/]")
    results["fivefold"] = run_fivefold(loaded, prompts, args.max_tokens)
    results["fivefold-ngram"] = run_fivefold(loaded, prompts, args.max_tokens, speculative="ngram",
                                             num_speculative_tokens=args.k)
    if args.draft:
        draft = load_model(args.draft)
        results["fivefold-draft"] = run_fivefold(loaded, prompts, args.max_tokens, draft=draft, speculative="draft",
                                                 num_speculative_tokens=args.draft_k)
    skipped = []
    if Path(args.llamacpp_python).exists():
        gguf = resolve_model_path(DEFAULT_LLM)
        try:
            peer = run_in_venv(Path(args.llamacpp_python), LLAMACPP_SCRIPT,
                               {"gguf": str(gguf), "threads": current_platform().num_cores, "k": args.k,
                                "prompts": prompts, "max_tokens": args.max_tokens}, timeout=900)
            for name, tok_s in peer.items():
                results[name] = {"tok_s": tok_s, "roof": bandwidth / gguf_tensor_bytes(gguf)}
        except Exception as exc:  # a broken peer install is reported, not fatal
            skipped.append(f"llama.cpp: {exc}")
    else:
        skipped.append(f"llama.cpp: not installed ({args.llamacpp_python})")

    base = results["fivefold"]
    table = Table(title="Speculative decoding, single stream, copy workload")
    for col in ("system", "tok/s", "x plain fivefold", "share of bandwidth roof", "acceptance", "tokens/verify",
                "greedy tokens"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in results.items():
        same = "" if "tokens" not in r else ("identical" if r["tokens"] == base["tokens"] else "DIFFER")
        spec = "mean_accepted_length" in r and r["num_draft_tokens"]
        table.add_row(name, f"{r['tok_s']:.1f}", f"{r['tok_s'] / base['tok_s']:.2f}x",
                      f"{r['tok_s'] / r.get('roof', roof):.0%}",
                      f"{r['acceptance_rate']:.0%}" if spec else "-",
                      f"{r['mean_accepted_length']:.2f}" if spec else "-", same)
    console.print(table)
    for line in skipped:
        console.print(f"skipped {line}")
    print(json_line({
        "benchmark": "speculative", "isa_level": current_platform().isa_level, "bandwidth_gbs": bandwidth / 1e9, "max_tokens": args.max_tokens,
        "num_prompts": len(prompts), "k": args.k,
        "results": {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in results.items()},
        "identical": {n: r["tokens"] == base["tokens"] for n, r in results.items() if "tokens" in r},
        "skipped": skipped}))


if __name__ == "__main__":
    main()
