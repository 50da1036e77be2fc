"""Graceful shutdown of `fivefold serve`: on SIGTERM it stops accepting, lets the
in-flight request finish within the grace period, then exits."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.serve.conftest import serve_process


def test_sigterm_lets_in_flight_requests_finish():
    with serve_process("--shutdown-grace", "20", "--kv-cache-memory-bytes", str(64 << 20)) as (proc, url):
        body = {"prompt": "Count slowly:", "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        usage, accepted_new, signalled = None, None, False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not signalled:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                    signalled = True
                    time.sleep(0.5)
                    try:  # no longer accepting
                        httpx.get(url + "/health", timeout=2)
                        accepted_new = True
                    except httpx.TransportError:
                        accepted_new = False
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
        assert usage is not None and usage["completion_tokens"] == 48, "the in-flight request must complete"
        assert accepted_new is False
        # uvicorn re-raises the signal once the graceful shutdown is done
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
