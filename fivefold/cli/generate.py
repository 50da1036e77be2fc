"""``fivefold generate``: text from a prompt, streamed."""

from __future__ import annotations

import sys
import time

from fivefold.cli import common


def add_parser(sub) -> None:
    """``fivefold generate``'s arguments."""
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    common.add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")
    common.add_sampling_args(gen, max_tokens=128)


def _stream_to_stdout(llm, prompt, params) -> tuple[int, float]:
    """Print the tokens as they come; return (tokens, decode tokens/s after the first)."""
    first = None
    num_tokens = 0
    for out in llm.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
        num_tokens += len(out.delta_token_ids)
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    end = time.perf_counter()
    decode_s = end - (first or end)
    return num_tokens, (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0


def run(args) -> int:
    params = common.sampling(args)
    llm = common.llm(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    num_tokens, tok_s = _stream_to_stdout(llm, prompt, params)
    if args.stats:
        print(f"{num_tokens} tokens, decode {tok_s:.1f} tok/s", file=sys.stderr)
    return 0
