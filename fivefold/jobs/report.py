"""Tables the jobs (and the benchmarks, through ``fivefold.bench.report``) print."""

from __future__ import annotations


def results_table(title: str, columns: tuple[str, ...], rows: list[tuple]):
    """A rich Table of right-aligned columns, one row per tuple of already formatted cells."""
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def scan_table(scan: dict, title: str):
    """The scan as a rich table: one row per group, one column per ratio (metric drop)."""
    return results_table(title, ("group", "channels", *(f"{r:.0%}" for r in scan["ratios"])),
                         [(name, str(g["channels"]), *(f"{g['drops'][r]:+.2f}" for r in scan["ratios"]))
                          for name, g in scan["groups"].items()])
