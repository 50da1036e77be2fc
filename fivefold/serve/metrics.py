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

import statistics
import threading
import time
from collections import deque

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


LIVE_WINDOW_S = 300.0  # what the live page keeps: the last five minutes
LIVE_MAX_SAMPLES = 200_000  # per series, whatever the rate (a bound on memory: ~10 MB)


def latency_stats(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 (nearest rank) of a list of latencies; zeros when empty. (The
    load generator's table and the live page's percentiles.)"""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p):
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


class LiveWindow:
    """The server's recent past for the live page (``/dashboard``): each engine step (time,
    requests running and waiting, KV use, tokens generated) and each latency sample (TTFT,
    inter-token) of the last ``window_s`` seconds. Written by the engine thread,
    read by the HTTP one: a lock guards the deques."""

    def __init__(self, window_s: float = LIVE_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._lock = threading.Lock()
        self._steps: deque = deque(maxlen=LIVE_MAX_SAMPLES)  # (t, running, waiting, kv use, new tokens)
        self._latency = {k: deque(maxlen=LIVE_MAX_SAMPLES) for k in ("ttft", "itl")}  # (t, seconds)
        self.finished = 0
        self.started = clock()

    def add_step(self, running: int, waiting: int, kv_usage: float, new_tokens: int) -> None:
        with self._lock:
            self._steps.append((self.clock(), running, waiting, kv_usage, new_tokens))

    def add_latency(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._latency[kind].append((self.clock(), seconds))

    def snapshot(self, window_s: float = 60.0, bin_s: float = 5.0) -> dict:
        """Percentiles (ms) of TTFT and inter-token latency and the batch sizes over the last
        ``window_s`` seconds; generated tokens/s over the last 10 s and per ``bin_s`` bin over the
        whole window (oldest first, for the page's curve); the latest step's queue and KV use."""
        now = self.clock()
        with self._lock:
            cutoff = now - self.window_s
            for series in (self._steps, *self._latency.values()):
                while series and series[0][0] < cutoff:
                    series.popleft()
            steps = list(self._steps)  # copies only: the engine thread waits on this lock
            samples = {k: list(d) for k, d in self._latency.items()}
        latency = {k: [v for t, v in d if t >= now - window_s] for k, d in samples.items()}
        recent = [s for s in steps if s[0] >= now - window_s]
        bins = int(self.window_s // bin_s)
        per_bin = [0] * bins
        for t, *_, tokens in steps:
            index = bins - 1 - int((now - t) // bin_s)
            if 0 <= index < bins:
                per_bin[index] += tokens
        last = steps[-1] if steps else (now, 0, 0, 0.0, 0)
        pct = {f"{k}_ms": {q: 1000 * v for q, v in latency_stats(latency[k]).items()} if latency[k] else None
               for k in ("ttft", "itl")}
        batch = [s[1] for s in recent if s[4] > 0]
        return {"window_s": window_s, "running": last[1], "waiting": last[2], "kv_cache_usage": last[3],
                "tokens_per_s": sum(s[4] for s in steps if s[0] >= now - 10.0) / min(10.0, max(now - self.started, 1e-9)),
                "tokens_per_s_bins": [n / bin_s for n in per_bin], "bin_s": bin_s,
                "batch_size_mean": sum(batch) / len(batch) if batch else 0.0, "batch_size_max": max(batch, default=0),
                "requests_finished": self.finished, **pct}


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
        self.live = LiveWindow()
        self._result_cache = [0, 0]  # hits, misses: plain copies of the two counters for the live page

    def request_finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason, **self._labels).inc()
        self.live.finished += 1

    def result_cache_lookup(self, hit: bool) -> None:
        """A cacheable request looked up in the result cache."""
        (self.result_cache_hits if hit else self.result_cache_misses).inc()
        self._result_cache[0 if hit else 1] += 1

    def live_snapshot(self, window_s: float = 60.0) -> dict:
        """What the live page shows (:meth:`LiveWindow.snapshot`, the KV pool and cache counts)."""
        (queries, hits), (cache_hits, cache_misses) = self._last_prefix, self._result_cache
        lookups = cache_hits + cache_misses
        return self.live.snapshot(window_s) | {
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None, "num_preemptions": self._last_preemptions,
            "result_cache_hits": cache_hits, "result_cache_misses": cache_misses,
            "result_cache_hit_rate": cache_hits / lookups if lookups else None}

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
        new_tokens = sum(len(out.delta_token_ids) for out in outputs)
        self.generation_tokens.inc(new_tokens)
        self.live.add_step(stats["num_running"], stats["num_waiting"], stats["num_used_blocks"] / stats["num_blocks"],
                           new_tokens)
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
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                self.itl.observe(now - last)
                self.live.add_latency("itl", now - last)
            self._last_token_time[out.request_id] = now
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                m = out.metrics
                self.ttft.observe(m.ttft)
                self.e2e.observe(m.finished_time - m.arrival_time)
                self.live.add_latency("ttft", m.ttft)
                self.queue_time.observe(m.queue_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.request_finished(out.outputs[0].finish_reason)

    def request_aborted(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_finished("abort")
