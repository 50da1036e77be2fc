"""``fivefold dashboard``: the run registry as local web pages (fivefold/bench/dashboard.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    """``fivefold dashboard``'s arguments."""
    dash = sub.add_parser("dashboard", help="the run registry as web pages: runs, a run, compare two, set a baseline")
    dash.add_argument("--registry", default=".fivefold/runs.db")
    dash.add_argument("--host", default="127.0.0.1", help="listen address (default: this machine only)")
    dash.add_argument("--port", type=int, default=8050)


def run(args) -> int:
    import uvicorn

    from fivefold.bench.dashboard import create_app
    from fivefold.errors import FivefoldError

    if not 0 < args.port < 65536:
        raise FivefoldError(f"--port must be between 1 and 65535, got {args.port}")
    print(f"fivefold dashboard: http://{args.host}:{args.port}/ (registry {args.registry})", flush=True)
    uvicorn.run(create_app(args.registry), host=args.host, port=args.port, log_level="warning")
    return 0
