"""The dynamic batcher's knobs."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.errors import FivefoldError

# Geometric boundaries, ratio ~1.4: a request is padded by at most ~40% within its bucket,
# and the buckets stay few enough that each gets several requests at moderate load.
DEFAULT_LENGTH_BUCKETS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class BatcherConfig:
    """Limits of the dynamic batcher, validated on construction.

    max_batch_size: requests per batch.
    max_batch_tokens: padded tokens per batch (requests x longest length): what the
    forward computes and holds in memory. A longer single request is refused.
    max_queue_delay: seconds the oldest request of a bucket may wait for others, or
    "auto": auto_delay_factor x the model's single-request forward time, measured at start.
    length_buckets: ascending upper bounds of the length buckets; None or () puts every
    request in one bucket (no bucketing).
    max_queued_requests: beyond it, new requests are refused (HTTP 429); None: no limit.
    request_timeout: seconds a request may wait in the queue (HTTP 503 after); None: no limit.
    min_padding_efficiency: a batch with room left takes requests from shorter buckets while
    real / padded tokens stays at least this; 0 turns the top-up off.
    """

    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_queue_delay: float | str = "auto"
    length_buckets: tuple[int, ...] | None = DEFAULT_LENGTH_BUCKETS
    max_queued_requests: int | None = 1024
    request_timeout: float | None = None
    auto_delay_factor: float = 0.3
    min_padding_efficiency: float = 0.8
    history_size: int = 4096  # executed batches kept in memory for stats()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise FivefoldError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise FivefoldError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_queue_delay != "auto" and (not isinstance(self.max_queue_delay, (int, float))
                                               or not 0 <= self.max_queue_delay <= 10):
            raise FivefoldError(f"max_queue_delay must be 'auto' or seconds in [0, 10], got {self.max_queue_delay!r}")
        buckets = self.length_buckets or ()
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise FivefoldError(f"length_buckets must be strictly increasing positive lengths, got {buckets}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise FivefoldError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise FivefoldError(f"request_timeout must be positive, got {self.request_timeout}")
        if not 0 <= self.min_padding_efficiency <= 1:
            raise FivefoldError(f"min_padding_efficiency must be in [0, 1], got {self.min_padding_efficiency}")
        if not 0 < self.auto_delay_factor <= 10:
            raise FivefoldError(f"auto_delay_factor must be in (0, 10], got {self.auto_delay_factor}")
