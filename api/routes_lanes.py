"""Lane work for token holders, and drain/resume for admins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio
from quart import Response, request
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.http import ADMIN, LANE_ID, check_identifier, decode_body, ready_supervisor, require_role
from api.responses import json_response
from api.unix_server import peer_of
from capabilities import LaneOp, RefreshTooEarly, TokenRefusal, TokenRefused
from node.machine.snapshot import rfc3339
from supervisor.core import Supervisor
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import LaneWorkRequest, TokenReply, lane_op

__all__ = ["register_lane_routes"]

# Who the token is (401) versus what it may do (403).
FORBIDDEN = frozenset(
    {
        TokenRefusal.WRONG_AUDIENCE,
        TokenRefusal.OP_NOT_GRANTED,
        TokenRefusal.VRAM_OVER_BUDGET,
        TokenRefusal.WRONG_HOLDER,
    }
)


def _bearer() -> str:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        raise ApiError(
            401,
            "missing_token",
            "lane work needs a capability token: Authorization: Bearer v4.public...",
            headers={"WWW-Authenticate": 'Bearer realm="litegraph-lanes"'},
        )
    return header[len("Bearer ") :].strip()


@contextlib.contextmanager
def _lane_errors(ctx: NodeContext) -> Iterator[None]:
    """Token refusals and lane failures as the error envelope with honest statuses."""
    try:
        yield
    except TokenRefused as refused:
        ctx.metrics.token_refusals.labels(refused.reason.value).inc()
        status = 403 if refused.reason in FORBIDDEN else 401
        raise ApiError(
            status, refused.reason.value, f"capability token refused: {refused.reason.value}"
        ) from None
    except LaneWorkError as failed:
        retry = {"Retry-After": "1"} if failed.status == 429 else None
        raise ApiError(failed.status, failed.code, str(failed), headers=retry) from None
    except trio.TooSlowError:
        raise ApiError(503, "lane_timeout", "the lane did not answer in time") from None


def _check_holder(sup: Supervisor, lane_id: str, token: str, op: LaneOp) -> None:
    peer = peer_of(request.scope)
    if peer is not None:  # over TCP a token is a bearer token (threat-model/, B2)
        sup.check_holder(lane_id, token, op, peer.uid)


def register_lane_routes(app: QuartTrio, ctx: NodeContext) -> None:
    @app.post("/v1/lanes/<lane_id>/work")
    async def lane_work(lane_id: str) -> Response:
        check_identifier(lane_id, LANE_ID, "lane_id")
        token = _bearer()
        sup = ready_supervisor(ctx)
        with _lane_errors(ctx):
            sup.lane_caller(lane_id, token)  # no valid token: refused before the body is read
        work: LaneWorkRequest = await decode_body(LaneWorkRequest)
        started = trio.current_time()
        try:
            with _lane_errors(ctx):
                _check_holder(sup, lane_id, token, lane_op(work))
                reply = await sup.lane_work(lane_id, token, work)
        finally:
            ctx.metrics.lane_work_seconds.labels(type(work).__struct_config__.tag).observe(
                trio.current_time() - started
            )
        return json_response(reply)

    @app.post("/v1/lanes/<lane_id>/token")
    async def refresh_token(lane_id: str) -> Response:
        check_identifier(lane_id, LANE_ID, "lane_id")
        token = _bearer()
        sup = ready_supervisor(ctx)
        with _lane_errors(ctx):
            _check_holder(sup, lane_id, token, LaneOp.EXECUTE)
            try:
                minted = sup.refresh_token(lane_id, token)
            except RefreshTooEarly as early:
                # Refresh at most once per half life: it must not be a way to make work.
                raise ApiError(
                    429,
                    "refresh_too_early",
                    str(early),
                    {"retry_after": early.retry_after},
                    headers={"Retry-After": str(early.retry_after)},
                ) from None
        return json_response(
            TokenReply(lane_id=lane_id, token=minted.token, expires_at=rfc3339(minted.claims.exp))
        )

    async def _set_drained(lane_id: str, drained: bool) -> Response:
        require_role(ctx, ADMIN)
        check_identifier(lane_id, LANE_ID, "lane_id")
        sup = ready_supervisor(ctx)
        if sup.machine.ledger.lane(lane_id) is None:
            raise ApiError(404, "unknown_lane", "no such lane")
        sup.set_drained(lane_id, drained)
        return json_response({"lane_id": lane_id, "drained": drained})

    @app.post("/v1/lanes/<lane_id>/drain")
    async def drain(lane_id: str) -> Response:
        return await _set_drained(lane_id, True)

    @app.post("/v1/lanes/<lane_id>/resume")
    async def resume(lane_id: str) -> Response:
        return await _set_drained(lane_id, False)
