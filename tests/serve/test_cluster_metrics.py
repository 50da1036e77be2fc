"""The front's /metrics aggregation: every replica's sample once with its replica label and
once summed (gauges named *_perc averaged), histograms bucket by bucket; no Ray needed."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fivefold.serve.cluster import ClusterConfig, aggregate_metrics
from fivefold.serve.metrics import ServerMetrics


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_sum_label_and_average():
    a, b = ServerMetrics("m"), ServerMetrics("m")
    a.prompt_tokens.inc(10)
    b.prompt_tokens.inc(32)
    a.kv_usage.set(0.2)
    b.kv_usage.set(0.6)
    a.running.set(3)
    b.running.set(4)
    a.ttft.observe(0.02)
    b.ttft.observe(0.02)
    b.ttft.observe(7.0)
    a.request_finished("stop")
    b.request_finished("length")
    text = aggregate_metrics({"replica-0": generate_latest(a.registry).decode(),
                              "replica-1": generate_latest(b.registry).decode()})
    got = samples(text)
    m = (("model_name", "m"),)
    assert got[("fivefold:prompt_tokens_total", m)] == 42
    assert got[("fivefold:prompt_tokens_total", m + (("replica", "replica-1"),))] == 32
    assert got[("fivefold:num_requests_running", m)] == 7
    assert abs(got[("fivefold:kv_cache_usage_perc", m)] - 0.4) < 1e-9
    assert got[("fivefold:time_to_first_token_seconds_count", m)] == 3
    assert got[("fivefold:time_to_first_token_seconds_bucket", (("le", "0.025"),) + m)] == 2
    assert got[("fivefold:time_to_first_token_seconds_bucket", (("le", "10.0"),) + m)] == 3
    assert got[("fivefold:request_success_total", (("finished_reason", "stop"),) + m)] == 1
    assert got[("fivefold:request_success_total", (("finished_reason", "stop"),) + m + (("replica", "replica-0"),))] == 1
    assert got[("fivefold:request_success_total", (("finished_reason", "length"),) + m + (("replica", "replica-1"),))] == 1
    assert not any(name.endswith("_created") for name, _ in got)


def test_cluster_config_validation():
    import pytest

    from fivefold.errors import FivefoldError

    with pytest.raises(FivefoldError, match="--replicas must be >= 1, got 0"):
        ClusterConfig(num_replicas=0)
    with pytest.raises(FivefoldError, match="--routing must be one of round-robin, least-loaded, prefix-aware"):
        ClusterConfig(routing="random")
    with pytest.raises(FivefoldError, match="--replica-cpus must be > 0"):
        ClusterConfig(num_cpus_per_replica=0)
    assert ClusterConfig(num_replicas=2, ray_address="10.0.0.1:6379").cpus_per_replica == 1.0
