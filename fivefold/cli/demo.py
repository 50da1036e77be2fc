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
    demo.add_argument("--html", default=None, metavar="FILE",
                      help="also write the table, the verdicts and the plot as one self-contained HTML page")


def run(args) -> int:
    from fivefold.bench.demo import run_demo

    from pathlib import Path

    from fivefold.errors import FivefoldError

    if args.html is not None:  # its folder made now (as --out's is): a bad path fails before minutes of work
        try:
            Path(args.html).resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FivefoldError(f"--html: cannot create the folder of {args.html}: {exc.strerror}") from None
        if Path(args.html).is_dir():
            raise FivefoldError(f"--html: {args.html} is a folder; give a file name such as demo.html")
    run_demo(args.model, quick=not args.full, registry_path=args.registry, out_dir=args.out, html_path=args.html)
    return 0
