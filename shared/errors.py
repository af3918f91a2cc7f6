"""Errors that travel to the user: each maps to one HTTP status and an OpenAI-style error type."""

from __future__ import annotations


class PagedServeError(Exception):
    """Base of every error we report to a client."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(PagedServeError, ValueError):
    """The request itself is wrong (bad value, prompt too long); retrying it will not help."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(PagedServeError, FileNotFoundError):
    """The model named by the user is no local model, nor a Hub id in the cache or reachable."""

    http_status = 404
    error_type = "not_found_error"


class RateLimitError(PagedServeError):
    """Too much is queued already: the same request may succeed later (Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(PagedServeError):
    """The server cannot serve the request now (a part of it failed or is overloaded)."""

    http_status = 503
    error_type = "service_unavailable_error"
