"""Replica lifecycle on Ray Serve, timed: start, a killed idle replica leaving routing,
its restart back into routing, and a SIGTERM drain, for `fivefold serve --replicas 2`.

    .venv/bin/python benchmarks/replica_failover.py [--model M] [--kv-cache-memory-bytes B]

The kill is a SIGKILL to replica-0's process (found by its Ray process title), as the
kernel's OOM killer would do it. Times are read from the front's own metrics
(``fivefold:replica_healthy``), polled every 50 ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from fivefold.bench.report import json_line, results_table  # noqa: E402
from fivefold.bench.server_process import serve_process  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.serve.cluster import metric_by_replica  # noqa: E402


def wait_health(url: str, replica: str, value: float, start: float, limit: float = 600) -> float:
    while metric_by_replica(httpx.get(url + "/metrics", timeout=30).text, "fivefold:replica_healthy").get(replica) != value:
        if time.time() - start > limit:
            raise TimeoutError(f"{replica} never reached healthy={value}")
        time.sleep(0.05)
    return time.time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=128 << 20)
    args = ap.parse_args()
    from rich.console import Console

    log = Path(tempfile.mkdtemp()) / "serve.log"
    start = time.time()
    with serve_process("--model", args.model, "--replicas", "2", "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
                       timeout=600, log_path=log) as (proc, url):
        started = time.time() - start
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        pids = subprocess.run(["pgrep", "-f", "ServeReplica:fivefold-replica-0:"], capture_output=True, text=True)
        os.kill(int(pids.stdout.split()[0]), signal.SIGKILL)
        killed = time.time()
        out_of_routing = wait_health(url, "replica-0", 0, killed)
        back = wait_health(url, "replica-0", 1, killed)
        stop = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stopped = time.time() - stop
    figures = {"start_s": started, "idle_death_out_of_routing_s": out_of_routing, "back_in_routing_s": back,
               "sigterm_to_exit_s": stopped, "exit_code": code}
    Console(width=120).print(results_table(
        f"fivefold serve --replicas 2 --model {args.model}: lifecycle",
        ("start -> serving s", "SIGKILL -> out of routing s", "SIGKILL -> back in routing s", "SIGTERM -> exit s",
         "exit code"),
        [(f"{started:.1f}", f"{out_of_routing:.2f}", f"{back:.1f}", f"{stopped:.1f}", str(code))]))
    print(json_line({"benchmark": "replica_failover", "model": args.model, **figures}))


if __name__ == "__main__":
    main()
