"""Snapshot, events stream, metrics, OpenAPI and the workstation status page."""

from __future__ import annotations

import importlib.resources
from collections.abc import AsyncIterator

import msgspec
from quart import Response
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.http import ANY_OPERATOR, is_loopback, require_role
from api.metrics import CONTENT_TYPE
from api.openapi import openapi_document
from supervisor.events import Dropped, TooManySubscribers

__all__ = ["register_node_routes"]

_STATUS_PAGE = importlib.resources.files("api").joinpath("static/index.html")


def register_node_routes(app: QuartTrio, ctx: NodeContext) -> None:
    openapi = msgspec.json.encode(openapi_document())

    @app.get("/v1/snapshot")
    async def snapshot() -> Response:
        require_role(ctx, ANY_OPERATOR)
        if ctx.snapshots is None:
            raise ApiError(
                503, "not_ready", "the node is starting", {"reasons": ctx.readiness.reasons()}
            )
        return Response(ctx.snapshots.encoded(), content_type="application/json")

    @app.get("/v1/events")
    async def events() -> Response:
        require_role(ctx, ANY_OPERATOR)
        if ctx.events is None:
            raise ApiError(503, "not_ready", "the node is starting")
        hub = ctx.events
        try:
            subscription = hub.subscribe()
            stream = await subscription.__aenter__()
        except TooManySubscribers as exc:
            raise ApiError(
                429, "too_many_subscribers", str(exc), headers={"Retry-After": "5"}
            ) from None

        async def body() -> AsyncIterator[bytes]:
            try:
                yield b": connected\n\n"
                async for item in stream:
                    if isinstance(item, Dropped):
                        data = msgspec.json.encode({"missed_from": item.missed_from})
                        yield b"event: dropped\ndata: " + data + b"\n\n"
                        return
                    data = msgspec.json.encode(item.event)
                    head = f"id: {item.sequence}\nevent: {item.event.kind.value}\n".encode()
                    yield head + b"data: " + data + b"\n\n"
            finally:
                await subscription.__aexit__(None, None, None)

        response = Response(body(), content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-store"
        response.timeout = None  # a stream lives as long as its subscriber
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        if ctx.http.metrics_auth:
            require_role(ctx, ANY_OPERATOR)
        return Response(ctx.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return Response(openapi, content_type="application/json")

    @app.get("/")
    async def status_page() -> Response:
        if not is_loopback():
            raise ApiError(403, "loopback_only", "the status page is served on loopback only")
        return Response(_STATUS_PAGE.read_bytes(), content_type="text/html; charset=utf-8")
