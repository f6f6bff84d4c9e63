"""The HTTP application factory (Quart-trio); handlers live in api/routes_*.py."""

from __future__ import annotations

import logging

from quart import Request, Response
from quart_trio import QuartTrio
from werkzeug.exceptions import BadHost, HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from api.context import NodeContext
from api.errors import ApiError
from api.responses import error_response, json_response
from api.routes_docs import register_docs_routes
from api.routes_invocations import register_invocation_routes
from api.routes_keys import register_key_routes
from api.routes_lanes import LaneRequest, register_lane_routes
from api.routes_node import register_node_routes
from api.routes_status import register_status_routes
from api.routes_wait import register_wait_routes

__all__ = ["MAX_BODY_BYTES", "create_app"]

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024


class NodeApp(QuartTrio):
    """Quart-trio with a Host that cannot be routed answered 400, not 500."""

    async def handle_request(self, request: Request) -> Response | WerkzeugResponse:
        try:
            return await super().handle_request(request)
        except BadHost:
            # Raised while binding the URL map (a Host label over 63 characters or
            # empty), before any error handler could turn it into an answer.
            return error_response(
                ApiError(400, "bad_host", "the Host header is not a valid host name")
            )


def create_app(ctx: NodeContext) -> QuartTrio:
    app = NodeApp("litegraph_node")
    app.request_class = LaneRequest  # uploads may be bigger than JSON bodies
    # Quart refuses bodies over this before a handler reads them (413).
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BODY_TIMEOUT"] = ctx.http.body_timeout
    app.config["RESPONSE_TIMEOUT"] = 60
    # No 308 redirects to a "normalised" path (e.g. /v1/lanes/..%2F/work): an API
    # answers the path it was sent, with an error if it names nothing.
    app.url_map.merge_slashes = False

    @app.errorhandler(ApiError)
    async def on_api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = (error.name or "error").lower().replace(" ", "_")
        return error_response(ApiError(status, code, error.description or code))

    @app.errorhandler(Exception)
    async def on_unexpected(error: Exception) -> Response:
        log.exception("unhandled error in a request handler")
        return error_response(ApiError(500, "internal_error", "internal error"))

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        if ctx.readiness.ready:
            return json_response({"status": "ready", "notes": ctx.readiness.notes()})
        return error_response(
            ApiError(
                503, "not_ready", "the node is not ready", {"reasons": ctx.readiness.reasons()}
            )
        )

    register_node_routes(app, ctx)
    register_status_routes(app, ctx)
    register_invocation_routes(app, ctx)
    register_wait_routes(app, ctx)
    register_lane_routes(app, ctx)
    register_key_routes(app, ctx)
    register_docs_routes(app)
    return app
