from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time


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
def serve_process(*args: str, timeout: float = 120):
    """`fivefold serve ARGS` in a subprocess on a free port; yield (process, base URL) once
    /health answers. The process is killed on exit if it is still running."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fivefold", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
                time.sleep(0.3)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def wait_until_idle(engine, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while engine.has_unfinished and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
