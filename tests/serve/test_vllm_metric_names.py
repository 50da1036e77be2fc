"""The server's metrics under vLLM's names too (issue 38): every metric of VLLM_NAMES has its
vLLM twins, same type, same ``model_name`` label, same samples after the same updates, so a
dashboard made for vLLM's /metrics reads ours."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fivefold.serve.metrics import VLLM_NAMES, ServerMetrics

STATS = {"num_running": 3, "num_waiting": 2, "num_used_blocks": 25, "num_blocks": 100, "prefix_cache_queries": 40,
         "prefix_cache_hits": 16, "num_preemptions": 1, "spec_num_drafts": 0, "spec_num_draft_tokens": 0,
         "spec_num_accepted_tokens": 0, "spec_acceptance_rate": 0.0, "spec_mean_accepted_length": 0.0}


def _families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def _samples(family) -> list:
    return sorted((s.name.split(":", 1)[1], tuple(sorted(s.labels.items())), s.value) for s in family.samples
                  if not s.name.endswith("_created"))


def test_each_metric_has_its_vllm_names_with_the_same_samples():
    metrics = ServerMetrics("smollm2")
    metrics.observe_step(STATS, [])
    metrics.observe_step(STATS | {"prefix_cache_queries": 90, "prefix_cache_hits": 50, "num_running": 5}, [])
    metrics.ttft.observe(0.07)
    metrics.itl.observe(0.01)
    metrics.request_finished("stop")
    metrics.request_finished("length")
    metrics.request_aborted("cmpl-1")
    families = _families(metrics)
    for ours, theirs in VLLM_NAMES.items():
        mine = families[f"fivefold:{ours}"]
        for name in theirs:
            twin = families[f"vllm:{name}"]
            assert twin.type == mine.type, name
            # same label sets and values, sample by sample (the suffixes _total, _bucket, _sum...)
            strip = lambda rows, prefix: [(n.replace(prefix, "", 1), l, v) for n, l, v in rows]  # noqa: E731
            assert strip(_samples(twin), name) == strip(_samples(mine), ours), name
            assert all(dict(s.labels).get("model_name") == "smollm2" for s in twin.samples)
    assert families["vllm:num_requests_running"].samples[0].value == 5
    assert families["vllm:gpu_cache_usage_perc"].samples[0].value == 0.25
    assert families["vllm:prefix_cache_hits"].samples[0].value == 50
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"stop": 1.0, "length": 1.0, "abort": 1.0}
