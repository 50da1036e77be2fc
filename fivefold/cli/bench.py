"""``fivefold bench``: offline and serving benchmarks, stored as runs."""

from __future__ import annotations

import os

from fivefold.cli import common
from fivefold.errors import FivefoldError
from fivefold.models.registry import DEFAULT_LLM


def add_parser(sub) -> None:
    """``fivefold bench``'s arguments."""
    bench = sub.add_parser("bench", help="benchmarks (each run stored in the run registry)")
    bench.add_argument("--recipe", default=None, help="re-run the configuration of a recipe file (runs rollback)")
    bench.add_argument("--registry", dest="recipe_registry", default=".fivefold/runs.db",
                       help="with --recipe: the run registry ('' to not record)")
    bench_sub = bench.add_subparsers(dest="bench_command")
    bo = bench_sub.add_parser("offline", help="the engine in-process on a fixed workload")
    common.add_model_args(bo)
    bo.add_argument("--workload", default="throughput", choices=["throughput", "shared-prefix", "copy"])
    bo.add_argument("--num-requests", type=int, default=16)
    bo.add_argument("--input-len", type=int, default=64)
    bo.add_argument("--output-len", type=int, default=32)
    bo.add_argument("--prefix-len", type=int, default=0, help="tokens shared by every prompt (shared-prefix)")
    bo.add_argument("--seed", type=int, default=0)
    bo.add_argument("--registry", default=".fivefold/runs.db", help="SQLite run registry ('' to not record)")
    bs = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible server")
    bs.add_argument("--url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default=DEFAULT_LLM)
    bs.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "pydoc"])
    bs.add_argument("--dataset-path", default=None,
                    help="prompts from a JSONL file (prompt/text/messages per line) or a ShareGPT JSON (instead of --dataset)")
    bs.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    bs.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    bs.add_argument("--tokenizer", default=None,
                    help="count prompt tokens (and draw random ids) with this model's tokenizer; default: the "
                         "server's /tokenize, else its usage")
    bs.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    bs.add_argument("--num-requests", type=int, default=64)
    bs.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    bs.add_argument("--max-concurrency", type=int, default=None, help="closed-loop clients")
    bs.add_argument("--input-len", type=int, default=128)
    bs.add_argument("--output-len", type=int, default=128)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft=1.0,tpot=0.2 (seconds)")
    bs.add_argument("--registry", default=".fivefold/runs.db", help="SQLite run registry ('' to not record)")


def run(args) -> int:
    if args.recipe:
        from fivefold.bench.recipes import run_recipe

        return run_recipe(args.recipe, args.recipe_registry)
    if args.bench_command is None:
        raise FivefoldError("usage: fivefold bench {serve,offline} ... or fivefold bench --recipe FILE")
    if args.bench_command == "offline":
        from fivefold.bench.recipes import run_offline_and_record
        from fivefold.bench.offline_bench import make_config

        common.set_threads(args)
        quantization = None
        if args.quantization is not None:
            from fivefold.quant.config import Int8Config

            quantization = (Int8Config(scheme=args.quantization).to_dict() if args.quantization == "w8a16"
                            else {"on_load": args.quantization})
        config = make_config(args.model, args.dtype, args.workload, args.num_requests, args.input_len,
                             args.output_len, args.prefix_len, args.seed, quantization=quantization,
                             **common.engine_options(args))
        return run_offline_and_record(config, args.registry)
    from fivefold.bench.serve_bench import main as bench_serve

    return bench_serve(args)
