"""A fault anywhere in the engine thread or the batcher loop fails every request in flight
with a 500 internal_error body within a bound, turns /health to 503 and ends the server
(exit 1): never a hang, never a lost request."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import httpx
import pytest

from fivefold.batching.batcher import DynamicBatcher
from fivefold.batching.config import BatcherConfig
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.errors import EngineDeadError
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server

BOUND_S = 10.0  # no request may wait longer than this after the fault


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("faulty")
    save_random_hf_model("llama", path, seed=2)
    return load_model(str(path))


class Fault:
    """Raises once armed: patched into one place of the engine thread at a time."""

    def __init__(self, inner=None) -> None:
        self.inner, self.is_armed = inner, False

    def __call__(self, *args, **kwargs):
        if self.is_armed:
            raise RuntimeError("injected fault\nsecond line of the message")
        return self.inner(*args, **kwargs) if self.inner is not None else None


def _inject(engine: AsyncEngine, place: str) -> Fault:
    if place == "step":
        fault = Fault(engine.engine.step)
        engine.engine.step = fault
    elif place == "abort":  # abort handling in the inbox
        fault = Fault(engine.engine.abort)
        engine.engine.abort = fault
    elif place == "queue update":
        fault = Fault(engine._update_queue)
        engine._update_queue = fault
    elif place == "metrics":
        fault = Fault()
        engine.metrics = SimpleNamespace(observe_step=fault, request_aborted=lambda _id: None)
    else:
        raise ValueError(place)
    return fault


@pytest.mark.parametrize("place", ["step", "abort", "queue update", "metrics"])
def test_a_fault_anywhere_in_the_engine_thread_fails_every_request_within_the_bound(tiny, place):
    fatal = []
    engine = AsyncEngine(LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_memory_bytes=1 << 20)),
                         on_fatal=fatal.append)
    fault = _inject(engine, place)
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def scenario():
        engine.admission.reserve(["q"], 3)  # a queue entry, so that the queue bookkeeping runs
        results: dict[str, object] = {}

        async def consume(rid: str):
            try:
                async for _ in engine.generate(rid, [5, 6, 7], params):
                    results.setdefault(rid, "running")
                results[rid] = "finished"
            except EngineDeadError as exc:
                results[rid] = exc

        tasks = [asyncio.ensure_future(consume(f"r{i}")) for i in range(3)]
        deadline = time.monotonic() + 30
        while len(results) < 3:
            assert time.monotonic() < deadline, results
            await asyncio.sleep(0.01)
        fault.is_armed = True
        if place == "abort":
            engine.abort("r0")
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
        waited = time.monotonic() - started
        return results, waited

    results, waited = asyncio.run(scenario())
    assert waited < BOUND_S
    for rid in ("r1", "r2"):  # r0 may have been aborted before the abort raised
        assert isinstance(results[rid], EngineDeadError), results
        assert str(results[rid]) == "the engine failed: RuntimeError: injected fault"
    engine._thread.join(BOUND_S)  # on_fatal runs after the errors are delivered, still in the engine thread
    assert len(fatal) == 1 and not engine.is_running

    async def after():  # refused at once, never queued behind a dead thread
        async for _ in engine.generate("late", [5, 6], params):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(after(), 2))
    engine.shutdown()


def test_the_server_answers_500_internal_error_and_reports_unhealthy(tiny):
    engine = AsyncEngine(LLMEngine(tiny, EngineConfig(block_size=4, kv_cache_memory_bytes=1 << 20)))
    fault = _inject(engine, "step")
    app = build_app(engine, "tiny")
    long = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    with running_server(app) as url:
        assert httpx.get(url + "/health").status_code == 200
        replies: dict[str, httpx.Response | list[str]] = {}

        def post():
            replies["plain"] = httpx.post(url + "/v1/completions", json=long, timeout=60)

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                replies["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=post), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while len(engine.engine.requests) < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        fault.is_armed = True
        for t in threads:
            t.join(BOUND_S)
            assert not t.is_alive(), "a request outlived the bound"
        plain = replies["plain"]
        assert plain.status_code == 500
        error = plain.json()["error"]
        assert error.pop("request_id") == plain.headers["x-request-id"]
        assert error == {"message": "the engine failed: RuntimeError: injected fault",
                         "type": "internal_error", "param": None, "code": 500}
        *_, error_event, done = replies["stream"]  # the stream had started: the error comes as an event
        assert '"type": "internal_error"' in error_event and "injected fault" in error_event
        assert done == "data: [DONE]"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "unhealthy"
        late = httpx.post(url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
        assert late.status_code == 500 and late.json()["error"]["type"] == "internal_error"
    engine.shutdown()


@pytest.mark.parametrize("place", ["next batch", "on_batch"])
def test_a_fault_in_the_batcher_loop_fails_every_queued_request(place):
    fatal = []
    gate = threading.Event()

    def run_batch(payloads):
        gate.wait(5)
        return [p * 2 for p in payloads]

    def on_batch(_record):
        if place == "on_batch":
            raise RuntimeError("injected fault")

    batcher = DynamicBatcher(run_batch, BatcherConfig(max_batch_size=2, max_batch_tokens=64, max_queue_delay=0.0),
                             on_batch=on_batch, on_fatal=fatal.append)
    futures: list[Future] = batcher.submit_many([(i, 4) for i in range(6)])
    if place == "next batch":
        original = batcher._next_batch
        batcher._next_batch = lambda: (_ for _ in ()).throw(RuntimeError("injected fault")) if gate.is_set() \
            else original()
    gate.set()
    deadline = time.monotonic() + BOUND_S
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
        except EngineDeadError as exc:
            outcomes.append(str(exc))
    assert time.monotonic() < deadline
    # The batch in hand finished (or failed) and every other request failed; none is left waiting.
    assert all(f.done() for f in futures)
    assert "the engine failed: RuntimeError: injected fault" in outcomes
    batcher._thread.join(BOUND_S)  # on_fatal runs after the futures fail, still in the worker thread
    assert len(fatal) == 1 and not batcher.is_running
    with pytest.raises(EngineDeadError):
        batcher.submit(1, 4)
    batcher.shutdown()


def test_fivefold_serve_exits_1_when_its_engine_fails():
    from fivefold.cli.serve import _run_uvicorn
    from tests.conftest import free_port

    worker = SimpleNamespace(on_fatal=None)
    from fivefold.cli import build_parser

    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", str(free_port()), "--shutdown-grace", "1"])

    async def app(scope, receive, send):  # a bare ASGI app: only the exit path is under test
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    status = []
    thread = threading.Thread(target=lambda: status.append(_run_uvicorn(app, args, worker)))
    thread.start()
    deadline = time.time() + 20
    while worker.on_fatal is None:
        assert time.time() < deadline
        time.sleep(0.01)
    time.sleep(0.5)
    worker.on_fatal(RuntimeError("injected fault"))
    thread.join(20)
    assert status == [1]
