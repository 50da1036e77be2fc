"""What several commands share: the model and engine options, the sampling options, and
the engine they make."""

from __future__ import annotations

import argparse

from fivefold.errors import FivefoldError
from fivefold.models.registry import DEFAULT_LLM


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_LLM, help=f"built-in name, HF directory or GGUF file (default {DEFAULT_LLM})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["w8a16", "w4a16", "w4a8", "gguf"],
                   help="w8a16: int8 weights (one scale per output channel) quantized tensor by tensor while "
                        "loading; w4a16: 4-bit weights (groups of 128 with a minimum, round to nearest; the LM "
                        "head 8-bit) times float activations; w4a8: the same weights times int8 activations "
                        "(per row and block of 32, integer dot products: faster); gguf: a GGUF file's Q4_0/Q4_1 "
                        "blocks served as they are, times int8 activations as llama.cpp does (dequantized to "
                        "--dtype otherwise). Calibrated schemes: fivefold quantize. A GGUF's Q8_0 tensors stay int8 anyway")
    p.add_argument("--kv-cache-memory-bytes", type=float, default=None,
                   help="KV cache pool in bytes (default 1 GiB)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV cache pool as a share of the available RAM, in (0, 1] (instead of bytes)")
    p.add_argument("--kv-cache-memory", dest="renamed_kv_cache_memory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output of one request (default: the model's context)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: torch's, one per core)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--preallocation", default="none", choices=["none", "full", "predicted"])
    p.add_argument("--weight-layout", default="packed", choices=["packed", "dense"],
                   help="packed: oneDNN-reordered projection weights (default); dense: plain nn.Linear")
    p.add_argument("--decode-attention", default="kernel", choices=["kernel", "torch"],
                   help="kernel: the C++ paged decode kernel (default); torch: gather + SDPA")
    p.add_argument("--prefill-attention", default="sdpa", choices=["sdpa", "tiled"],
                   help="sdpa: PyTorch's flash-attention kernel (default); tiled: fivefold.models.tiled_attention")
    p.add_argument("--hot-path", default="fused", choices=["fused", "eager"],
                   help="fused: add+RMSNorm, SiLU*up and RoPE as one C++ kernel each (default); eager: PyTorch ops")
    p.add_argument("--decode-loop", default="cpp", choices=["cpp", "python"],
                   help="cpp: a decode step's layer loop in one C++ call where the model allows (default); "
                        "python: the modules' forward")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: ngram (prompt lookup) or draft (--draft-model proposes); default off")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step (1-16)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram the ngram proposer matches")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram the ngram proposer matches")
    p.add_argument("--draft-model", default=None,
                   help="the draft of --speculative draft: a model with the target's tokenizer (e.g. the "
                        "directory `fivefold distill --out DIR` writes)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="auto: keys and values in the model's dtype (default); int8: per-row int8 with a "
                        "float32 scale, ~3.8x the tokens per byte at head_dim 64 (float32 model)")
    p.add_argument("--grammar-budget", type=float, default=5.0,
                   help="seconds of grammar work (compile and token masks) one structured-output request may "
                        "use before it ends with an error naming the budget (default 5)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def sampling(args):
    from fivefold.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)


def engine_options(args) -> dict:
    if args.renamed_kv_cache_memory is not None:
        raise FivefoldError("--kv-cache-memory was split in two: --kv-cache-memory-bytes B or "
                            "--kv-cache-memory-fraction F (a share of the available RAM, in (0, 1])")
    return dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
                preallocation=args.preallocation, weight_layout=args.weight_layout,
                decode_attention=args.decode_attention, hot_path=args.hot_path,
                prefill_attention=args.prefill_attention, decode_loop=args.decode_loop,
                speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                draft_model=args.draft_model, kv_cache_dtype=args.kv_cache_dtype,
                grammar_budget_s=args.grammar_budget)


def set_threads(args) -> None:
    """``--threads``: torch's compute threads, before any model work."""
    if args.threads is not None:
        if args.threads < 1:
            raise FivefoldError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def llm(args):
    from fivefold.llm import LLM

    set_threads(args)
    return LLM(args.model, dtype=args.dtype, quantization=args.quantization, **engine_options(args))
