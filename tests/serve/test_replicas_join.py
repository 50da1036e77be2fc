"""`fivefold serve --replicas 1 --ray-address ADDR` joins a Ray cluster it did not start
(here one made by `ray start --head`, with Ray's default token authentication), serves
through it, and on exit deletes only its own applications: the cluster keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.serve.conftest import replica_cluster


def test_join_an_existing_cluster_and_leave_it_running(replica_model_dir, tmp_path_factory):
    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = os.environ | {"RAY_AUTH_MODE": "token"}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    probe = ("import ray, sys; from ray import serve; ray.init(address=sys.argv[1]); "
             "print(sorted(serve.status().applications), ray.available_resources().get('CPU'))")

    def cluster_state():
        out = subprocess.run([sys.executable, "-c", probe, f"127.0.0.1:{port}"], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    try:
        deadline = time.time() + 60
        while subprocess.run([ray_bin, "status", "--address", f"127.0.0.1:{port}"], capture_output=True,
                             env=env).returncode != 0:
            assert time.time() < deadline and head.poll() is None, "ray start --head did not come up"
            time.sleep(1)
        os.environ["RAY_AUTH_MODE"] = "token"  # for the serve process, which inherits it
        try:
            with replica_cluster(replica_model_dir, tmp_path_factory, "--ray-address", f"127.0.0.1:{port}",
                                 num_replicas=1) as (proc, url):
                body = {"model": replica_model_dir, "prompt": "w5 w6", "max_tokens": 3, "temperature": 0}
                reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert reply.status_code == 200 and reply.headers["x-fivefold-replica"] == "replica-0"
                assert cluster_state() == "['fivefold-replica-0'] 1.0"  # our replica holds one CPU
        finally:
            del os.environ["RAY_AUTH_MODE"]
        assert proc.returncode == 0
        assert cluster_state() == "[] 2.0", "our application is gone, the cluster is still up"
    finally:
        head.terminate()
        head.wait(60)
