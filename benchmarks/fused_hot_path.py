"""The LLM hot path's fused elementwise chains: per op, and in the engine.

1. Per op, on SmolLM2's shapes at 1 and 32 tokens (float32, microseconds per call):
   eager PyTorch, our C++ kernels (fivefold/kernels/fused_ops.cpp) and torch.compile
   (inductor) of the same eager code, in the same run. The faster of ours and
   torch.compile is what the engine's ``hot_path="fused"`` uses.
2. In the engine: decode tokens/s at batch 1 and 32, ``hot_path`` eager vs fused, each
   measured twice in alternation (best of two: the first oneDNN calls of a shape JIT).

    .venv/bin/python benchmarks/fused_hot_path.py [--batches 1,32] [--output-len 64] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.bench.offline_bench import make_config, run_offline  # noqa: E402
from fivefold.kernels import fused_ops  # noqa: E402
from fivefold.models import load_model  # noqa: E402
from fivefold.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402


def _us_per_call(fn, num_calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - start) / num_calls * 1e6


def op_rows(config, use_compile: bool) -> list[dict]:
    hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    rows = []
    for tokens in (1, 32):
        x, res = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        # The fused norm works in place: it gets scratch copies (repeated calls keep values finite).
        x_scratch, res_scratch = x.clone(), res.clone()
        norm = RMSNorm(hidden, config.rms_norm_eps)
        act = SiluAndMul()
        gate_up = torch.randn(tokens, 2 * config.intermediate_size)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        cos_sin = (torch.randn(tokens, 1, dim // 2), torch.randn(tokens, 1, dim // 2))
        cases = {
            "add + RMSNorm": (lambda: norm(x, res), lambda: norm(x_scratch, res_scratch)),
            "SiLU * up": (lambda: act(gate_up), lambda: act(gate_up)),
            "RoPE q and k": (lambda: RotaryEmbedding.apply(cos_sin, q, k),
                             lambda: RotaryEmbedding.apply(cos_sin, q, k, ops=fused_ops())),
        }
        for name, (eager, _) in cases.items():
            eager_us = _us_per_call(eager)
            # ours: the same modules with the kernel switched on (norm and act read use_fused)
            norm.use_fused = act.use_fused = True
            ours_fn = cases[name][1]
            ours_us = _us_per_call(ours_fn)
            norm.use_fused = act.use_fused = False
            compiled_us = None
            if use_compile:
                compiled = torch.compile(eager, dynamic=False)
                compiled()
                compiled_us = _us_per_call(compiled)
            rows.append({"op": name, "tokens": tokens, "eager_us": eager_us, "fused_kernel_us": ours_us,
                         "torch_compile_us": compiled_us})
    return rows


def engine_rows(model: str, batches: list[int], output_len: int) -> list[dict]:
    loaded = load_model(model, "float32")
    rows = []
    for batch in batches:
        best = {}
        for _ in range(2):
            for hot_path in ("eager", "fused"):
                config = make_config(model, workload="throughput", num_requests=batch, input_len=64,
                                     output_len=output_len, hot_path=hot_path, kv_cache_memory_bytes=1 << 30)
                result = run_offline(config, loaded, show_progress=False)
                best[hot_path] = max(best.get(hot_path, 0.0), result["decode_tok_s"])
        rows.append({"batch": batch, "eager_tok_s": best["eager"], "fused_tok_s": best["fused"],
                     "speedup": best["fused"] / best["eager"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = ap.parse_args()
    from rich.console import Console

    from fivefold.bench.report import results_table

    if fused_ops() is None:
        sys.exit("error: the fused_ops kernel could not be built (see fivefold.kernels.kernel_status())")
    torch.set_grad_enabled(False)
    console = Console(width=120)
    loaded = load_model(args.model, "float32")
    ops = op_rows(loaded.config, not args.no_compile)
    console.print(results_table(
        f"fused elementwise ops, {args.model} shapes, float32, us per call (lower is better)",
        ("op", "tokens", "eager", "fused kernel", "torch.compile", "kernel vs eager", "kernel vs compile"),
        [(r["op"], str(r["tokens"]), f"{r['eager_us']:.1f}", f"{r['fused_kernel_us']:.1f}",
          "-" if r["torch_compile_us"] is None else f"{r['torch_compile_us']:.1f}",
          f"{r['eager_us'] / r['fused_kernel_us']:.2f}x",
          "-" if r["torch_compile_us"] is None else f"{r['torch_compile_us'] / r['fused_kernel_us']:.2f}x")
         for r in ops]))
    del loaded
    engine = engine_rows(args.model, [int(b) for b in args.batches.split(",")], args.output_len)
    console.print(results_table(
        f"engine decode tok/s, {args.model} float32, 64-token prompts, {args.output_len} new tokens",
        ("batch", "hot path eager", "hot path fused", "speedup"),
        [(str(r["batch"]), f"{r['eager_tok_s']:.1f}", f"{r['fused_tok_s']:.1f}", f"{r['speedup']:.2f}x")
         for r in engine]))
    print(json_line({"benchmark": "fused_hot_path", "model": args.model, "ops": ops, "engine": engine}))


if __name__ == "__main__":
    main()
