"""Two replicas with round-robin routing and the Redis result cache: a hit served by the
other replica, a version bump that invalidates for both, and a replica killed
mid-traffic (503 for its in-flight requests only, the other keeps serving, Ray restarts it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
import redis

from tests.serve.conftest import REPLICAS, per_replica, replica_cluster


@pytest.fixture(scope="module")
def model_dir(replica_model_dir):
    return replica_model_dir


ADMIN = "front-admin-key"


@pytest.fixture(scope="module")
def round_robin_redis(model_dir, tmp_path_factory, redis_url):
    redis.Redis.from_url(redis_url).flushall()
    with replica_cluster(model_dir, tmp_path_factory, "--routing", "round-robin", "--result-cache", redis_url,
                         "--cache-namespace", "failover", "--admin-key", ADMIN) as (_, url):
        yield url


def test_redis_result_cache_hit_on_the_other_replica_and_version_bump(round_robin_redis, model_dir, redis_url):
    url = round_robin_redis
    body = {"model": model_dir, "prompt": "w40 w41 w42 w43", "max_tokens": 6, "temperature": 0}

    def post():
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        return reply.headers["x-cache"], reply.headers["x-fivefold-replica"], reply.json()["choices"]

    state, first_replica, choices = post()
    assert state == "miss"
    state, second_replica, cached = post()
    assert (state, cached) == ("hit", choices) and second_replica != first_replica
    raw = redis.Redis.from_url(redis_url)
    (version_key,) = raw.keys("fivefold:failover:*:version")  # namespace: --cache-namespace + model hash
    prefix = version_key.decode()[: -len("version")]
    assert len(raw.keys(prefix + "v1:*")) == 1
    # A client cannot bump the version at the front; the operator can, with the admin key.
    refused = httpx.post(url + "/v1/completions", json=body, headers={"X-Prompt-Version": "v2"}, timeout=60)
    assert refused.status_code == 400 and "X-Prompt-Version" in refused.json()["error"]["message"]
    changed = httpx.post(url + "/admin/prompt-version", json={"version": "v2"},
                         headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert changed.json() == {"object": "prompt_version", "version": "v2", "previous": "v1"}
    state, bumped_replica, _ = post()
    assert state == "miss", "a version bump invalidates the entry for every replica"
    assert raw.keys(prefix + "v1:*") == [] and len(raw.keys(prefix + "v2:*")) == 1
    state, replica, again = post()
    assert state == "hit" and replica != bumped_replica and again == choices


async def _long_requests(url: str, model: str, num: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int):
            body = {"model": model, "prompt": f"w{50 + i} w60 w61", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            return await client.post(url + "/v1/completions", json=body, headers={"Cache-Control": "no-cache"})

        async def stream():
            body = {"model": model, "prompt": "w70 w71", "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            lines = []
            async with client.stream("POST", url + "/v1/completions", json=body) as reply:
                replica = reply.headers["x-fivefold-replica"]
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") or (reply.status_code != 200 and line.strip()):
                        lines.append(line.removeprefix("data: "))
            return replica, reply.status_code, lines

        return await asyncio.gather(*(one(i) for i in range(num)), stream(), stream())


def replica_pid(replica: str) -> int:
    out = subprocess.run(["pgrep", "-f", f"ServeReplica:fivefold-{replica}:"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, f"expected one process for {replica}, found {pids}"
    return pids[0]


def test_killed_replica_fails_only_its_in_flight_requests(round_robin_redis, model_dir):
    url = round_robin_redis
    results = {}
    loop = asyncio.new_event_loop()
    task = loop.create_task(_long_requests(url, model_dir, num=10, max_tokens=3000))
    runner = threading.Thread(target=lambda: results.update(out=loop.run_until_complete(task)))
    runner.start()
    deadline = time.time() + 60
    while min(per_replica(url, "fivefold:replica_in_flight").values()) < 6:  # all 12 in flight
        assert time.time() < deadline, "requests never reached both replicas"
        time.sleep(0.05)
    in_flight = per_replica(url, "fivefold:replica_in_flight")
    os.kill(replica_pid("replica-0"), signal.SIGKILL)
    # new traffic keeps being answered while replica-0 is down and restarting
    body = {"model": model_dir, "prompt": "w80 w81", "max_tokens": 4, "temperature": 0}
    time.sleep(0.5)
    quick = [httpx.post(url + "/v1/completions", json=body, headers={"Cache-Control": "no-cache"}, timeout=60)
             for _ in range(4)]
    assert [r.status_code for r in quick] == [200] * 4
    assert quick[0].headers["x-fivefold-replica"] == "replica-1", "the dead replica left routing"
    runner.join(300)
    *replies, stream_a, stream_b = results["out"]
    failed = [r for r in replies if r.status_code == 503]
    served = [r for r in replies if r.status_code == 200]
    assert len(failed) + len(served) == len(replies), [r.status_code for r in replies]
    for r in failed:
        error = r.json()["error"]
        assert error["code"] == "replica_unavailable" and "replica-0" in error["message"]
        assert r.headers["x-fivefold-replica"] == "replica-0"  # every response names its replica, errors too
    for r in served:
        assert r.headers["x-fivefold-replica"] == "replica-1" and r.json()["usage"]["completion_tokens"] == 3000
    streams_on_0 = 0
    for replica, status, lines in (stream_a, stream_b):
        if replica == "replica-0" and status == 503:  # died before the stream started: a plain 503 naming it
            streams_on_0 += 1
            assert json.loads(lines[-1])["error"]["code"] == "replica_unavailable"
        elif replica == "replica-0":  # the stream had started: it ends with the 503 as an error event
            streams_on_0 += 1
            assert json.loads(lines[-1])["error"]["code"] == 503
        else:
            assert lines[-1] == "[DONE]"
    assert in_flight == {"replica-0": 6, "replica-1": 6}
    assert len(failed) + streams_on_0 == 6, "every request in flight on replica-0 failed, and only those"
    assert len(served) + (2 - streams_on_0) == 6
    assert per_replica(url, "fivefold:replica_failed_requests_total")["replica-0"] == 6
    # Ray Serve restarts it, and the health watch puts it back in routing
    deadline = time.time() + 180
    while per_replica(url, "fivefold:replica_healthy")["replica-0"] != 1:
        assert time.time() < deadline, "replica-0 did not come back"
        time.sleep(0.5)
    assert per_replica(url, "fivefold:replica_restarts_total")["replica-0"] == 1
    served_by = {httpx.post(url + "/v1/completions", json=body, headers={"Cache-Control": "no-cache"},
                            timeout=60).headers["x-fivefold-replica"] for _ in range(2)}
    assert served_by == set(REPLICAS)




def test_idle_replica_death_is_noticed_and_metrics_do_not_hang(round_robin_redis):
    url = round_robin_redis
    os.kill(replica_pid("replica-1"), signal.SIGKILL)
    killed = time.time()
    while per_replica(url, "fivefold:replica_healthy")["replica-1"] != 0:
        assert time.time() - killed < 10, "an idle replica's death went unnoticed"
        time.sleep(0.1)
    start = time.time()
    httpx.get(url + "/metrics", timeout=10)
    assert time.time() - start < 3, "a scrape must not wait on a dead replica"
    deadline = time.time() + 180
    while per_replica(url, "fivefold:replica_healthy")["replica-1"] != 1:
        assert time.time() < deadline, "replica-1 did not come back"
        time.sleep(0.5)
    assert per_replica(url, "fivefold:replica_restarts_total")["replica-1"] == 1
