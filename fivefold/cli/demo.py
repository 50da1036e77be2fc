"""``fivefold demo``: the five-lever demo."""

from __future__ import annotations

from fivefold.models.registry import DEFAULT_LLM


def add_parser(sub) -> None:
    """``fivefold demo``'s arguments."""
    demo = sub.add_parser("demo", help="profile, then one lever at a time, measured: the five-lever table")
    demo.add_argument("--model", default=DEFAULT_LLM)
    demo.add_argument("--full", action="store_true", help="larger workloads (the default is the quick mode)")
    demo.add_argument("--registry", default=".fivefold/runs.db", help="SQLite run registry ('' to not record)")
    demo.add_argument("--out", default=".fivefold", help="folder for the plot and the Chrome traces")


def run(args) -> int:
    from fivefold.bench.demo import run_demo

    run_demo(args.model, quick=not args.full, registry_path=args.registry, out_dir=args.out)
    return 0
