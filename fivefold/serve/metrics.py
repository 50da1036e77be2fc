"""Prometheus metrics of the server, named after vLLM's with a ``fivefold:`` prefix, and each
also exposed under vLLM's own name and ``model_name`` label (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ...), so a dashboard built for vLLM's server reads this one
unchanged. ``VLLM_NAMES`` maps ours to theirs; where vLLM has two names for one quantity across
versions, both are exposed (``vllm:gpu_cache_usage_perc`` and ``vllm:kv_cache_usage_perc``: the
KV pool's use here; ``vllm:time_per_output_token_seconds`` and
``vllm:inter_token_latency_seconds``).

Updated by the engine thread after every step, from the engine's ``stats()`` (queue sizes,
KV use, prefix cache, preemptions, speculation) and the step's outputs (token counts and the
latency histograms of finished requests), so scraping costs the engine nothing.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fivefold.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# fivefold metric (without its prefix) -> vLLM's names for it (prometheus_client adds _total to
# counters on both sides). Ours with no vLLM counterpart (kv_cache_used_blocks,
# kv_cache_num_blocks, the result cache's, spec_decode_acceptance_rate and mean_accepted_length)
# keep the fivefold: name only.
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_success": ("request_success",),
}


class _Same:
    """One quantity under several names: set / inc / observe / labels reach them all."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def set(self, value) -> None:
        for m in self.metrics:
            m.set(value)

    def inc(self, amount=1) -> None:
        for m in self.metrics:
            m.inc(amount)

    def observe(self, value) -> None:
        for m in self.metrics:
            m.observe(value)

    def labels(self, **labels) -> "_Same":
        return _Same([m.labels(**labels) for m in self.metrics])


class ServerMetrics:
    """The server's Prometheus registry and its metrics (one ``model_name`` label)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def named(kind, name, doc, label_names=tuple(labels), **kw):
            names = [f"fivefold:{name}"] + [f"vllm:{v}" for v in VLLM_NAMES.get(name, ())]
            return _Same([kind(n, doc, list(label_names), registry=r, **kw) for n in names])

        def gauge(name, doc):
            return named(Gauge, name, doc).labels(**labels)

        def counter(name, doc):
            return named(Counter, name, doc).labels(**labels)

        def histogram(name, doc):
            return named(Histogram, name, doc, buckets=LATENCY_BUCKETS).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV blocks held by requests (not free, not evictable).")
        self.kv_num_blocks = gauge("kv_cache_num_blocks", "KV blocks in the pool.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.result_cache_hits = counter("result_cache_hits", "Requests answered from the result cache.")
        self.result_cache_misses = counter("result_cache_misses", "Cacheable requests not in the result cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of a row with speculative proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        self.spec_acceptance_rate = gauge("spec_decode_acceptance_rate", "Accepted / proposed tokens since start.")
        self.spec_mean_accepted_length = gauge("spec_decode_mean_accepted_length",
                                               "Tokens per verification (accepted proposals + 1) since start.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.")
        self._success = named(Counter, "request_success", "Finished requests by finish reason.",
                              ("model_name", "finished_reason"))
        self._labels = labels
        self._last_token_time: dict[str, float] = {}
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._last_spec = (0, 0, 0)

    def request_finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason, **self._labels).inc()

    def observe_step(self, stats: dict, outputs: list[RequestOutput]) -> None:
        """After a step: the gauges and counters from the engine's ``stats()`` (counters advance
        by what changed since the last step), the latencies of ``outputs``."""
        now = time.monotonic()
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["num_used_blocks"] / stats["num_blocks"])
        self.kv_used_blocks.set(stats["num_used_blocks"])
        self.kv_num_blocks.set(stats["num_blocks"])
        prefix = (stats["prefix_cache_queries"], stats["prefix_cache_hits"])
        self.prefix_queries.inc(prefix[0] - self._last_prefix[0])
        self.prefix_hits.inc(prefix[1] - self._last_prefix[1])
        self._last_prefix = prefix
        self.preemptions.inc(stats["num_preemptions"] - self._last_preemptions)
        self._last_preemptions = stats["num_preemptions"]
        counts = (stats["spec_num_drafts"], stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"])
        for metric, now_count, last in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens),
                                           counts, self._last_spec):
            metric.inc(now_count - last)
        self._last_spec = counts
        self.spec_acceptance_rate.set(stats["spec_acceptance_rate"])
        self.spec_mean_accepted_length.set(stats["spec_mean_accepted_length"])
        for out in outputs:
            self.generation_tokens.inc(len(out.delta_token_ids))
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token_time[out.request_id] = now
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                m = out.metrics
                self.ttft.observe(m.ttft)
                self.e2e.observe(m.finished_time - m.arrival_time)
                self.queue_time.observe(m.queue_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.request_finished(out.outputs[0].finish_reason)

    def request_aborted(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_finished("abort")
