"""User-facing errors.

Every problem caused by the user's input (a bad path, an unsupported model, an
out-of-range parameter) is raised as a :class:`FivefoldError` whose message is one
line that names the problem and, where there is one, the limit. The CLI prints the
message and exits non-zero; the server maps it to an OpenAI-style error body.
"""


class FivefoldError(Exception):
    """An error whose message is meant for the user, never a traceback."""


class ModelLoadError(FivefoldError):
    """The model could not be found, parsed or is not supported."""


class InvalidRequestError(FivefoldError):
    """A request or a parameter is out of range."""


class OverloadedError(FivefoldError):
    """The server's queue is full (HTTP 429, with Retry-After)."""


class QueueTimeoutError(FivefoldError):
    """A request waited in the queue longer than allowed (HTTP 503)."""


class ReplicaUnavailableError(FivefoldError):
    """The engine replica serving a request died or cannot be reached (HTTP 503)."""


class EngineDeadError(FivefoldError):
    """The engine (or batcher) thread failed: every request in flight gets this (HTTP 500,
    ``type: internal_error``), the server reports unhealthy and exits non-zero."""

    @classmethod
    def from_exception(cls, exc: BaseException) -> "EngineDeadError":
        """The one-line error naming what failed."""
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        return cls(f"the engine failed: {type(exc).__name__}" + (f": {first_line}" if first_line else ""))
