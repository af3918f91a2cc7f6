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
    """The model named by the user does not exist locally (weights are never fetched)."""

    http_status = 404
    error_type = "not_found_error"
