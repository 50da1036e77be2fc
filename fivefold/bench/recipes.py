"""Recipes: a run's configuration as a file, and running one again.

``fivefold runs rollback ID`` writes ``{"benchmark": NAME, "config": {...}, "from_run": ID}``;
``fivefold bench --recipe FILE`` runs that benchmark with exactly that configuration and
stores the new run, shown against its baseline, so a rollback can be checked by
``fivefold runs compare ID NEW`` (no configuration difference).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fivefold.errors import FivefoldError


def run_offline_and_record(config: dict, registry: str | None, loaded=None) -> int:
    """Run an offline benchmark configuration, print its summary and JSON line, store it."""
    from rich.console import Console

    from fivefold.bench.offline_bench import bench_name, run_offline
    from fivefold.bench.report import record_run

    metrics = run_offline(config, loaded)
    console = Console(width=130)
    console.print(f"{bench_name(config['workload'])}: {config['num_requests']} requests, {metrics['duration_s']:.2f} s, "
                  f"{metrics['output_tok_s']:.1f} output tok/s, TTFT mean {metrics['ttft_s']['mean'] * 1e3:.1f} ms, "
                  f"{metrics['num_computed_prompt_tokens']} of {metrics['num_prompt_tokens']} prompt tokens computed")
    record_run(registry, bench_name(config["workload"]), config, metrics, console)
    print(json.dumps({"benchmark": bench_name(config["workload"]), **config,
                      **{k: v for k, v in metrics.items() if k != "samples"}}))
    return 0


def load_recipe(path: str | Path) -> dict:
    try:
        recipe = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FivefoldError(f"recipe file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise FivefoldError(f"recipe file {path} is not valid JSON: {exc}") from None
    if not isinstance(recipe, dict) or "benchmark" not in recipe or not isinstance(recipe.get("config"), dict):
        raise FivefoldError(f"recipe file {path} needs 'benchmark' and a 'config' object (write one with "
                            "'fivefold runs rollback ID')")
    return recipe


def run_recipe(path: str | Path, registry: str | None) -> int:
    from fivefold.bench.offline_bench import WORKLOADS, bench_name

    recipe = load_recipe(path)
    name, config = recipe["benchmark"], recipe["config"]
    if name in {bench_name(w) for w in WORKLOADS}:
        return run_offline_and_record(config, registry)
    if name == "bench serve":
        from fivefold.bench.serve_bench import main as bench_serve

        return bench_serve(argparse.Namespace(**config, registry=registry))
    raise FivefoldError(f"recipe benchmark '{name}' is not one fivefold can re-run "
                        f"(known: bench serve, {', '.join(bench_name(w) for w in WORKLOADS)})")
