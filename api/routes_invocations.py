"""POST/GET/DELETE /v1/invocations and POST /v1/invocations:batch: the scheduler's way
to run work on this node."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import AsyncIterator

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.http import (
    ANY_OPERATOR,
    check_identifier,
    decode_body,
    ready_supervisor,
    require_role,
)
from api.responses import json_response
from supervisor.admission import AdmissionRefused
from supervisor.core import Supervisor, UnknownInvocation
from supervisor.listing import (
    MAX_LABEL_FILTERS,
    MAX_LIST_LIMIT,
    InvalidCursor,
    ListQuery,
    decode_cursor,
)
from supervisor.logread import read_log
from supervisor.logstore import STREAMS, InvocationLogs
from supervisor.wire import (
    INVOCATION_ID,
    LABEL_KEY,
    MAX_LABEL_VALUE,
    BatchItem,
    BatchItemError,
    BatchReply,
    BatchRequest,
    InvocationRequest,
    InvocationState,
    SubmitResponse,
)

__all__ = ["MAX_LOG_READERS", "register_invocation_routes"]

# Log streams open at once (each holds a file and a connection).
MAX_LOG_READERS = 256
_MAX_OFFSET = 2**62

LIST_PARAMETERS = frozenset({"state", "label", "limit", "cursor"})
_LIMIT = re.compile(r"[0-9]{1,4}")
_ACTIVE = frozenset({InvocationState.queued, InvocationState.running})


def _one(name: str) -> str | None:
    values = request.args.getlist(name)
    if len(values) > 1:
        raise ApiError(400, f"invalid_{name}", f"give {name} at most once", {"field": name})
    return values[0] if values else None


def _label_filters() -> tuple[tuple[str, str], ...]:
    """`label=key=value`, repeated: the labels an invocation must all hold."""
    values = request.args.getlist("label")
    if len(values) > MAX_LABEL_FILTERS:
        raise ApiError(
            400,
            "invalid_label",
            f"give label at most {MAX_LABEL_FILTERS} times",
            {"field": "label", "max": MAX_LABEL_FILTERS},
        )
    wanted: set[tuple[str, str]] = set()
    for text in values:
        key, equals, value = text.partition("=")
        if not equals or not LABEL_KEY.fullmatch(key) or len(value) > MAX_LABEL_VALUE:
            raise ApiError(
                400,
                "invalid_label",
                f"label is key=value: a label key, then at most {MAX_LABEL_VALUE} characters",
                {"field": "label"},
            )
        wanted.add((key, value))
    return tuple(sorted(wanted))


def list_query() -> ListQuery:
    """The list's query string, checked: any bad value is a typed 400, nothing is guessed."""
    unknown = sorted(set(request.args) - LIST_PARAMETERS)
    if unknown:
        raise ApiError(
            400,
            "unknown_parameter",
            f"unknown query parameter {unknown[0]!r}",
            {"field": unknown[0], "allowed": sorted(LIST_PARAMETERS)},
        )
    states: set[InvocationState] = set()
    for value in request.args.getlist("state"):
        try:
            states.add(InvocationState(value))
        except ValueError:
            raise ApiError(
                400,
                "invalid_state",
                f"{value!r} is not an invocation state",
                {"field": "state", "allowed": [s.value for s in InvocationState]},
            ) from None
    limit = _one("limit")
    if limit is not None and not (_LIMIT.fullmatch(limit) and 1 <= int(limit) <= MAX_LIST_LIMIT):
        raise ApiError(
            400,
            "invalid_limit",
            f"limit is a whole number from 1 to {MAX_LIST_LIMIT}",
            {"field": "limit", "max": MAX_LIST_LIMIT},
        )
    cursor = _one("cursor")
    try:
        after = None if cursor is None else decode_cursor(cursor)
    except InvalidCursor as exc:
        raise ApiError(400, "invalid_cursor", str(exc), {"field": "cursor"}) from None
    query = ListQuery(states=frozenset(states) or None, labels=_label_filters(), after=after)
    return query if limit is None else msgspec.structs.replace(query, limit=int(limit))


async def _submit_one(
    ctx: NodeContext, sup: Supervisor, invocation: InvocationRequest
) -> SubmitResponse:
    """Submit; every refusal is the ApiError a single submission answers with."""
    try:
        return await sup.submit(invocation)
    except trio.TooSlowError:
        raise ApiError(
            503,
            "admission_timeout",
            "the first submission of this id is still pending",
            headers={"Retry-After": "1"},
        ) from None
    except AdmissionRefused as refused:
        ctx.metrics.admission_refusals.labels(refused.reason).inc()
        headers = {}
        if refused.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(refused.retry_after)))
        raise ApiError(
            refused.status, refused.reason, str(refused), refused.details, headers
        ) from None


async def _batch_item(
    ctx: NodeContext, sup: Supervisor, invocation: InvocationRequest
) -> BatchItem:
    try:
        accepted = await _submit_one(ctx, sup, invocation)
    except ApiError as refused:
        retry = refused.headers.get("Retry-After")
        return BatchItem(
            id=invocation.id,
            status=refused.status,
            error=BatchItemError(
                code=refused.code, message=refused.message, details=refused.details
            ),
            retry_after_s=None if retry is None else int(retry),
        )
    return BatchItem(id=invocation.id, status=202, accepted=accepted)


