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
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.batching.batcher import DynamicBatcher  # noqa: E402
from fivefold.batching.config import DEFAULT_LENGTH_BUCKETS, BatcherConfig  # noqa: E402
from fivefold.batching.encoder import EncoderModel, measure_auto_delay  # noqa: E402
from fivefold.data import pydoc_text  # noqa: E402
from fivefold.models.registry import resolve_model_path  # noqa: E402
from fivefold.serve.embeddings import sample_ids  # noqa: E402

MODES = ("off", "no buckets", "buckets")


def mixed_inputs(encoder: EncoderModel, num: int, distribution: str, seed: int = 0) -> list[list[int]]:
    """``num`` inputs of 5-250 tokens (special tokens included) cut from held-out text."""
    ids = encoder.tokenizer.encode(pydoc_text("heldout"), add_special_tokens=False)
    rng = random.Random(seed)
    hf = encoder.tokenizer.hf
    out = []
    for _ in range(num):
        if distribution == "uniform":
            n = rng.randint(5, 250)
        else:
            n = int(round(math.exp(rng.uniform(math.log(5), math.log(250)))))
        start = rng.randrange(0, len(ids) - n)
        out.append([hf.cls_token_id, *ids[start:start + n - 2], hf.sep_token_id])
    return out


COST_LENGTHS = (5, 16, 64, 128, 250)
COST_BATCHES = (1, 8, 32)


def cost_rows(encoder: EncoderModel) -> list[dict]:
    from fivefold.fuse.layout import median_us

    rows = []
    for n in COST_LENGTHS:
        per_request = {}
        for b in COST_BATCHES:
            batch = [[1000 + (i % 997) for i in range(n)]] * b
            per_request[b] = median_us(lambda: encoder.embed(batch), 5 if n * b > 2000 else 11) / 1e3 / b
        rows.append({"tokens": n, "ms_per_request": per_request})
    return rows


def mode_config(mode: str, delay: float) -> BatcherConfig:
    if mode == "off":
        return BatcherConfig(max_batch_size=1, max_queue_delay=0.0, length_buckets=None, max_queued_requests=None)
    buckets = DEFAULT_LENGTH_BUCKETS if mode == "buckets" else None
    return BatcherConfig(max_batch_size=32, max_queue_delay=delay, length_buckets=buckets, max_queued_requests=None)


def closed_loop(encoder: EncoderModel, config: BatcherConfig, inputs: list[list[int]], concurrency: int,
                num_requests: int) -> dict:
    batcher = DynamicBatcher(encoder.embed, config)
    latencies: list[float] = []
    counter = iter(range(num_requests))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            ids = inputs[i % len(inputs)]
            start = time.perf_counter()
            batcher.submit(ids, len(ids)).result()
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    records = list(batcher.history)
    batcher.shutdown()
    latencies.sort()
    largest = max(records, key=lambda r: r.padded_tokens)  # the largest batch: the most tokens computed
    return {"throughput": num_requests / elapsed,
            "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
            "mean_batch": sum(r.size for r in records) / len(records),
            "padding_efficiency": sum(r.real_tokens for r in records) / sum(r.padded_tokens for r in records),
            "p99_bound_ms": (config.max_queue_delay + 2 * largest.execution_time) * 1e3}


def main() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from fivefold.bench.report import results_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests", type=int, default=256, help="requests per run (a quarter at concurrency 1)")
    ap.add_argument("--num-inputs", type=int, default=512)
    ap.add_argument("--lengths", default="loguniform", choices=["loguniform", "uniform"])
    args = ap.parse_args()
    console = Console(width=140)
    encoder = EncoderModel(resolve_model_path("all-minilm-l6-v2"))
    inputs = mixed_inputs(encoder, args.num_inputs, args.lengths)
    delay = measure_auto_delay(encoder.embed, sample_ids(encoder), BatcherConfig().auto_delay_factor)
    console.print(f"max_queue_delay auto = {delay * 1e3:.1f} ms; inputs: {len(inputs)} of "
                  f"{min(map(len, inputs))}-{max(map(len, inputs))} tokens ({args.lengths}), "
                  f"mean {sum(map(len, inputs)) / len(inputs):.0f}")
    cost = cost_rows(encoder)
    console.print(results_table(
        "cost per request of one forward (ms), equal lengths", ("tokens", *(f"batch {b}" for b in COST_BATCHES),
                                                               f"batch {COST_BATCHES[-1]} vs 1"),
        [(str(r["tokens"]), *(f"{r['ms_per_request'][b]:.2f}" for b in COST_BATCHES),
          f"{r['ms_per_request'][1] / r['ms_per_request'][COST_BATCHES[-1]]:.2f}x") for r in cost]))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("closed-loop runs", total=len(concurrencies) * len(MODES))
        for c in concurrencies:
            num = max(16, args.requests // 4) if c == 1 else args.requests
            for mode in MODES:
                rows.append({"concurrency": c, "mode": mode, **closed_loop(encoder, mode_config(mode, delay), inputs,
                                                                           c, num)})
                progress.advance(task)
    off = {r["concurrency"]: r["throughput"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["vs_off"] = r["throughput"] / off[r["concurrency"]]
    console.print(results_table(
        f"all-MiniLM-L6-v2 embeddings, closed loop, float32, {args.lengths} 5-250 tokens",
        ("clients", "batching", "req/s", "vs off", "P50 ms", "P99 ms", "P99 bound ms", "mean batch", "padding eff."),
        [(str(r["concurrency"]), r["mode"], f"{r['throughput']:.1f}", f"{r['vs_off']:.2f}x", f"{r['p50_ms']:.1f}",
          f"{r['p99_ms']:.1f}", f"{r['p99_bound_ms']:.1f}", f"{r['mean_batch']:.1f}",
          f"{r['padding_efficiency']:.0%}") for r in rows]))
    print(json.dumps({"benchmark": "embeddings", "lengths": args.lengths, "max_queue_delay_s": delay, "rows": rows,
                      "cost": cost}))


if __name__ == "__main__":
    main()
