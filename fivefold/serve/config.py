"""What one LLM server is started with (:class:`ServerConfig`), and the rule for the labels
(prompt version, cache namespace) that become part of result-cache keys and headers."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.errors import FivefoldError, InvalidRequestError

DEFAULT_MAX_BODY_BYTES = 1 << 20
LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_LABEL_CHARS = 64


def check_label(what: str, value: str) -> str:
    """A prompt version or cache namespace: 1-64 characters of letters, digits, '.', '_', '-'
    (they become part of Redis keys and HTTP headers)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_LABEL_CHARS or not set(value) <= LABEL_CHARS:
        raise InvalidRequestError(f"{what} must be 1-{MAX_LABEL_CHARS} characters of letters, digits, '.', '_' "
                                  f"or '-', got {value!r}"[:200])
    return value


@dataclass(frozen=True)
class ServerConfig:
    """One LLM server, as ``fivefold serve`` runs it alone or as each of ``--replicas`` (the
    config is what is sent to every replica)."""

    model: str
    served_model_name: str
    dtype: str = "float32"
    engine_options: dict = field(default_factory=dict)
    quantization: str | None = None  # "w8a16": quantized while loading
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    queue_timeout: float | None = None
    result_cache: str | None = "memory"  # None: off; "memory" or a redis:// URL
    result_cache_entries: int = 1024
    result_cache_bytes: int = 64 << 20
    prompt_version: str = "v1"
    cache_namespace: str = "default"  # separates deployments that share one Redis
    redis_configure_lru: bool = False  # let the cache set Redis's maxmemory and eviction policy
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    num_threads: int | None = None  # torch threads (a replica's share of its node); None: torch's default

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise FivefoldError(f"a server needs at least 1 thread, got {self.num_threads}")
        check_label("--prompt-version", self.prompt_version)
        check_label("--cache-namespace", self.cache_namespace)

    def make_result_cache(self, behind_front: bool = False):
        """The result cache this config names, or None (raises FivefoldError on a bad backend).

        A shared (Redis) cache is namespaced by ``cache_namespace`` and the weights' content
        fingerprint. ``behind_front``: a replica adopts the version stored there rather than
        the start-up one, so a replica restarted after an admin change never reverts it."""
        from fivefold.cache.factory import make_result_cache
        from fivefold.models.fingerprint import weights_fingerprint
        from fivefold.models.registry import resolve_model_path

        if self.result_cache is None:
            return None
        namespace = self.cache_namespace
        if self.result_cache != "memory":
            namespace = f"{namespace}:{weights_fingerprint(resolve_model_path(self.model))}"
        return make_result_cache(self.result_cache, self.result_cache_entries, self.result_cache_bytes,
                                 None if behind_front else self.prompt_version, namespace,
                                 self.redis_configure_lru)
