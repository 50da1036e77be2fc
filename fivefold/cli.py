"""The ``fivefold`` command line.

Every user error is printed as one line (``error: ...``) with a non-zero exit code;
tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from fivefold.errors import FivefoldError
from fivefold.models.registry import DEFAULT_LLM


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_LLM, help=f"built-in name, HF directory or GGUF file (default {DEFAULT_LLM})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-memory-bytes", type=float, default=None,
                   help="KV cache pool in bytes (default 1 GiB)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV cache pool as a share of the available RAM, in (0, 1] (instead of bytes)")
    p.add_argument("--kv-cache-memory", dest="renamed_kv_cache_memory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
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


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold", description="Fast model inference, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the built-in models and where their files are")
    env = sub.add_parser("env", help="this machine as the kernels see it (ISA, VNNI, bf16) and the kernel per path")
    env.add_argument("--json", action="store_true", help="one JSON object instead of the tables")

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")
    _add_sampling_args(gen, max_tokens=128)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-queued-requests", type=int, default=None, help="beyond it: 429 with Retry-After")
    serve.add_argument("--max-queued-tokens", type=int, default=None, help="queued prompt tokens; beyond: 429")
    serve.add_argument("--queue-timeout", type=float, default=None, help="seconds in the queue before a 503")
    serve.add_argument("--result-cache", default="memory",
                       help="memory (this process's LRU; one per replica) or redis://HOST:PORT (one for all)")
    serve.add_argument("--result-cache-entries", type=int, default=1024, help="0 disables the result cache")
    serve.add_argument("--result-cache-bytes", type=int, default=64 << 20)
    serve.add_argument("--prompt-version", default="v1",
                       help="result-cache prompt version (change it live: POST /admin/prompt-version)")
    serve.add_argument("--admin-key", default=os.environ.get("FIVEFOLD_ADMIN_KEY"),
                       help="enable /admin/* behind 'Authorization: Bearer KEY' (default: $FIVEFOLD_ADMIN_KEY; "
                            "without it the admin endpoints answer 403)")
    serve.add_argument("--cache-namespace", default="default",
                       help="Redis result cache: separates deployments sharing one Redis (with the model's hash)")
    serve.add_argument("--redis-configure-lru", action="store_true",
                       help="let the Redis result cache set the server's maxmemory and allkeys-lru policy")
    serve.add_argument("--max-batch-size", type=int, default=32, help="encoders: requests per batch")
    serve.add_argument("--max-batch-tokens", type=int, default=16384,
                       help="encoders: padded tokens per batch (requests x longest)")
    serve.add_argument("--max-queue-delay", default="auto",
                       help="encoders: seconds a request may wait for a batch, or auto (0.3 x one forward)")
    serve.add_argument("--no-length-buckets", action="store_true", help="encoders: one queue for all lengths")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="on SIGINT/SIGTERM: stop accepting, let in-flight requests finish this long, abort the rest")
    serve.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas on Ray Serve behind a routing front (default: one in-process engine)")
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    serve.add_argument("--routing", default="prefix-aware", choices=["round-robin", "least-loaded", "prefix-aware"],
                       help="with --replicas: how requests are spread (default prefix-aware)")
    serve.add_argument("--replica-cpus", type=float, default=None,
                       help="with --replicas: CPUs (and torch threads) per replica; default: cores / replicas locally")

    bench = sub.add_parser("bench", help="benchmarks (each run stored in the run registry)")
    bench.add_argument("--recipe", default=None, help="re-run the configuration of a recipe file (runs rollback)")
    bench.add_argument("--registry", dest="recipe_registry", default=".fivefold/runs.db",
                       help="with --recipe: the run registry ('' to not record)")
    bench_sub = bench.add_subparsers(dest="bench_command")
    bo = bench_sub.add_parser("offline", help="the engine in-process on a fixed workload")
    _add_model_args(bo)
    bo.add_argument("--workload", default="throughput", choices=["throughput", "shared-prefix"])
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
    bs.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    bs.add_argument("--num-requests", type=int, default=64)
    bs.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    bs.add_argument("--max-concurrency", type=int, default=None, help="closed-loop clients")
    bs.add_argument("--input-len", type=int, default=128)
    bs.add_argument("--output-len", type=int, default=128)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft=1.0,tpot=0.2 (seconds)")
    bs.add_argument("--registry", default=".fivefold/runs.db", help="SQLite run registry ('' to not record)")

    runs = sub.add_parser("runs", help="the run registry: list, show, compare, baseline, rollback")
    runs.add_argument("--registry", default=".fivefold/runs.db")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    runs_sub.add_parser("list")
    show = runs_sub.add_parser("show")
    show.add_argument("id", type=int)
    cmp_ = runs_sub.add_parser("compare")
    cmp_.add_argument("a", type=int)
    cmp_.add_argument("b", type=int)
    base = runs_sub.add_parser("baseline", help="show the baselines, or 'baseline set ID'")
    base.add_argument("action", nargs="?", choices=["set"])
    base.add_argument("id", type=int, nargs="?")
    rb = runs_sub.add_parser("rollback", help="write a run's configuration as a recipe file")
    rb.add_argument("id", type=int)
    rb.add_argument("--out", default=None, help="recipe path (default recipe-ID.json)")
    plot = runs_sub.add_parser("plot", help="throughput vs request rate and the latency CDF, as a PNG")
    plot.add_argument("ids", type=int, nargs="*", help="runs to draw (default: all)")
    plot.add_argument("--out", default=".fivefold/runs.png")

    prof = sub.add_parser("profile", help="where the time goes, memory- or compute-bound, which lever to pull")
    prof.add_argument("--model", default=DEFAULT_LLM)
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    prof.add_argument("--mode", default="decode", choices=["prefill", "decode"])
    prof.add_argument("--batch", type=int, default=1, help="sequences per step")
    prof.add_argument("--seq", type=int, default=128, help="prompt (prefill) or context (decode) tokens")
    prof.add_argument("--iterations", type=int, default=4, help="engine steps profiled")
    prof.add_argument("--structured-output", default="none", choices=["none", "json"],
                      help="decode: constrain every sequence by a JSON schema (the grammar mask's cost per step "
                           "shows in the sampling category)")
    prof.add_argument("--trace", default=None, help="Chrome trace path (default .fivefold/trace-MODE.json)")
    prof.add_argument("--server", default=None, help="a running fivefold server's URL: apply the batching rule "
                      "to its /metrics")
    prof.add_argument("--max-num-seqs", type=int, default=64, help="the server's max_num_seqs (with --server)")
    prof.add_argument("--json", action="store_true", help="also print the report as one JSON line")

    qz = sub.add_parser("quantize", help="INT8: quantize an LLM, measure it against float, write a model directory")
    qz.add_argument("--model", default=DEFAULT_LLM)
    qz.add_argument("--scheme", default="w8a16", choices=["w8a16", "w8a8"])
    qz.add_argument("--activation", default="dynamic", choices=["dynamic", "static"], help="w8a8 activations")
    qz.add_argument("--activation-granularity", default="per-token", choices=["per-token", "per-tensor"],
                    help="dynamic activations: one scale per token or per tensor")
    qz.add_argument("--asymmetric", action="store_true", help="static activations with a zero point")
    qz.add_argument("--calib", default="minmax", choices=["minmax", "percentile", "entropy", "mse"])
    qz.add_argument("--percentile", type=float, default=99.99)
    qz.add_argument("--granularity", default="per-channel", choices=["per-channel", "per-tensor"],
                    help="weight scales")
    qz.add_argument("--bias-correction", action="store_true")
    qz.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                    help="W8A8: migrate activation outliers into the weights first (SmoothQuant, e.g. 0.7)")
    qz.add_argument("--mixed-precision", action="store_true", help="keep the most sensitive layers float")
    qz.add_argument("--max-ppl-increase", default="0.5%", help="mixed-precision budget, e.g. 0.5%% (default)")
    qz.add_argument("--max-accuracy-drop", type=float, default=None,
                    help="mixed-precision budget in points of next-token accuracy (instead of perplexity)")
    qz.add_argument("--skip", nargs="*", default=[], help="module name patterns kept float, e.g. lm_head")
    qz.add_argument("--num-calibration", type=int, default=16, help="calibration windows of --window tokens")
    qz.add_argument("--num-eval", type=int, default=8, help="held-out windows for perplexity")
    qz.add_argument("--window", type=int, default=256)
    qz.add_argument("--out", required=True, help="output model directory")

    fz = sub.add_parser("fuse", help="fuse a CNN or encoder (fold BN, fuse activations, channels_last), "
                                     "measure it against eager, write a directory")
    fz.add_argument("--model", default="resnet18", help="resnet18, mobilenet_v2, all-minilm-l6-v2 or a BERT directory")
    fz.add_argument("--out", required=True, help="output directory")
    fz.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes to time (default 1,32)")
    fz.add_argument("--image-size", type=int, default=224, help="CNN input height and width")
    fz.add_argument("--seq-len", type=int, default=64, help="encoder input length in tokens")
    fz.add_argument("--no-channels-last", action="store_true")
    fz.add_argument("--no-align", action="store_true", help="do not time packed/padded layouts for linears")

    pr = sub.add_parser("prune", help="structured (or unstructured) pruning, measured against the original, "
                                      "written as a model directory")
    pr.add_argument("--model", default="digits-resnet", help="digits-resnet, or an LLM (built-in name, HF dir, GGUF)")
    pr.add_argument("--out", required=True, help="output directory")
    pr.add_argument("--ratio", type=float, default=None,
                    help="digits: channels removed per group (default 0.5); LLM: MLP neurons (default 0.25)")
    pr.add_argument("--importance", default=None, choices=["l1", "l2", "bn", "taylor", "activation"],
                    help="digits: l1 (default), l2, bn, taylor; LLM: activation (default), l2, taylor")
    pr.add_argument("--finetune-epochs", type=int, default=5, help="digits: fine-tuning after pruning")
    pr.add_argument("--iterative", action="store_true", help="digits: raise the ratio until --budget is crossed")
    pr.add_argument("--budget", type=float, default=1.0, help="digits: accuracy points the schedule may lose")
    pr.add_argument("--sensitivity", action="store_true", help="digits: per-group scan, table + sensitivity.json")
    pr.add_argument("--unstructured", type=float, default=None, metavar="SPARSITY",
                    help="digits: global magnitude pruning to this sparsity instead of channels")
    pr.add_argument("--attention-groups", type=int, default=0, help="LLM: KV groups removed per layer")
    pr.add_argument("--heal-steps", type=int, default=0, help="LLM: token-level KD steps from the original")
    pr.add_argument("--num-calibration", type=int, default=8, help="LLM: calibration windows for importance")
    pr.add_argument("--num-eval", type=int, default=8, help="LLM: held-out windows for perplexity")
    pr.add_argument("--window", type=int, default=256)

    ds = sub.add_parser("distill", help="knowledge distillation into a smaller student, measured against the teacher")
    ds.add_argument("--teacher", default="digits-resnet",
                    help="digits-resnet (student: half width) or an LLM (student: every other layer)")
    ds.add_argument("--out", required=True)
    ds.add_argument("--steps", type=int, default=0, help="training steps (0: 12 epochs for digits, 40 for LLMs)")
    ds.add_argument("--alpha", type=float, default=0.7, help="weight of the soft targets (1 - alpha: hard labels)")
    ds.add_argument("--t-start", type=float, default=4.0)
    ds.add_argument("--t-end", type=float, default=1.0)
    ds.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"])
    ds.add_argument("--num-eval", type=int, default=8)
    ds.add_argument("--window", type=int, default=256)

    demo = sub.add_parser("demo", help="profile, then one lever at a time, measured: the five-lever table")
    demo.add_argument("--model", default=DEFAULT_LLM)
    demo.add_argument("--full", action="store_true", help="larger workloads (the default is the quick mode)")
    demo.add_argument("--registry", default=".fivefold/runs.db", help="SQLite run registry ('' to not record)")
    demo.add_argument("--out", default=".fivefold", help="folder for the plot and the Chrome traces")

    chat = sub.add_parser("chat", help="interactive chat with history (/reset, /exit)")
    _add_model_args(chat)
    chat.add_argument("--system", default=None)
    _add_sampling_args(chat, max_tokens=256)
    return parser


def _sampling(args):
    from fivefold.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)


def _engine_options(args) -> dict:
    if args.renamed_kv_cache_memory is not None:
        raise FivefoldError("--kv-cache-memory was split in two: --kv-cache-memory-bytes B or "
                            "--kv-cache-memory-fraction F (a share of the available RAM, in (0, 1])")
    return dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
                preallocation=args.preallocation, weight_layout=args.weight_layout,
                decode_attention=args.decode_attention, hot_path=args.hot_path,
                prefill_attention=args.prefill_attention, decode_loop=args.decode_loop)


def _llm(args):
    from fivefold.llm import LLM

    return LLM(args.model, dtype=args.dtype, **_engine_options(args))


def cmd_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from fivefold.models.registry import BUILTIN_MODELS

    table = Table(title="built-in models")
    for col in ("name", "kind", "description"):
        table.add_column(col)
    # Paths are never wrapped: they get copied into other commands, and a folded path is useless.
    table.add_column("path", no_wrap=True, overflow="ignore")
    rows = [(m.name, m.kind, m.description, str(m.path()) if m.path() else "[red]not installed[/red]")
            for m in BUILTIN_MODELS.values()]
    for row in rows:
        table.add_row(*row)
    width = sum(max(len(r[i]) for r in rows) for i in range(4)) + 16
    Console(width=max(width, 80)).print(table)
    return 0


def cmd_env(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from fivefold.kernel_report import kernel_choices
    from fivefold.platform import current_platform

    description = current_platform().describe()
    choices = kernel_choices()
    if args.json:
        print(json.dumps({"platform": description, "kernels": dict(choices)}))
        return 0
    console = Console(width=130)
    table = Table(title="this machine, as the kernels see it")
    table.add_column("property")
    table.add_column("value")
    for key, value in description.items():
        table.add_row(key, " ".join(value) if isinstance(value, list) else str(value))
    console.print(table)
    table = Table(title="kernel chosen for each path")
    table.add_column("path")
    table.add_column("kernel")
    for path, kernel in choices:
        table.add_row(path, kernel)
    console.print(table)
    return 0


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


def cmd_generate(args) -> int:
    params = _sampling(args)
    llm = _llm(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    num_tokens, tok_s = _stream_to_stdout(llm, prompt, params)
    if args.stats:
        print(f"{num_tokens} tokens, decode {tok_s:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _sampling(args)
    llm = _llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print("fivefold chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            for out in llm.stream(llm.chat_prompt(system + history), params):
                reply.append(out.delta_text)
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
        except FivefoldError as exc:  # e.g. the history outgrew the context: say so, keep the session
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def _run_uvicorn(app, args, worker=None) -> int:
    """Serve until SIGINT/SIGTERM; return the exit status. ``worker`` (the AsyncEngine or the
    DynamicBatcher) failing is fatal: its requests have their 500s already, so the server
    shuts down gracefully and the command exits 1, for a supervisor to restart it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_grace))
    failed = []
    if worker is not None:
        def on_fatal(exc: BaseException) -> None:
            failed.append(exc)
            print(f"fivefold: {type(exc).__name__} in the engine thread; shutting down (exit 1)", file=sys.stderr)
            server.should_exit = True

        worker.on_fatal = on_fatal
    server.run()
    return 1 if failed else 0


