"""Batch formation on a fake model whose timing the test controls."""

from __future__ import annotations

import threading
import time

import pytest

from fivefold.batching.batcher import DynamicBatcher
from fivefold.batching.config import BatcherConfig
from fivefold.errors import FivefoldError, InvalidRequestError, OverloadedError, QueueTimeoutError


class FakeModel:
    """Records each batch's payloads; the first batch can be held until ``release()``."""

    def __init__(self, hold_first: bool = False, seconds: float = 0.0) -> None:
        self.batches: list[list] = []
        self.seconds = seconds
        self._gate = threading.Event()
        self.is_holding = threading.Event()
        if not hold_first:
            self._gate.set()

    def __call__(self, payloads: list) -> list:
        if not self._gate.is_set():
            self.is_holding.set()
            self._gate.wait(10)
        self.batches.append(list(payloads))
        time.sleep(self.seconds)
        return [("done", p) for p in payloads]

    def release(self) -> None:
        self._gate.set()


def _batcher(model, delay=0.0, **config):
    return DynamicBatcher(model, BatcherConfig(max_queue_delay=delay, **config), on_batch=None)


def _hold(model: FakeModel, batcher: DynamicBatcher):
    """Occupy the worker with a first request so that what follows queues up."""
    first = batcher.submit("first", 1)
    assert model.is_holding.wait(5)
    return first


def test_size_limit_then_delay():
    model = FakeModel()
    batcher = _batcher(model, delay=0.3, max_batch_size=4, length_buckets=None)
    futures = batcher.submit_many([(i, 10) for i in range(10)])
    assert [f.result(5) for f in futures] == [("done", i) for i in range(10)]
    assert [len(b) for b in model.batches] == [4, 4, 2]
    records = list(batcher.history)
    assert max(records[0].queue_times) < 0.2  # full batches leave at once
    assert min(records[2].queue_times) >= 0.29  # the remainder waited for the delay
    batcher.shutdown()


def test_token_limit_counts_padded_tokens():
    model = FakeModel()
    batcher = _batcher(model, delay=0.2, max_batch_size=32, max_batch_tokens=100, length_buckets=None)
    futures = batcher.submit_many([(i, 30) for i in range(7)])
    for f in futures:
        f.result(5)
    assert [len(b) for b in model.batches] == [3, 3, 1]  # 4 x 30 = 120 > 100
    assert all(r.padded_tokens <= 100 for r in batcher.history)
    with pytest.raises(InvalidRequestError, match="101 tokens exceeds max_batch_tokens \\(100\\)"):
        batcher.submit("long", 101)
    batcher.shutdown()


def test_lone_request_waits_the_delay_and_no_longer():
    model = FakeModel()
    batcher = _batcher(model, delay=0.2)
    start = time.monotonic()
    assert batcher.submit("x", 5).result(5) == ("done", "x")
    waited = time.monotonic() - start
    assert 0.19 <= waited < 1.0
    batcher.shutdown()


def test_length_buckets_keep_short_requests_from_long_ones():
    lengths = [10, 60, 12, 50, 14]
    padded = {}
    for buckets in ((16, 64), None):
        model = FakeModel(hold_first=True)
        batcher = _batcher(model, delay=0.0, max_batch_size=8, length_buckets=buckets)
        first = _hold(model, batcher)
        futures = batcher.submit_many([(n, n) for n in lengths])
        model.release()
        for f in [first, *futures]:
            f.result(5)
        batches = [sorted(b) for b in model.batches[1:]]
        padded[buckets] = sum(r.padded_tokens for r in list(batcher.history)[1:])
        if buckets:
            assert batches == [[10, 12, 14], [50, 60]]
        else:
            assert batches == [sorted(lengths)]
        batcher.shutdown()
    assert padded[(16, 64)] == 3 * 14 + 2 * 60 and padded[None] == 5 * 60


