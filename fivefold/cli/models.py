"""``fivefold models``: the built-in models."""

from __future__ import annotations


def add_parser(sub) -> None:
    """``fivefold models``'s arguments."""
    sub.add_parser("models", help="list the built-in models and where their files are")


def run(args) -> int:
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
