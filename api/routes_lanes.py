"""Lane work for token holders, and drain/resume for admins."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.wrappers import TrioRequest

from api.context import NodeContext
from api.errors import ApiError
from api.http import ADMIN, check_identifier, decode_body, ready_supervisor, require_role
from api.peer import peer_bound, peer_uid
from api.responses import json_response
from capabilities import LaneOp, RefreshTooEarly, TokenRefusal, TokenRefused
from machine.snapshot import rfc3339
from supervisor.core import Supervisor
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import (
    BUFFER_ID_PATTERN,
    MAX_TRANSFER_BYTES,
    Download,
    LaneJob,
    LaneWorkRequest,
    TokenReply,
    Upload,
    lane_op,
)
from supervisor.wire import LANE_ID

__all__ = ["LaneRequest", "register_lane_routes"]

_BUFFER_ID = re.compile(BUFFER_ID_PATTERN)
_UPLOAD_PATH = re.compile(r"^/v1/lanes/[^/]+/buffers/[^/]+$")


class LaneRequest(TrioRequest):
    """A buffer upload's body may be up to MAX_TRANSFER_BYTES; every other body
    keeps the app's small limit. Set before any byte is read, so a bigger body
    is still refused (413) unread."""

    def __init__(self, method: str, scheme: str, path: str, *args: Any, **kwargs: Any) -> None:
        if method == "PUT" and _UPLOAD_PATH.match(path):
            kwargs["max_content_length"] = MAX_TRANSFER_BYTES
        super().__init__(method, scheme, path, *args, **kwargs)


def _int_arg(name: str, default: int | None, top: int) -> int:
    text = request.args.get(name)
    if text is None:
        if default is None:
            raise ApiError(400, "invalid_request", f"{name} is required", {"field": name})
        return default
    if not text.isdigit() or len(text) > 19:
        raise ApiError(400, "invalid_request", f"{name} must be an integer", {"field": name})
    if int(text) > top:
        raise ApiError(400, "invalid_request", f"{name} must be at most {top}", {"field": name})
    return int(text)


# Who the token is (401) versus what it may do (403).
FORBIDDEN = frozenset(
    {
        TokenRefusal.WRONG_AUDIENCE,
        TokenRefusal.OP_NOT_GRANTED,
        TokenRefusal.VRAM_OVER_BUDGET,
        TokenRefusal.WRONG_HOLDER,
    }
)


# What the caller can do about it; never a claim or the detail behind the refusal.
_HINTS = {
    TokenRefusal.WRONG_HOLDER: (
        " (a guest's token works only from its guest's own uid: on the node's Unix"
        " socket, or over TCP from a socket of that uid on this host)"
    ),
}


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
        hint = _HINTS.get(refused.reason, "")
        raise ApiError(
            status, refused.reason.value, f"capability token refused: {refused.reason.value}{hint}"
        ) from None
    except LaneWorkError as failed:
        retry = {"Retry-After": "1"} if failed.status == 429 else None
        raise ApiError(failed.status, failed.code, str(failed), headers=retry) from None
    except trio.TooSlowError:
        raise ApiError(503, "lane_timeout", "the lane did not answer in time") from None


def _check_holder(sup: Supervisor, lane_id: str, token: str, op: LaneOp) -> None:
    # The kernel's word on who sent it, on either transport, and the socket (api/peer.py).
    sup.check_holder(lane_id, token, op, peer_uid(request.scope), peer_bound(request.scope))


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

    async def _buffer_job(lane_id: str, buffer_id: str, job: LaneJob | None) -> Any:
        check_identifier(lane_id, LANE_ID, "lane_id")
        check_identifier(buffer_id, _BUFFER_ID, "buffer_id")
        token = _bearer()
        sup = ready_supervisor(ctx)
        with _lane_errors(ctx):
            sup.lane_caller(lane_id, token)  # no valid token: refused before the body is read
        if job is None:  # an upload: its body, now that the token is known good
            if request.mimetype != "application/octet-stream":
                raise ApiError(415, "unsupported_media_type", "send application/octet-stream")
            offset = _int_arg("offset", 0, 2**62)
            body = await request.get_data(as_text=False)
            data = body if isinstance(body, bytes) else body.encode()
            job = Upload(buffer_id=buffer_id, offset=offset, data=data)
        with _lane_errors(ctx):
            _check_holder(sup, lane_id, token, lane_op(job))
            if isinstance(job, Download):
                return await sup.lane_download(lane_id, token, job)
            return await sup.lane_work(lane_id, token, job)

    @app.put("/v1/lanes/<lane_id>/buffers/<buffer_id>")
    async def upload(lane_id: str, buffer_id: str) -> Response:
        return json_response(await _buffer_job(lane_id, buffer_id, None))

    @app.get("/v1/lanes/<lane_id>/buffers/<buffer_id>")
    async def download(lane_id: str, buffer_id: str) -> Response:
        check_identifier(lane_id, LANE_ID, "lane_id")
        check_identifier(buffer_id, _BUFFER_ID, "buffer_id")
        work = Download(
            buffer_id=buffer_id,
            offset=_int_arg("offset", 0, 2**62),
            length=_int_arg("length", None, MAX_TRANSFER_BYTES),
        )
        data: bytes = await _buffer_job(lane_id, buffer_id, work)
        return Response(data, status=200, content_type="application/octet-stream")

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
