"""The randomized scheduler + KV cache + prefix cache test, run long: many seeds per
configuration (fivefold/engine/stress.py), every invariant checked after every step.
Prints a table of what the runs exercised and one JSON line; exits 1 on the first broken
invariant, naming the seed that replays it.

    .venv/bin/python benchmarks/scheduler_stress.py [--seeds 500] [--steps 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line, results_table  # noqa: E402
from fivefold.engine.stress import StressConfig, run_stress  # noqa: E402

CONFIGS = {
    "24 x 16 blocks, waves of 12 (issue 16)": StressConfig(),
    "preallocation full": StressConfig(preallocation="full"),
    "preallocation predicted": StressConfig(preallocation="predicted"),
    "no prefix cache": StressConfig(enable_prefix_caching=False),
    "40 x 4 blocks, 16-token chunks": StressConfig(num_blocks=40, block_size=4, prompt_len=40, max_tokens=100,
                                                   max_num_batched_tokens=16),
    "12 x 8 blocks, heavy aborts": StressConfig(num_blocks=12, block_size=8, prompt_len=30, max_tokens=60,
                                                abort_rate=0.3),
}


def main() -> int:
    from rich.console import Console
    from rich.progress import Progress

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=500)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    console = Console(width=130)
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("random workloads", total=args.seeds * len(CONFIGS))
        for name, cfg in CONFIGS.items():
            start = time.perf_counter()
            totals = dict(steps=0, added=0, finished=0, aborted=0, preemptions=0, hit_tokens=0)
            for seed in range(args.seeds):
                try:
                    r = run_stress(seed, args.steps, cfg)
                except AssertionError as exc:
                    console.print(f"[red]{name}: {exc}[/red]")
                    print(json_line({"benchmark": "scheduler_stress", "failed": name, "error": str(exc)}))
                    return 1
                totals["steps"] += r.num_steps
                totals["added"] += r.num_added
                totals["finished"] += r.num_finished
                totals["aborted"] += r.num_aborted
                totals["preemptions"] += r.num_preemptions
                totals["hit_tokens"] += r.num_prefix_hit_tokens
                progress.advance(task)
            rows.append({"config": name, "seeds": args.seeds, **totals, "seconds": time.perf_counter() - start})
    console.print(results_table(
        f"scheduler + KV cache + prefix cache: {args.seeds} seeds x {args.steps} steps each, invariants after every step",
        ("config", "steps", "requests", "finished", "aborted", "preemptions", "prefix-hit tokens", "s"),
        [(r["config"], str(r["steps"]), str(r["added"]), str(r["finished"]), str(r["aborted"]),
          str(r["preemptions"]), str(r["hit_tokens"]), f"{r['seconds']:.1f}") for r in rows]))
    console.print("no invariant broken")
    print(json_line({"benchmark": "scheduler_stress", "steps_per_seed": args.steps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
