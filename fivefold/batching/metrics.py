"""Prometheus metrics of the dynamic batcher (``fivefold:`` names, as the LLM server's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from fivefold.batching.batcher import BatchRecord

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
EFFICIENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class BatcherMetrics:
    """Histograms of batch size, padded batch tokens, padding efficiency (real / padded tokens),
    queue and execution time; counters of real and padded tokens and of rejections by reason."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"model_name": model_name}

        def histogram(name, doc, buckets):
            return Histogram(f"fivefold:{name}", doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(f"fivefold:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        self.batch_size = histogram("batch_size", "Requests per executed batch.", SIZE_BUCKETS)
        self.batch_tokens = histogram("batch_tokens", "Padded tokens per batch (requests x longest).", TOKEN_BUCKETS)
        self.padding_efficiency = histogram("batch_padding_efficiency", "Real tokens / padded tokens per batch.",
                                            EFFICIENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the start of its batch.",
                                    LATENCY_BUCKETS)
        self.execution_time = histogram("batch_execution_seconds", "Forward time of one batch.", LATENCY_BUCKETS)
        self.real_tokens = counter("batch_real_tokens", "Real (unpadded) tokens computed.")
        self.padded_tokens = counter("batch_padded_tokens", "Tokens computed including padding.")
        self._rejected = Counter("fivefold:requests_rejected", "Requests refused, by reason.",
                                 ["model_name", "reason"], registry=self.registry)
        self._labels = labels

    def on_batch(self, record: BatchRecord) -> None:
        self.batch_size.observe(record.size)
        self.batch_tokens.observe(record.padded_tokens)
        self.padding_efficiency.observe(record.real_tokens / record.padded_tokens)
        self.execution_time.observe(record.execution_time)
        for seconds in record.queue_times:
            self.queue_time.observe(seconds)
        self.real_tokens.inc(record.real_tokens)
        self.padded_tokens.inc(record.padded_tokens)

    def on_reject(self, reason: str) -> None:
        self._rejected.labels(reason=reason, **self._labels).inc()
