"""Snapshot, events stream, metrics and OpenAPI (the status page: `routes_status.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.event_stream import HEARTBEAT_SECONDS, event_frames, only_ids, resume_point
from api.http import ADMIN, ANY_OPERATOR, ready_supervisor, require_role
from api.metrics import CONTENT_TYPE
from api.openapi import openapi_document
from api.responses import json_response
from api.wire import NodeStatus
from supervisor.events import TooManySubscribers

__all__ = ["register_node_routes"]


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
            only = only_ids(request.args.get("ids"))
        except ValueError as exc:
            raise ApiError(400, "invalid_ids", str(exc)) from None
        after = resume_point(hub, request.headers.get("Last-Event-ID"))
        try:
            subscription = hub.subscribe(after)
            stream = await subscription.__aenter__()
        except TooManySubscribers as exc:
            raise ApiError(
                429, "too_many_subscribers", str(exc), headers={"Retry-After": "5"}
            ) from None
        # More often than a client that shares the server's read timeout gives up.
        heartbeat = min(HEARTBEAT_SECONDS, ctx.http.read_timeout / 2)

        async def body() -> AsyncIterator[bytes]:
            try:
                async with contextlib.aclosing(
                    event_frames(hub, stream, heartbeat, only)
                ) as frames:
                    async for frame in frames:
                        yield frame
            finally:
                await subscription.__aexit__(None, None, None)

        response = Response(body(), content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-store"
        response.timeout = None  # a stream lives as long as its subscriber
        return response

    def node_status() -> NodeStatus:
        sup = ready_supervisor(ctx)
        return NodeStatus(
            node_id=sup.machine.node_id,
            ready=ctx.readiness.ready,
            readiness_reasons=ctx.readiness.reasons(),
            drained=sup.drained,
            invocations={state.value: n for state, n in sup.counts().items()},
        )

    @app.get("/v1/node")
    async def node() -> Response:
        require_role(ctx, ANY_OPERATOR)
        return json_response(node_status())

    # Whole-node drain: admin only, idempotent, in memory (a restart admits again).
    @app.post("/v1/node/drain")
    async def drain_node() -> Response:
        require_role(ctx, ADMIN)
        ready_supervisor(ctx).set_node_drained(True)
        return json_response(node_status())

    @app.post("/v1/node/resume")
    async def resume_node() -> Response:
        require_role(ctx, ADMIN)
        ready_supervisor(ctx).set_node_drained(False)
        return json_response(node_status())

    @app.get("/metrics")
    async def metrics() -> Response:
        if ctx.http.metrics_auth:
            require_role(ctx, ANY_OPERATOR)
        return Response(ctx.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return Response(openapi, content_type="application/json")
