"""The ``fivefold`` command line: one module per command, ``fivefold/cli/<command>.py``, holding
that command's arguments (``add_parser``) and what it runs (``run``). The commands that run a
lever's job (quantize, fuse, prune, distill) build the job's config there and hand it to
``fivefold/<lever>/job.py``. Heavy modules are imported inside ``run``, so that
``fivefold --help`` stays fast.

Every user error is printed as one line (``error: ...``) with a non-zero exit code;
tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fivefold.errors import FivefoldError

# In the order ``fivefold --help`` lists them.
COMMANDS = ("models", "env", "generate", "serve", "bench", "runs", "dashboard", "profile", "quantize", "fuse", "prune",
            "distill", "demo", "chat")


def _command(name: str):
    return importlib.import_module(f"fivefold.cli.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold", description="Fast model inference, measured.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        _command(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args.command).run(args)
    except FivefoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
