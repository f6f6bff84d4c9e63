"""The responses objects of the OpenAPI document: each status with its description,
and every error body the one ErrorEnvelope."""

from __future__ import annotations

from typing import Any

__all__ = ["AUTH_ERRORS", "REF", "content", "responses"]

# Where msgspec's schemas point; the component schemas live there.
REF = "#/components/schemas/{name}"
# What any operator-authenticated route can answer besides its own errors.
AUTH_ERRORS = (401, 403, 503)
_DESCRIPTIONS = {
    200: "OK",
    202: "Accepted",
    400: "Malformed request or identifier",
    401: "Missing or invalid credential",
    403: "Credential valid but not allowed",
    404: "No such resource",
    409: "Conflicts with current state",
    413: "Body too large",
    416: "Offset or length outside the buffer",
    415: "Body is not JSON",
    422: "Request well-formed but invalid",
    429: "Too much load; retry after Retry-After seconds",
    503: "Not ready, shutting down or lane unavailable",
}


def content(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {media: {"schema": schema}}


def responses(ok: int, body: dict[str, Any] | None, errors: tuple[int, ...]) -> dict[str, Any]:
    error = content({"$ref": REF.format(name="ErrorEnvelope")})
    out: dict[str, Any] = {str(ok): {"description": _DESCRIPTIONS[ok]}}
    if body is not None:
        out[str(ok)]["content"] = body
    for status in errors:
        out[str(status)] = {"description": _DESCRIPTIONS[status], "content": error}
        if status == 429:
            out[str(status)]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out
