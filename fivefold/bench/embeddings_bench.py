"""The embeddings batching benchmark as functions: ``benchmarks/embeddings.py`` and the demo run them.

Inputs are windows of held-out pydoc_data text of 5-250 tokens; clients run a closed loop
(submit, wait, submit the next) against a :class:`DynamicBatcher` in this process.
"""

from __future__ import annotations

import math
import random
import threading
import time

from fivefold.batching.batcher import DynamicBatcher
from fivefold.batching.config import DEFAULT_LENGTH_BUCKETS, BatcherConfig
from fivefold.batching.encoder import EncoderModel
from fivefold.eval.text import pydoc_text

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


def mode_config(mode: str, delay: float, buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS,
                min_padding_efficiency: float = 0.8) -> BatcherConfig:
    if mode == "off":
        return BatcherConfig(max_batch_size=1, max_queue_delay=0.0, length_buckets=None, max_queued_requests=None)
    return BatcherConfig(max_batch_size=32, max_queue_delay=delay, length_buckets=buckets if mode == "buckets" else None,
                         max_queued_requests=None, min_padding_efficiency=min_padding_efficiency)


def closed_loop(encoder: EncoderModel, config: BatcherConfig, inputs: list[list[int]], concurrency: int,
                num_requests: int) -> dict:
    """Throughput, P50/P99 latency, mean batch size, padding efficiency, the P99 bound
    (max_queue_delay + 2 x the execution time of the batch with the most padded tokens), and
    ``outputs`` (input index -> embedding) of ``concurrency`` closed-loop clients."""
    batcher = DynamicBatcher(encoder.embed, config)
    latencies: list[float] = []
    outputs: dict[int, object] = {}
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
            vector = batcher.submit(ids, len(ids)).result()
            with lock:
                latencies.append(time.perf_counter() - start)
                outputs[i % len(inputs)] = vector

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
            "p99_bound_ms": (config.max_queue_delay + 2 * largest.execution_time) * 1e3,
            "outputs": outputs}