def test_oldest_bucket_first_and_arrival_order_inside_a_bucket():
    model = FakeModel(hold_first=True)
    batcher = _batcher(model, delay=0.0, max_batch_size=2, length_buckets=(16, 64))
    first = _hold(model, batcher)
    order = [("a", 40), ("b", 5), ("c", 41), ("d", 6), ("e", 42), ("f", 7)]
    futures = [batcher.submit(name, n) for name, n in order]
    model.release()
    assert [f.result(5) for f in futures] == [("done", name) for name, _ in order]
    first.result(5)
    assert model.batches[1:] == [["a", "c"], ["b", "d"], ["e"], ["f"]]
    batcher.shutdown()


def test_queue_timeout_fails_the_request_without_running_it():
    model = FakeModel(hold_first=True)
    batcher = _batcher(model, delay=0.0)
    first = _hold(model, batcher)
    late = batcher.submit("late", 3, timeout=0.1)
    patient = batcher.submit("patient", 3)
    time.sleep(0.3)
    model.release()
    with pytest.raises(QueueTimeoutError, match="the limit is 0.100 s"):
        late.result(5)
    assert patient.result(5) == ("done", "patient") and first.result(5)
    assert all("late" not in b for b in model.batches)
    batcher.shutdown()


def test_queue_limit_rejects_all_or_nothing():
    model = FakeModel(hold_first=True)
    rejected = []
    batcher = DynamicBatcher(model, BatcherConfig(max_queue_delay=0.0, max_queued_requests=2),
                             on_reject=rejected.append)
    first = _hold(model, batcher)
    queued = batcher.submit_many([("a", 1), ("b", 1)])
    with pytest.raises(OverloadedError, match="the limit is 2"):
        batcher.submit("c", 1)
    with pytest.raises(OverloadedError):
        batcher.submit_many([("d", 1), ("e", 1)])
    assert batcher.num_queued == 2 and rejected == ["queue_full", "queue_full"]
    model.release()
    assert [f.result(5) for f in queued] == [("done", "a"), ("done", "b")] and first.result(5)
    batcher.shutdown()


def test_cancelled_request_never_runs():
    model = FakeModel(hold_first=True)
    batcher = _batcher(model, delay=0.0)
    first = _hold(model, batcher)
    a, b, c = (batcher.submit(name, 2) for name in "abc")
    assert b.cancel() and batcher.num_queued == 2
    model.release()
    assert a.result(5) == ("done", "a") and c.result(5) == ("done", "c") and first.result(5)
    assert ["b"] not in model.batches and all("b" not in batch for batch in model.batches)
    batcher.shutdown()


def test_model_error_reaches_every_request_of_the_batch():
    def broken(payloads):
        raise RuntimeError("boom")

    batcher = DynamicBatcher(broken, BatcherConfig(max_queue_delay=0.05))
    futures = batcher.submit_many([(1, 1), (2, 1)])
    for f in futures:
        with pytest.raises(RuntimeError, match="boom"):
            f.result(5)
    batcher.shutdown()


def test_config_is_validated():
    with pytest.raises(FivefoldError, match="max_queue_delay must be 'auto' or seconds"):
        BatcherConfig(max_queue_delay="soon")
    with pytest.raises(FivefoldError, match="strictly increasing"):
        BatcherConfig(length_buckets=(32, 16))
    with pytest.raises(FivefoldError, match="max_batch_size must be >= 1"):
        BatcherConfig(max_batch_size=0)


def test_room_left_is_topped_up_from_shorter_buckets_within_the_padding_target():
    model = FakeModel(hold_first=True)
    batcher = _batcher(model, delay=0.0, max_batch_size=8, length_buckets=(16, 64), min_padding_efficiency=0.7)
    first = _hold(model, batcher)
    futures = batcher.submit_many([(n, n) for n in (60, 14, 58, 13, 3)])
    model.release()
    for f in [first, *futures]:
        f.result(5)
    # (60 + 58 + 14) / (3 x 60) = 0.73 >= 0.7; adding 13 would give 0.60, so it waits.
    assert model.batches[1:] == [[60, 58, 14], [13, 3]]
    assert [round(r.real_tokens / r.padded_tokens, 2) for r in list(batcher.history)[1:]] == [0.73, 0.62]
    batcher.shutdown()
