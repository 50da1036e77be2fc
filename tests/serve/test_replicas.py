"""`fivefold serve --replicas 2` on a local Ray Serve, end to end: the openai client
against two replicas of a small random-weight model, prefix-aware routing seen in the
per-replica metrics, and the one-line errors of bad cluster options."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fivefold.serve.routing import PrefixAwareRouter
from tests.conftest import free_port
from tests.serve.conftest import REPLICAS, per_replica, replica_cluster


@pytest.fixture(scope="module")
def model_dir(replica_model_dir):
    return replica_model_dir


@pytest.fixture(scope="module")
def prefix_aware(model_dir, tmp_path_factory):
    with replica_cluster(model_dir, tmp_path_factory, "--routing", "prefix-aware") as (proc, url):
        yield url, proc


def test_openai_client_chat_completions_and_streaming(prefix_aware, model_dir):
    prefix_aware, _ = prefix_aware
    from fivefold import LLM, SamplingParams

    client = openai.OpenAI(base_url=prefix_aware + "/v1", api_key="x")
    prompt = "w10 w11 w12 w13 w14"
    text = client.completions.create(model=model_dir, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    reference = LLM(model_dir, kv_cache_memory_bytes=4 << 20).generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert text == reference[0].outputs[0].text, "a replica answers as the engine does in-process"
    streamed = client.completions.create(model=model_dir, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                         extra_headers={"Cache-Control": "no-cache"})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    chat = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
    chunks = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_headers={"Cache-Control": "no-cache"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    # validation still happens (in the replica) and keeps OpenAI's error shape
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=model_dir, prompt=prompt, max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="other", prompt=prompt, max_tokens=2)
    assert httpx.get(prefix_aware + "/health").json() == {"status": "ok"}


def test_prefix_aware_keeps_a_shared_prefix_on_one_replica(prefix_aware, model_dir):
    prefix_aware, _ = prefix_aware
    router = PrefixAwareRouter(block_size=16)
    prefixes: dict[str, list[str]] = {}
    for start in range(3, 260, 32):  # two 2-block prefixes that the ring gives to different replicas
        words = [f"w{start + i}" for i in range(32)]
        key = router.prefix_key(list(range(start, start + 32)))  # the tiny tokenizer: "wN" -> id N
        prefixes.setdefault(router.owner(key, REPLICAS), words)
        if len(prefixes) == 2:
            break
    assert len(prefixes) == 2
    for owner, words in prefixes.items():
        before = per_replica(prefix_aware, "fivefold:request_success_total")
        hits_before = per_replica(prefix_aware, "fivefold:prefix_cache_hits_total")
        for i in range(4):
            body = {"model": model_dir, "prompt": " ".join(words + [f"w{300 + i}"] * 5), "max_tokens": 2,
                    "temperature": 0}
            reply = httpx.post(prefix_aware + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-fivefold-replica"] == owner
        after = per_replica(prefix_aware, "fivefold:request_success_total")
        hits = per_replica(prefix_aware, "fivefold:prefix_cache_hits_total")
        other = next(r for r in REPLICAS if r != owner)
        assert after[owner] - before[owner] == 4 and after[other] == before[other]
        assert hits[owner] - hits_before[owner] == 3 * 32, "requests 2-4 reused the 2 cached prefix blocks"
    routed = per_replica(prefix_aware, "fivefold:replica_requests_total")
    assert all(routed[r] >= 4 for r in REPLICAS)
    # the totals (no replica label) are the sum over replicas
    text = httpx.get(prefix_aware + "/metrics").text
    total = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "fivefold:request_success_total" and "replica" not in s.labels)
    assert total == sum(per_replica(prefix_aware, "fivefold:request_success_total").values())


def test_sigterm_lets_in_flight_requests_finish_then_stops_ray(prefix_aware, model_dir):
    url, proc = prefix_aware
    body = {"model": model_dir, "prompt": "w90 w91", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    result = {}
    sender = threading.Thread(target=lambda: result.update(reply=httpx.post(
        url + "/v1/completions", json=body, headers={"Cache-Control": "no-cache"}, timeout=120)))
    sender.start()
    deadline = time.time() + 30
    while sum(per_replica(url, "fivefold:replica_in_flight").values()) < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    sender.join(120)
    assert result["reply"].status_code == 200 and result["reply"].json()["usage"]["completion_tokens"] == 2000
    assert proc.wait(60) == 0
    left = subprocess.run(["pgrep", "-f", "ServeReplica:fivefold-replica|gcs_server"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "the Ray this server started is stopped with it"


def test_bad_cluster_options_are_one_line_errors(model_dir):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "fivefold", "serve", "--model", model_dir, *args],
                              capture_output=True, text=True, timeout=120)

    out = serve("--replicas", "0")
    assert out.returncode == 1 and out.stderr.strip() == "error: --replicas must be >= 1, got 0"
    port = free_port()
    out = serve("--replicas", "2", "--result-cache", f"redis://127.0.0.1:{port}")
    assert out.returncode == 1 and out.stderr.strip().startswith(f"error: cannot use Redis at redis://127.0.0.1:{port}")
    out = serve("--replicas", "2", "--result-cache", "disk")
    assert out.returncode == 1 and "--result-cache must be memory | redis://" in out.stderr
    assert "Traceback" not in out.stderr
