"""The live page of ``fivefold serve --dashboard`` (fivefold/serve/live_page.py): the rolling
window against hand-computed numbers on a fake clock, then a real server (tiny random Llama)
whose page and data move while requests run, behind the API key (Bearer, or Basic from a
browser), with no external URL in the page."""

from __future__ import annotations

import base64
import re
import threading

import httpx
import pytest

from fivefold.cache.result_cache import ResultCache
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import LiveWindow, ServerMetrics, latency_stats
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server, wait_until_idle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_live_window_numbers_and_its_five_minutes():
    clock = Clock()
    live = LiveWindow(window_s=300.0, clock=clock)
    for i in range(60):  # one step a second for a minute: 2 running, 10 tokens each
        live.add_step(2, i % 3, 0.25, 10)
        live.add_latency("itl", 0.01 * (1 + i % 5))
        clock.now += 1.0
    for ttft in (0.1, 0.2, 0.3, 0.4):
        live.add_latency("ttft", ttft)
    snap = live.snapshot(window_s=60.0)
    assert snap["running"] == 2 and snap["waiting"] == 59 % 3 and snap["kv_cache_usage"] == 0.25
    assert snap["tokens_per_s"] == pytest.approx(10.0)  # 10 steps of 10 tokens in the last 10 s
    assert snap["ttft_ms"] == pytest.approx({k: 1000 * v for k, v in latency_stats([0.1, 0.2, 0.3, 0.4]).items()})
    assert snap["itl_ms"]["p99"] == pytest.approx(50.0) and snap["batch_size_max"] == 2
    bins = snap["tokens_per_s_bins"]
    # 5-s bins, oldest first: the newest holds the last 4 steps (t = 1056..1059), the 12th newest t = 1000
    assert len(bins) == 60 and sum(bins) * 5 == 600 and bins[-1] == 8.0 and bins[-12:-1] == [10.0] * 11
    assert bins[-13] == 2.0 and bins[0] == 0.0
    clock.now += 400.0  # past the window: everything dropped
    later = live.snapshot(window_s=60.0)
    assert later["tokens_per_s"] == 0 and later["ttft_ms"] is None and sum(later["tokens_per_s_bins"]) == 0


def test_server_metrics_feed_the_live_snapshot():
    metrics = ServerMetrics("m")
    stats = {"num_running": 3, "num_waiting": 1, "num_used_blocks": 30, "num_blocks": 120, "prefix_cache_queries": 40,
             "prefix_cache_hits": 10, "num_preemptions": 2, "spec_num_drafts": 0, "spec_num_draft_tokens": 0,
             "spec_num_accepted_tokens": 0, "spec_acceptance_rate": 0.0, "spec_mean_accepted_length": 0.0}
    metrics.observe_step(stats, [])
    metrics.result_cache_lookup(True)
    metrics.result_cache_lookup(False)
    metrics.result_cache_lookup(False)
    snap = metrics.live_snapshot()
    assert snap["running"] == 3 and snap["kv_cache_usage"] == 0.25 and snap["prefix_cache_hit_rate"] == 0.25
    assert snap["result_cache_hits"] == 1 and snap["result_cache_misses"] == 2
    assert snap["result_cache_hit_rate"] == pytest.approx(1 / 3) and snap["num_preemptions"] == 2


def test_live_page_moves_while_requests_run(tmp_path):
    save_random_hf_model("llama", tmp_path)
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory_bytes=8 << 20, block_size=4)),
                         ServerMetrics("tiny"))
    basic = "Basic " + base64.b64encode(b"anyone:sekret").decode()
    with running_server(build_app(engine, "tiny", api_key="sekret", dashboard=True, result_cache=ResultCache())) as url:
        refused = httpx.get(url + "/dashboard")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic realm=")
        assert httpx.get(url + "/dashboard", headers={"Authorization": "Basic " + base64.b64encode(b"u:wrong").decode()}).status_code == 401
        assert httpx.get(url + "/dashboard", headers={"Authorization": "Basic !!!"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": basic}).status_code == 401  # Basic: the page only
        idle = httpx.get(url + "/dashboard/data", headers={"Authorization": "Bearer sekret"}).json()
        assert idle["requests_finished"] == 0 and idle["ttft_ms"] is None
        seen = []

        def poll(stop: threading.Event) -> None:
            with httpx.Client(headers={"Authorization": basic}) as client:
                while not stop.is_set():
                    seen.append(client.get(url + "/dashboard/data").json())
                    stop.wait(0.05)

        stop = threading.Event()
        poller = threading.Thread(target=poll, args=(stop,))
        poller.start()
        # Long enough that the 50 ms poller sees the batch running: at 24 tokens the tiny model's
        # requests could all finish between two polls on a loaded machine (seen in CI).
        body = {"model": "tiny", "max_tokens": 160, "temperature": 0, "ignore_eos": True}
        with httpx.Client(headers={"Authorization": "Bearer sekret"}, timeout=60) as client:
            threads = [threading.Thread(target=client.post, args=(url + "/v1/completions",),
                                        kwargs={"json": body | {"prompt": [5 + i, 7, 9]}}) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            again = client.post(url + "/v1/completions", json=body | {"prompt": [5, 7, 9]})  # a result-cache hit
            assert again.headers["x-cache"] == "hit"
        stop.set()
        poller.join()
        wait_until_idle(engine.engine)
        assert max(s["running"] for s in seen) >= 1  # the counters moved while the requests ran
        assert max(s["tokens_per_s"] for s in seen) > 0
        done = httpx.get(url + "/dashboard/data", headers={"Authorization": basic}).json()
        assert done["requests_finished"] == 6 and done["ttft_ms"]["p50"] > 0 and done["itl_ms"]["p99"] > 0
        assert done["result_cache_hits"] == 1 and done["result_cache_misses"] == 6
        page = httpx.get(url + "/dashboard", headers={"Authorization": basic})
        assert page.status_code == 200 and "http-equiv=refresh" in page.text and "<svg" in page.text
        assert re.search(r"id='requests finished'>6<", page.text)
        assert not re.search(r"(https?:)?//[a-z0-9]", page.text, re.I)
    engine.shutdown()


def test_fivefold_serve_dashboard_flag(tmp_path):
    """The CLI wiring: `fivefold serve --dashboard` has the page; without the flag it is a 404."""
    from tests.serve.conftest import serve_process

    save_random_hf_model("llama", tmp_path)
    with serve_process("--model", str(tmp_path), "--kv-cache-memory-bytes", str(8 << 20), "--dashboard") as (_, url):
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 200 and "requests running" in page.text
    with serve_process("--model", str(tmp_path), "--kv-cache-memory-bytes", str(8 << 20)) as (_, url):
        assert httpx.get(url + "/dashboard").status_code == 404
