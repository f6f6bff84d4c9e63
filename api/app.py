"""The HTTP application factory (Quart-trio); handlers live in api/routes_*.py."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from api.errors import ApiError
from node.readiness import Readiness

__all__ = ["MAX_BODY_BYTES", "create_app", "json_response"]

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024
_encoder = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encoder.encode(body), status=status, headers=headers, content_type="application/json"
    )


def _error_response(error: ApiError) -> Response:
    return json_response(error.envelope(), error.status, error.headers)


def create_app(readiness: Readiness) -> QuartTrio:
    app = QuartTrio("litegraph_node")
    # Quart refuses bodies over this before a handler reads them (413).
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BODY_TIMEOUT"] = 10
    app.config["RESPONSE_TIMEOUT"] = 60

    @app.errorhandler(ApiError)
    async def on_api_error(error: ApiError) -> Response:
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = (error.name or "error").lower().replace(" ", "_")
        return _error_response(ApiError(status, code, error.description or code))

    @app.errorhandler(Exception)
    async def on_unexpected(error: Exception) -> Response:
        log.exception("unhandled error in a request handler")
        return _error_response(ApiError(500, "internal_error", "internal error"))

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        if readiness.ready:
            return json_response({"status": "ready"})
        return _error_response(
            ApiError(503, "not_ready", "the node is not ready", {"reasons": readiness.reasons()})
        )

    return app
