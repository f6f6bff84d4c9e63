"""The error envelope every HTTP error uses, and the exception that carries it.

    ApiError(status, code, message, details)   -- raised by handlers
      -> rendered as ErrorEnvelope{error: ErrorBody{code, message, details}}

`code` is snake_case and stable; `message` is for people; `details` holds
typed context (the refused flag, the limit, the reason enum value).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ApiError", "ErrorBody", "ErrorEnvelope", "error_text"]


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    error: ErrorBody


class ApiError(Exception):
    """An HTTP error with an honest status and a typed code."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.headers = headers or {}

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(
            error=ErrorBody(code=self.code, message=self.message, details=self.details)
        )


def error_text(body: bytes) -> str:
    """`code: message` of an error answer, for a person; else the start of the body."""
    try:
        error = msgspec.json.decode(body, type=ErrorEnvelope).error
        return f"{error.code}: {error.message}"
    except msgspec.DecodeError:
        return body[:200].decode(errors="replace")