def _serve_encoder(args, path) -> int:
    from fivefold.batching.config import DEFAULT_LENGTH_BUCKETS, BatcherConfig
    from fivefold.serve.embeddings import create_embeddings_server

    delay = args.max_queue_delay
    if delay != "auto":
        try:
            delay = float(delay)
        except ValueError:
            raise FivefoldError(f"--max-queue-delay must be 'auto' or seconds, got '{delay}'") from None
    config = BatcherConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                           max_queue_delay=delay, length_buckets=None if args.no_length_buckets else
                           DEFAULT_LENGTH_BUCKETS, request_timeout=args.queue_timeout,
                           **({} if args.max_queued_requests is None else
                              {"max_queued_requests": args.max_queued_requests}))
    name = args.served_model_name or args.model
    log = lambda text: print(text, file=sys.stderr)  # noqa: E731
    app, batcher, _ = create_embeddings_server(path, config, name, args.api_key, args.max_body_bytes, log)
    print(f"fivefold: serving {args.model} (embeddings) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        return _run_uvicorn(app, args, batcher)
    finally:
        batcher.shutdown()


def _server_spec(args):
    from fivefold.serve.app import ServerSpec

    return ServerSpec(model=args.model, served_model_name=args.served_model_name or args.model, dtype=args.dtype,
                      engine_options=_engine_options(args), max_queued_requests=args.max_queued_requests,
                      max_queued_tokens=args.max_queued_tokens, queue_timeout=args.queue_timeout,
                      result_cache=args.result_cache if args.result_cache_entries > 0 else None,
                      result_cache_entries=args.result_cache_entries, result_cache_bytes=args.result_cache_bytes,
                      prompt_version=args.prompt_version, cache_namespace=args.cache_namespace,
                      redis_configure_lru=args.redis_configure_lru, max_body_bytes=args.max_body_bytes)


def _serve_replicas(args, spec) -> int:
    from fivefold.engine.config import EngineConfig
    from fivefold.models.loader import load_tokenizer
    from fivefold.cache.redis_cache import redact_url
    from fivefold.serve.cluster import ClusterConfig, ReplicaSet, build_cluster_app

    # Everything a replica would fail on is checked here first, for a one-line error.
    config = ClusterConfig(num_replicas=args.replicas, routing=args.routing, ray_address=args.ray_address,
                           num_cpus_per_replica=args.replica_cpus, shutdown_grace=args.shutdown_grace)
    EngineConfig.from_options(**spec.engine_options)
    tokenizer, _ = load_tokenizer(args.model)
    spec.make_result_cache()  # a bad URL or an unreachable Redis fails now, not in every replica
    replicas = ReplicaSet(spec, config)
    try:
        replicas.start()
        app = build_cluster_app(replicas, tokenizer, spec.served_model_name, api_key=args.api_key,
                                max_body_bytes=args.max_body_bytes, admin_key=args.admin_key)
        cache = redact_url(spec.result_cache) if spec.result_cache else "off"
        print(f"fivefold: serving {args.model} on http://{args.host}:{args.port}/v1 with {args.replicas} replicas "
              f"({args.routing} routing, result cache: {cache})", file=sys.stderr)
        try:
            _run_uvicorn(app, args)
        except SystemExit as exc:
            # uvicorn re-raises the signal after its graceful shutdown, and Ray's driver
            # handler turns it into SystemExit(signum): that is a normal stop.
            if exc.code not in (signal.SIGTERM, signal.SIGINT):
                raise
    finally:
        replicas.shutdown()
    return 0


def cmd_serve(args) -> int:
    from fivefold.batching.encoder import is_encoder_dir
    from fivefold.models.registry import resolve_model_path
    from fivefold.serve.app import create_llm_server

    path = resolve_model_path(args.model)
    if is_encoder_dir(path):
        if args.replicas is not None:
            raise FivefoldError("--replicas serves LLMs; an embeddings model is served by one process")
        return _serve_encoder(args, path)
    spec = _server_spec(args)
    if args.replicas is not None:
        return _serve_replicas(args, spec)
    engine, app = create_llm_server(spec, api_key=args.api_key, admin_key=args.admin_key)
    print(f"fivefold: serving {args.model} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        return _run_uvicorn(app, args, engine)
    finally:
        engine.shutdown()  # aborts whatever outlived the grace period


def cmd_runs(args) -> int:
    import json as _json

    from fivefold.bench.registry import RunRegistry

    registry = RunRegistry(args.registry)
    if args.runs_command == "list":
        for run in registry.list():
            print(f"{run.id:4d}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(run.created))}  {run.name:14s}  "
                  f"{(run.git_commit or '-')[:10]}  {_json.dumps(run.config, sort_keys=True)[:80]}")
    elif args.runs_command == "show":
        run = registry.get(args.id)
        print(_json.dumps(run.__dict__, indent=2, sort_keys=True, default=str))
    elif args.runs_command == "compare":
        from fivefold.bench.report import print_comparison

        print_comparison(registry, args.a, args.b)
    elif args.runs_command == "plot":
        from fivefold.bench.plots import plot_runs

        runs = [registry.get(i) for i in args.ids] if args.ids else registry.list()
        print(f"wrote {plot_runs(runs, args.out)}")
    elif args.runs_command == "baseline":
        if args.action == "set":
            if args.id is None:
                raise FivefoldError("usage: fivefold runs baseline set ID")
            registry.set_baseline(args.id)
            print(f"run {args.id} is the baseline of '{registry.get(args.id).name}'")
        else:
            for run in registry.list():
                base = registry.baseline(run.name)
                if base is not None and base.id == run.id:
                    print(f"{run.name}: run {run.id}")
    elif args.runs_command == "rollback":
        path = registry.rollback(args.id, args.out or f"recipe-{args.id}.json")
        print(f"wrote {path}")
    return 0


def cmd_profile(args) -> int:
    import json as _json
    import urllib.request

    from rich.console import Console

    from fivefold.models import load_model
    from fivefold.profile.llm_profile import profile_llm
    from fivefold.profile.verdict import server_verdict

    loaded = load_model(args.model, args.dtype)
    trace = args.trace or f".fivefold/trace-{args.mode}.json"
    report = profile_llm(loaded, args.mode, args.batch, args.seq, args.iterations, trace_path=trace,
                         structured_output=args.structured_output)
    if args.server:
        url = args.server.rstrip("/").removesuffix("/v1") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except OSError as exc:
            raise FivefoldError(f"cannot read {url}: {exc}") from None
        verdict = server_verdict(text, args.max_num_seqs)
        if verdict is not None:
            report.verdicts.insert(0, verdict)
        else:
            print(f"server {args.server}: no requests waiting, so no batching verdict", file=sys.stderr)
    report.render(Console(width=150))
    if args.json:
        print(_json.dumps(report.to_dict(), default=str))
    return 0


def _fraction(text: str, flag: str) -> float:
    """'0.5%' or '0.5' (percent) -> 0.005."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise FivefoldError(f"{flag} takes a percentage such as 0.5%, got '{text}'") from None
    if value < 0:
        raise FivefoldError(f"{flag} must be >= 0, got '{text}'")
    return value / 100


def cmd_quantize(args) -> int:
    from fivefold.quant.config import Int8Config
    from fivefold.quant.llm_quantize import QuantizeJob, run_quantize

    if min(args.num_calibration, args.num_eval, args.window) < 1:
        raise FivefoldError("--num-calibration, --num-eval and --window must be >= 1")
    config = Int8Config(scheme=args.scheme, weight_granularity=args.granularity, activation=args.activation,
                        activation_granularity=args.activation_granularity,
                        activation_symmetric=not args.asymmetric, calibration=args.calib,
                        percentile=args.percentile, bias_correction=args.bias_correction,
                        smoothquant_alpha=args.smoothquant, skip=tuple(args.skip))
    job = QuantizeJob(args.model, config, args.out, args.mixed_precision,
                      _fraction(args.max_ppl_increase, "--max-ppl-increase"), args.max_accuracy_drop,
                      args.num_calibration, args.num_eval, args.window)
    run_quantize(job)
    return 0


def cmd_fuse(args) -> int:
    from fivefold.fuse.fuse_job import FuseJob, run_fuse
    from fivefold.fuse.graph_fuse import FuseConfig

    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    except ValueError:
        raise FivefoldError(f"--batch-sizes must be comma-separated integers, got '{args.batch_sizes}'") from None
    config = FuseConfig(channels_last=not args.no_channels_last, align_linears=not args.no_align)
    run_fuse(FuseJob(args.model, args.out, batch_sizes, args.image_size, args.seq_len, config=config))
    return 0


def cmd_prune(args) -> int:
    from rich.console import Console

    from fivefold.compress.jobs import DIGITS, PruneJob, run_prune

    if min(args.finetune_epochs, args.num_calibration, args.num_eval, args.window, args.heal_steps,
           args.attention_groups) < 0 or min(args.num_calibration, args.num_eval, args.window) < 1:
        raise FivefoldError("--num-calibration, --num-eval and --window must be >= 1; epochs, steps and groups >= 0")
    ratio = args.ratio if args.ratio is not None else (0.5 if args.model == DIGITS else 0.25)
    run_prune(PruneJob(args.model, args.out, ratio, args.importance, args.finetune_epochs, args.iterative,
                       args.budget, args.sensitivity, args.unstructured, args.attention_groups, args.heal_steps,
                       args.num_calibration, args.num_eval, args.window), Console(width=140))
    return 0


def cmd_distill(args) -> int:
    from rich.console import Console

    from fivefold.compress.jobs import DistillJob, run_distill

    if args.steps < 0 or args.num_eval < 1 or args.window < 2:
        raise FivefoldError("--steps must be >= 0, --num-eval >= 1 and --window >= 2")
    run_distill(DistillJob(args.teacher, args.out, args.steps, args.alpha, args.t_start, args.t_end, args.schedule,
                           args.num_eval, args.window), Console(width=140))
    return 0


def cmd_demo(args) -> int:
    from fivefold.bench.demo import run_demo

    run_demo(args.model, quick=not args.full, registry_path=args.registry, out_dir=args.out)
    return 0


def cmd_bench(args) -> int:
    if args.recipe:
        from fivefold.bench.recipes import run_recipe

        return run_recipe(args.recipe, args.recipe_registry)
    if args.bench_command is None:
        raise FivefoldError("usage: fivefold bench {serve,offline} ... or fivefold bench --recipe FILE")
    if args.bench_command == "offline":
        from fivefold.bench.recipes import run_offline_and_record
        from fivefold.bench.offline_bench import make_config

        config = make_config(args.model, args.dtype, args.workload, args.num_requests, args.input_len,
                             args.output_len, args.prefix_len, args.seed, **_engine_options(args))
        return run_offline_and_record(config, args.registry)
    from fivefold.bench.serve_bench import main as bench_serve

    return bench_serve(args)


COMMANDS = {"models": cmd_models, "env": cmd_env, "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench,
            "runs": cmd_runs, "profile": cmd_profile,
            "demo": cmd_demo, "quantize": cmd_quantize, "fuse": cmd_fuse,
            "prune": cmd_prune, "distill": cmd_distill}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
