"""Errors the gateway raises itself, beyond the shared ones: bad API key, full queue, not ready."""

from __future__ import annotations

from shared.errors import PagedServeError


class AuthenticationError(PagedServeError):
    http_status = 401
    error_type = "authentication_error"


class RateLimitError(PagedServeError):
    http_status = 429
    error_type = "rate_limit_error"


class RequestTimeoutError(PagedServeError):
    http_status = 408
    error_type = "timeout_error"


class ServiceUnavailableError(PagedServeError):
    http_status = 503
    error_type = "service_unavailable_error"
