"""``fivefold serve`` in a subprocess on a free port, for benchmarks and tests that need
a real server process (a replicated one starts Ray, which wants its own process)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time


@contextlib.contextmanager
def serve_process(*args: str, timeout: float = 120, log_path=None, launcher: list[str] | None = None):
    """`fivefold serve ARGS` in a subprocess on a free port; yield (process, base URL) once
    /health answers. ``launcher`` replaces ``python -m fivefold`` (benchmarks/soak.py starts
    the same CLI through a wrapper that can inject an engine fault). A process still running at the end gets SIGTERM (its graceful
    shutdown, which also stops the Ray it started), then SIGKILL if that takes over 60 s.
    With ``log_path`` its output goes to that file instead of pipes (a chatty process,
    such as one running Ray, would otherwise fill a pipe nobody reads and block)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w") if log_path else None
    launcher = launcher or [sys.executable, "-m", "fivefold"]
    proc = subprocess.Popen([*launcher, "serve", "--port", str(port), *args],
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