def _log_query() -> tuple[str, int, bool]:
    """(stream, offset, follow) from the query; 400 `invalid_query` for anything else."""
    unknown = sorted(set(request.args) - {"stream", "offset", "follow"})
    if unknown:
        raise ApiError(400, "invalid_query", f"unknown query parameter {unknown[0]!r}")
    stream = request.args.get("stream", "stdout")
    offset_text = request.args.get("offset", "0")
    follow_text = request.args.get("follow", "0")
    if stream not in STREAMS:
        raise ApiError(400, "invalid_query", "stream: stdout or stderr")
    if not offset_text.isdigit() or int(offset_text) > _MAX_OFFSET:
        raise ApiError(400, "invalid_query", f"offset: a byte offset from 0 to {_MAX_OFFSET}")
    if follow_text not in ("0", "1"):
        raise ApiError(400, "invalid_query", "follow: 0 or 1")
    return stream, int(offset_text), follow_text == "1"


def _find_logs(sup: Supervisor, invocation_id: str) -> InvocationLogs | None:
    """Its logs; None for an ended invocation that wrote nothing (it has no files, and
    after a restart no entry either: its logs are empty, not lost)."""
    logs = sup.logs.find(invocation_id) if sup.logs is not None else None
    if logs is not None:
        return logs
    try:
        status = sup.get(invocation_id)
    except UnknownInvocation:
        raise ApiError(404, "unknown_invocation", "no such invocation") from None
    wrote = status.stdout_bytes or status.stderr_bytes
    if sup.logs is not None and not wrote and status.state not in _ACTIVE:
        return None
    raise ApiError(404, "logs_unavailable", "its logs were not kept or are removed")


def _log_response(
    sup: Supervisor, logs: InvocationLogs | None, query: tuple[str, int, bool]
) -> Response:
    store = sup.logs
    assert store is not None
    if logs is None:
        return _no_store(Response(b"", content_type="application/octet-stream"))
    if store.readers >= MAX_LOG_READERS:
        raise ApiError(
            429, "too_many_readers", "too many log streams are open", headers={"Retry-After": "5"}
        )
    stream, offset, follow = query

    async def body() -> AsyncIterator[bytes]:
        store.readers += 1  # counted only once it runs: a body never sent never leaks it
        try:
            async with contextlib.aclosing(read_log(logs, stream, offset, follow=follow)) as data:
                async for chunk in data:
                    yield chunk
        finally:
            store.readers -= 1

    response = Response(body(), content_type="application/octet-stream")
    response.timeout = None  # a follower lives as long as the invocation's output
    return _no_store(response)


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"
    return response


def register_invocation_routes(app: QuartTrio, ctx: NodeContext) -> None:
    @app.post("/v1/invocations")
    async def submit() -> Response:
        require_role(ctx, ANY_OPERATOR)
        sup = ready_supervisor(ctx)
        invocation: InvocationRequest = await decode_body(InvocationRequest)
        return json_response(await _submit_one(ctx, sup, invocation), 202)

    # A custom method on the collection (no resource is created for the batch itself);
    # ids cannot hold ':', so it never shadows /v1/invocations/{id}.
    @app.post("/v1/invocations:batch")
    async def submit_batch() -> Response:
        require_role(ctx, ANY_OPERATOR)
        sup = ready_supervisor(ctx)
        batch: BatchRequest = await decode_body(BatchRequest)
        results: list[BatchItem | None] = [None] * len(batch.invocations)

        async def one(index: int, invocation: InvocationRequest) -> None:
            results[index] = await _batch_item(ctx, sup, invocation)

        # Concurrently, so that the items' reservations share group commits; each item
        # goes through admission (idempotency, queue bound, validation) on its own.
        async with trio.open_nursery() as nursery:
            for index, invocation in enumerate(batch.invocations):
                nursery.start_soon(one, index, invocation)
        return json_response(BatchReply(results=[r for r in results if r is not None]))

    @app.get("/v1/invocations")
    async def list_invocations() -> Response:
        require_role(ctx, ANY_OPERATOR)
        query = list_query()
        return json_response(ready_supervisor(ctx).list_page(query))

    # `path:` so that an id with an (encoded) slash is refused as an identifier (400),
    # not passed over by the router.
    @app.get("/v1/invocations/<path:invocation_id>")
    async def get_invocation(invocation_id: str) -> Response:
        require_role(ctx, ANY_OPERATOR)
        check_identifier(invocation_id, INVOCATION_ID, "invocation_id")
        try:
            return json_response(ready_supervisor(ctx).get(invocation_id))
        except UnknownInvocation:
            raise ApiError(404, "unknown_invocation", "no such invocation") from None

    # Every byte of one stream, from `offset`; with follow=1, live until the last byte.
    @app.get("/v1/invocations/<invocation_id>/logs")
    async def invocation_logs(invocation_id: str) -> Response:
        require_role(ctx, ANY_OPERATOR)
        check_identifier(invocation_id, INVOCATION_ID, "invocation_id")
        query = _log_query()
        sup = ready_supervisor(ctx)
        return _log_response(sup, _find_logs(sup, invocation_id), query)

    @app.delete("/v1/invocations/<path:invocation_id>")
    async def cancel_invocation(invocation_id: str) -> Response:
        require_role(ctx, ANY_OPERATOR)
        check_identifier(invocation_id, INVOCATION_ID, "invocation_id")
        try:
            # Answers only once everything the invocation held is released.
            return json_response(await ready_supervisor(ctx).cancel(invocation_id))
        except trio.TooSlowError:
            raise ApiError(
                503, "cancel_timeout", "the invocation did not release in time; it is being killed"
            ) from None
        except UnknownInvocation:
            raise ApiError(404, "unknown_invocation", "no such invocation") from None
