"""Errors the gateway raises itself, beyond the shared ones: bad API key, full queue, not ready."""

from __future__ import annotations

# RateLimitError and ServiceUnavailableError are shared with the scheduler.
from shared.errors import (  # noqa: F401
    PagedServeError,
    RateLimitError,
    ServiceUnavailableError,
)


class AuthenticationError(PagedServeError):
    http_status = 401
    error_type = "authentication_error"


class RequestTimeoutError(PagedServeError):
    http_status = 408
    error_type = "timeout_error"
