"""``fivefold serve``: the OpenAI-compatible server (one engine, the encoder server, or replicas)."""

from __future__ import annotations

import os
import signal
import sys

from fivefold.cli import common
from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold serve``'s arguments."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # `fivefold serve MODEL` as `vllm serve MODEL`; --model stays (one of the two)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it (built-in name, HF directory, org/name in the local "
                            "Hugging Face cache, GGUF file)")
    common.add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version")
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
    serve.add_argument("--dashboard", action="store_true",
                       help="the live page at /dashboard (queue, tokens/s, TTFT/ITL, KV use, cache hits; behind "
                            "--api-key, which a browser sends as the Basic-auth password)")
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
    ops = serve.add_argument_group("operations")
    ops.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="fivefold's own messages (default info)")
    ops.add_argument("--uvicorn-log-level", default="warning", choices=LOG_LEVELS,
                     help="the HTTP server's messages (default warning; info prints uvicorn's access log too)")
    ops.add_argument("--enable-log-requests", action="store_true",
                     help="one line per request on stderr: request id, method, route, status, prompt and completion "
                          "tokens, TTFT, total time (never the prompt text)")
    ops.add_argument("--allowed-origins", default=None,
                     help="CORS: comma-separated origins browsers may call from, or * (default: none)")
    ops.add_argument("--ssl-keyfile", default=None, help="TLS: the private key (PEM); with --ssl-certfile")
    ops.add_argument("--ssl-certfile", default=None, help="TLS: the certificate chain (PEM); with --ssl-keyfile")


LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def check_operations(args) -> None:
    """The operations options, checked before the model loads (one-line errors)."""
    if args.model_tag is not None:
        if args.model not in (common.DEFAULT_LLM, args.model_tag):
            raise FivefoldError(f"the model is given twice ({args.model_tag} and --model {args.model}): give one")
        args.model = args.model_tag
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise FivefoldError("TLS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise FivefoldError(f"{flag}: no such file {path}")
    if args.allowed_origins is not None and not [o for o in args.allowed_origins.split(",") if o.strip()]:
        raise FivefoldError("--allowed-origins: give origins (https://app.example.com,...) or *")
    if args.dashboard and args.replicas is not None:
        raise FivefoldError("--dashboard shows one engine's metrics; with --replicas, read each replica's /metrics")


def _scheme(args) -> str:
    return "https" if args.ssl_certfile else "http"


def apply_operations(app, args) -> None:
    """Log levels, the access log and CORS on a built app (before it serves)."""
    import logging

    from fivefold.serve.operations import allow_origins, enable_access_log

    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.getLogger("fivefold").setLevel(level)
    if args.enable_log_requests:
        enable_access_log()
    if args.allowed_origins:
        allow_origins(app, [o.strip() for o in args.allowed_origins.split(",") if o.strip()])


def _run_uvicorn(app, args, worker=None) -> int:
    """Serve until SIGINT/SIGTERM; return the exit status. ``worker`` (the AsyncEngine or the
    DynamicBatcher) failing is fatal: its requests have their 500s already, so the server
    shuts down gracefully and the command exits 1, for a supervisor to restart it."""
    import uvicorn

    apply_operations(app, args)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=args.shutdown_grace,
                                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile))
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
    print(f"fivefold: serving {args.model} (embeddings) on {_scheme(args)}://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        return _run_uvicorn(app, args, batcher)
    finally:
        batcher.shutdown()


def _server_config(args):
    from fivefold.serve.config import ServerConfig

    return ServerConfig(model=args.model, served_model_name=args.served_model_name or args.model, dtype=args.dtype,
                        quantization=args.quantization,
                        engine_options=common.engine_options(args), max_queued_requests=args.max_queued_requests,
                        max_queued_tokens=args.max_queued_tokens, queue_timeout=args.queue_timeout,
                        result_cache=args.result_cache if args.result_cache_entries > 0 else None,
                        result_cache_entries=args.result_cache_entries, result_cache_bytes=args.result_cache_bytes,
                        prompt_version=args.prompt_version, cache_namespace=args.cache_namespace,
                        redis_configure_lru=args.redis_configure_lru, max_body_bytes=args.max_body_bytes,
                        num_threads=args.threads)


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
        print(f"fivefold: serving {args.model} on {_scheme(args)}://{args.host}:{args.port}/v1 with {args.replicas} replicas "
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


def run(args) -> int:
    from fivefold.batching.encoder import is_encoder_dir
    from fivefold.models.registry import resolve_model_path
    from fivefold.serve.app import create_llm_server
    from fivefold.serve.http_base import check_key

    check_operations(args)
    check_key("--api-key", args.api_key)  # before the model loads: a one-line error, not a login for anyone
    check_key("--admin-key (FIVEFOLD_ADMIN_KEY)", args.admin_key)
    path = resolve_model_path(args.model)
    if is_encoder_dir(path):
        if args.replicas is not None:
            raise FivefoldError("--replicas serves LLMs; an embeddings model is served by one process")
        if args.dashboard:
            raise FivefoldError("--dashboard is the LLM server's live page; an embeddings server has /metrics")
        return _serve_encoder(args, path)
    spec = _server_config(args)
    if args.replicas is not None:
        return _serve_replicas(args, spec)
    engine, app = create_llm_server(spec, api_key=args.api_key, admin_key=args.admin_key, dashboard=args.dashboard)
    print(f"fivefold: serving {args.model} on {_scheme(args)}://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        return _run_uvicorn(app, args, engine)
    finally:
        engine.shutdown()  # aborts whatever outlived the grace period
