"""llama.cpp's single-stream decode rate on one GGUF file, measured in llama-cpp-python's own venv.

Run with the peer's interpreter (``~/peers/llamacpp/bin/python``, ../shared/PEERS.md); it imports
llama_cpp and numpy only, never fivefold. ``benchmarks/peers.py`` and ``benchmarks/scale.py`` run
it. Greedy, EOS masked, the prompt's prefill excluded; two measurements of the same decode:

  decode_tok_s    llama.cpp's C API in a loop: ``llama_decode`` of one token, the EOS logit set to
                  -inf, argmax over the logits. This is the per-token work of llama-cli's and
                  llama-server's greedy path (their samplers run in C++): the rate a user of
                  llama.cpp itself gets, and the one fivefold is compared with.
  generate_tok_s  ``Llama.generate`` with a logits processor masking EOS: what a Python user of
                  llama-cpp-python gets. Its sampler runs in Python over the whole vocabulary (about
                  2.5 ms a token more on SmolLM2's 49,152 logits, measured on Sapphire Rapids), which
                  is a large share of a 135M model's token and none of an 8B one's.

Each rate is the best of ``--repeats`` runs after a warm-up (as peers.py does for fivefold).

    ~/peers/llamacpp/bin/python benchmarks/llamacpp_decode.py MODEL.gguf --prompt IDS.json --new 64

Prints one JSON line: load_s, peak_rss_load, peak_rss (VmHWM, bytes), decode_tok_s,
decode_tok_s_samples, generate_tok_s, generate_tok_s_samples, and each path's tokens of its first
run (decode_tokens, generate_tokens: the same greedy decode, so the same tokens).

On Sapphire Rapids VMs, a llama-cpp-python built with ``-march=native`` crashes in
``ggml_backend_amx_mul_mat`` on the first decode; build it without AMX (PEERS notes in README.md).
"""

from __future__ import annotations

import argparse
import json
import time


def peak_rss() -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", required=True, help="a JSON file holding the prompt's token ids")
    ap.add_argument("--new", type=int, default=64, help="new tokens per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-generate", action="store_true", help="the C API loop only")
    args = ap.parse_args()

    import numpy as np
    import llama_cpp.llama_cpp as C
    from llama_cpp import Llama

    with open(args.prompt) as f:
        prompt = [int(t) for t in json.load(f)]
    start = time.perf_counter()
    llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.n_ctx,
                verbose=False)
    load_s = time.perf_counter() - start
    rss_load = peak_rss()
    ctx, n_vocab, eos = llm._ctx.ctx, llm.n_vocab(), llm.token_eos()

    def c_loop(n: int, out: list[int]) -> float:
        llm.reset()
        C.llama_memory_clear(C.llama_get_memory(ctx), True)
        tokens = (C.llama_token * len(prompt))(*prompt)
        if C.llama_decode(ctx, C.llama_batch_get_one(tokens, len(prompt))) != 0:
            raise SystemExit("llama_decode failed on the prompt")
        one = (C.llama_token * 1)()
        stamps = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            logits[eos] = -np.inf
            one[0] = int(logits.argmax())
            out.append(one[0])
            stamps.append(time.perf_counter())  # a token is out: the same point generate yields it
            if C.llama_decode(ctx, C.llama_batch_get_one(one, 1)) != 0:
                raise SystemExit("llama_decode failed")
        return (n - 1) / (stamps[-1] - stamps[0])

    def no_eos(ids, logits):
        logits[eos] = -np.inf
        return logits

    def generate(n: int, out: list[int]) -> float:
        llm.reset()
        stamps = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, logits_processor=[no_eos], reset=True):
            stamps.append(time.perf_counter())
            out.append(int(token))
            if len(stamps) == n:
                break
        return (n - 1) / (stamps[-1] - stamps[0])

    c_loop(8, [])
    tokens: list[int] = []
    decode = [c_loop(args.new, tokens if i == 0 else []) for i in range(args.repeats)]
    result = {"load_s": load_s, "peak_rss_load": rss_load, "decode_tok_s": max(decode),
              "decode_tok_s_samples": decode, "decode_tokens": tokens}
    if not args.no_generate:
        generate(8, [])
        tokens = []
        gen = [generate(args.new, tokens if i == 0 else []) for i in range(args.repeats)]
        result.update(generate_tok_s=max(gen), generate_tok_s_samples=gen, generate_tokens=tokens)
    result["peak_rss"] = peak_rss()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
