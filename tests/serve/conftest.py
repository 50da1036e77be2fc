from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from fivefold.bench.server_process import serve_process  # noqa: F401  (the tests' import path)
from fivefold.serve.cluster import metric_by_replica
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


def replica_cluster(model_dir, tmp_path_factory, *args, num_replicas: int = 2):
    """`fivefold serve --replicas N` of ``model_dir`` (one module at a time: two clusters would share 2 cores)."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    return serve_process("--model", model_dir, "--replicas", str(num_replicas), "--kv-cache-memory-bytes", str(32 << 20),
                         "--max-num-seqs", "16", *args, timeout=300, log_path=log)


def per_replica(url: str, name: str) -> dict[str, float]:
    """A metric's value for each replica (0 where absent), from the front's /metrics."""
    return dict.fromkeys(REPLICAS, 0.0) | metric_by_replica(httpx.get(url + "/metrics").text, name)
