from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import save_random_hf_model


@contextlib.contextmanager
def running_server(app):
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port in a thread; yield its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        limit_concurrency=1000))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def serve_process(*args: str, timeout: float = 120, log_path=None):
    """`fivefold serve ARGS` in a subprocess on a free port; yield (process, base URL) once
    /health answers. A process still running at the end gets SIGTERM (its graceful
    shutdown, which also stops the Ray it started), then SIGKILL if that takes over 60 s.
    With ``log_path`` its output goes to that file instead of pipes (a chatty process,
    such as one running Ray, would otherwise fill a pipe nobody reads and block)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w") if log_path else None
    proc = subprocess.Popen([sys.executable, "-m", "fivefold", "serve", "--port", str(port), *args],
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                if time.time() > deadline or proc.poll() is not None:
                    output = open(log_path).read() if log else proc.stderr.read() if proc.poll() is not None else ""
                    raise AssertionError(f"the server did not start: {output[-3000:] or 'timeout'}")
                time.sleep(0.3)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if log:
            log.close()


def wait_until_idle(engine, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while engine.has_unfinished and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)


# -- replicas on Ray Serve (test_replicas*.py) ---------------------------------------------
REPLICAS = ["replica-0", "replica-1"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3 {% endif %}")


@pytest.fixture(scope="session")
def replica_model_dir(tmp_path_factory):
    """A tiny Llama with a chat template and a long context (long requests for the kill test)."""
    directory = tmp_path_factory.mktemp("replica-model")
    save_random_hf_model("llama", directory, max_position_embeddings=4096)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return str(directory)


def replica_cluster(model_dir, tmp_path_factory, *args):
    """`fivefold serve --replicas 2` of ``model_dir`` (one module at a time: two clusters would share 2 cores)."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    return serve_process("--model", model_dir, "--replicas", "2", "--kv-cache-memory", str(32 << 20),
                         "--max-num-seqs", "16", *args, timeout=300, log_path=log)


def per_replica(url: str, name: str) -> dict[str, float]:
    """Sum of a metric's samples for each replica label, from the front's /metrics."""
    values = dict.fromkeys(REPLICAS, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and "replica" in s.labels:
                values[s.labels["replica"]] += s.value
    return values


