"""Single-stream decode speed: `fivefold generate`'s engine path vs transformers' generate.

Both run in this process on the same dequantized weights of the default model
(transformers dequantizes the GGUF itself), greedy, the same prompt, the same
number of new tokens. Decode tokens/s excludes the prefill: ours is timed from the
first streamed token to the last; transformers' as (t(N tokens) - t(1 token)) / (N-1).
GB/s is the weight bytes one decode step reads (every parameter once; the tied
embedding/LM head once) times tokens/s: how close decode is to the memory bandwidth.

    .venv/bin/python benchmarks/decode.py [--model M] [--dtypes float32,bfloat16] [--tokens 128] [--repeats 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.llm import LLM  # noqa: E402
from fivefold.models import load_model, resolve_model_path  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.sampling_params import SamplingParams  # noqa: E402

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def weight_bytes(loaded) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied embedding
    and LM head once: the step reads one embedding row and the whole head)."""
    return loaded.config.num_parameters() * loaded.model.dtype.itemsize


def ours_decode_tok_s(llm: LLM, prompt_ids: list[int], num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    first = last = None
    count = 0
    for out in llm.stream(prompt_ids, params):
        now = time.perf_counter()
        first = first or now
        last = now
        count += len(out.delta_token_ids)
    assert count == num_tokens
    return (num_tokens - 1) / (last - first)


def hf_decode_tok_s(model, prompt_ids: list[int], num_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        assert out.shape[1] == len(prompt_ids) + n
        return time.perf_counter() - start

    return (num_tokens - 1) / (run(num_tokens) - run(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = resolve_model_path(args.model)

    def load_hf(dtype: torch.dtype):
        if path.suffix == ".gguf":
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()

    rows = []
    for dtype in args.dtypes.split(","):
        llm = LLM(load_model(args.model, dtype), kv_cache_memory_bytes=256 << 20)
        prompt_ids = llm.chat_prompt([{"role": "user", "content": QUESTION}])
        hf = load_hf(getattr(torch, dtype))
        ours_decode_tok_s(llm, prompt_ids, 8)  # warm-up
        hf_decode_tok_s(hf, prompt_ids, 8)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine state
            ours.append(ours_decode_tok_s(llm, prompt_ids, args.tokens))
            theirs.append(hf_decode_tok_s(hf, prompt_ids, args.tokens))
        nbytes = weight_bytes(llm.loaded)
        o, t = statistics.median(ours), statistics.median(theirs)
        rows.append({
            "dtype": dtype, "prompt_tokens": len(prompt_ids), "new_tokens": args.tokens,
            "fivefold_tok_s": round(o, 2), "transformers_tok_s": round(t, 2), "speedup": round(o / t, 3),
            "weight_bytes": nbytes, "fivefold_weight_GB_s": round(nbytes * o / 1e9, 2),
            "transformers_weight_GB_s": round(nbytes * t / 1e9, 2),
        })
        del llm, hf

    table = Table(title=f"single-stream decode, {args.model}, {torch.get_num_threads()} threads (median of {args.repeats})")
    for col in ("dtype", "fivefold tok/s", "transformers tok/s", "speedup", "weights MB", "fivefold GB/s", "transformers GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["dtype"], f"{r['fivefold_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['weight_bytes'] / 1e6:.0f}", f"{r['fivefold_weight_GB_s']:.1f}", f"{r['transformers_weight_GB_s']:.1f}")
    Console(width=130).print(table)
    print(json_line({"benchmark": "decode_single_stream", "model": args.model, "results": rows}))


if __name__ == "__main__":
    main()
