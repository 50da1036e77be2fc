"""``fivefold env``: this machine as the kernels see it."""

from __future__ import annotations


def add_parser(sub) -> None:
    """``fivefold env``'s arguments."""
    env = sub.add_parser("env", help="this machine as the kernels see it (ISA, VNNI, bf16) and the kernel per path")
    env.add_argument("--json", action="store_true", help="one JSON object instead of the tables")


def run(args) -> int:
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
