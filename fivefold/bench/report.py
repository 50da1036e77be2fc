"""Showing runs: a comparison table, and a new run stored and shown against its baseline."""

from __future__ import annotations

from typing import Any

from fivefold.bench.registry import RunRegistry, machine_description
from fivefold.jobs.report import results_table  # noqa: F401  (the benchmarks' table, one helper for all)
from fivefold.models.fingerprint import model_fingerprint


def json_line(payload: dict[str, Any]) -> str:
    """The one JSON line a benchmark prints, with the machine it ran on (``machine``: OS, torch,
    threads and the CPU's ISA level, VNNI, bf16 and any forcing)."""
    import json

    return json.dumps({**payload, "machine": machine_description()}, default=str)



def print_comparison(registry: RunRegistry, a: int, b: int, console=None) -> None:
    """Configuration diff, metric deltas as ratios, and the one-variable warning."""
    from rich.console import Console
    from rich.table import Table

    comparison = registry.compare(a, b)
    console = console or Console(width=130)
    table = Table(title=f"run {a} -> run {b}")
    for col in ("", "key", f"run {a}", f"run {b}", "ratio"):
        table.add_column(col)
    for key, (va, vb) in comparison.config_diff.items():
        table.add_row("config", key, str(va), str(vb), "")
    for key, (va, vb, ratio) in comparison.metric_ratios.items():
        table.add_row("metric", key, f"{va:.4g}", f"{vb:.4g}", f"{ratio:.3f}x" if ratio is not None else "-")
    console.print(table)
    if comparison.warning:
        console.print(f"[yellow]warning: {comparison.warning}[/yellow]")


def record_run(registry_path: str | None, name: str, config: dict[str, Any], metrics: dict[str, Any],
               console=None) -> int | None:
    """Store a run (unless ``registry_path`` is empty) and show it against the current baseline.

    The first run of a name becomes its baseline.
    """
    from rich.console import Console

    if not registry_path:
        return None
    console = console or Console(width=130)
    registry = RunRegistry(registry_path)
    try:
        run_id = registry.record(name, config, metrics, model_fingerprint(config.get("model")))
        baseline = registry.baseline(name)
        if baseline is None:
            registry.set_baseline(run_id)
            console.print(f"run {run_id} stored in {registry_path} and set as the baseline of '{name}'")
        else:
            console.print(f"run {run_id} stored in {registry_path}; against the baseline (run {baseline.id}):")
            print_comparison(registry, baseline.id, run_id, console)
    finally:
        registry.close()
    return run_id
