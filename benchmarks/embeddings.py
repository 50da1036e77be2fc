"""Dynamic batching of all-MiniLM-L6-v2 embeddings: off, on without buckets, on with buckets.

Inputs: ``--num-inputs`` windows of held-out pydoc_data text whose token lengths are drawn
between 5 and 250 (log-uniform by default: many short inputs, a tail of long ones;
``--lengths uniform`` for the other extreme), each with [CLS] and [SEP]. Closed loop: C
client threads each submit one input, wait for its embedding, and submit the next, for
``--requests`` requests in all, against the batcher in this process (the HTTP server adds
the same per-request cost to every mode, so it is left out; `fivefold serve` runs this
batcher). Modes:
  off          max_batch_size 1 (each request is its own forward)
  no buckets   max_batch_size 32, max_queue_delay auto, one queue
  buckets      the same with the default length buckets
Per run: throughput, P50/P99 latency, mean batch size, padding efficiency (real / padded
tokens) and the P99 bound of the issue: max_queue_delay + 2 x the execution time of the
largest batch (the one with the most padded tokens).

First, the cost table that bounds what batching can gain: ms per request of one forward
at several lengths and batch sizes (equal lengths, no padding).

    .venv/bin/python benchmarks/embeddings.py [--concurrency 1,8,32,64] [--requests 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.batching.config import DEFAULT_LENGTH_BUCKETS, BatcherConfig  # noqa: E402
from fivefold.batching.encoder import EncoderModel, measure_auto_delay  # noqa: E402
from fivefold.bench.embeddings_bench import (  # noqa: E402
    COST_BATCHES,
    MODES,
    closed_loop,
    cost_rows,
    mixed_inputs,
    mode_config,
)
from fivefold.models.registry import resolve_model_path  # noqa: E402
from fivefold.serve.embeddings import sample_ids  # noqa: E402


def main() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from fivefold.bench.report import results_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests", type=int, default=256, help="requests per run (a quarter at concurrency 1)")
    ap.add_argument("--num-inputs", type=int, default=512)
    ap.add_argument("--lengths", default="loguniform", choices=["loguniform", "uniform"])
    ap.add_argument("--buckets", default=",".join(map(str, DEFAULT_LENGTH_BUCKETS)), help="length bucket bounds")
    ap.add_argument("--min-padding-efficiency", type=float, default=0.8)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-cost-table", action="store_true")
    args = ap.parse_args()
    console = Console(width=140)
    encoder = EncoderModel(resolve_model_path("all-minilm-l6-v2"))
    inputs = mixed_inputs(encoder, args.num_inputs, args.lengths)
    delay = measure_auto_delay(encoder.embed, sample_ids(encoder), BatcherConfig().auto_delay_factor)
    console.print(f"max_queue_delay auto = {delay * 1e3:.1f} ms; inputs: {len(inputs)} of "
                  f"{min(map(len, inputs))}-{max(map(len, inputs))} tokens ({args.lengths}), "
                  f"mean {sum(map(len, inputs)) / len(inputs):.0f}")
    cost = [] if args.no_cost_table else cost_rows(encoder)
    console.print(results_table(
        "cost per request of one forward (ms), equal lengths", ("tokens", *(f"batch {b}" for b in COST_BATCHES),
                                                               f"batch {COST_BATCHES[-1]} vs 1"),
        [(str(r["tokens"]), *(f"{r['ms_per_request'][b]:.2f}" for b in COST_BATCHES),
          f"{r['ms_per_request'][1] / r['ms_per_request'][COST_BATCHES[-1]]:.2f}x") for r in cost]))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with Progress(console=console, transient=True) as progress:
        modes = args.modes.split(",")
        buckets = tuple(int(b) for b in args.buckets.split(","))
        task = progress.add_task("closed-loop runs", total=len(concurrencies) * len(modes))
        for c in concurrencies:
            num = max(16, args.requests // 4) if c == 1 else args.requests
            for mode in modes:
                config = mode_config(mode, delay, buckets, args.min_padding_efficiency)
                result = closed_loop(encoder, config, inputs, c, num)
                result.pop("outputs")
                rows.append({"concurrency": c, "mode": mode, **result})
                progress.advance(task)
    off = {r["concurrency"]: r["throughput"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["vs_off"] = r["throughput"] / off[r["concurrency"]] if r["concurrency"] in off else float("nan")
    console.print(results_table(
        f"all-MiniLM-L6-v2 embeddings, closed loop, float32, {args.lengths} 5-250 tokens",
        ("clients", "batching", "req/s", "vs off", "P50 ms", "P99 ms", "P99 bound ms", "mean batch", "padding eff."),
        [(str(r["concurrency"]), r["mode"], f"{r['throughput']:.1f}", f"{r['vs_off']:.2f}x", f"{r['p50_ms']:.1f}",
          f"{r['p99_ms']:.1f}", f"{r['p99_bound_ms']:.1f}", f"{r['mean_batch']:.1f}",
          f"{r['padding_efficiency']:.0%}") for r in rows]))
    print(json_line({"benchmark": "embeddings", "lengths": args.lengths, "max_queue_delay_s": delay, "rows": rows,
                      "cost": cost}))


if __name__ == "__main__":
    main()
