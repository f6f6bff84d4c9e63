"""JSON responses encoded with msgspec, errors in the one envelope."""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Response

from api.errors import ApiError

__all__ = ["error_response", "json_response"]

_encoder = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encoder.encode(body), status=status, headers=headers, content_type="application/json"
    )


def error_response(error: ApiError) -> Response:
    return json_response(error.envelope(), error.status, error.headers)
