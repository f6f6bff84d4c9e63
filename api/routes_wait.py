"""POST /v1/invocations:wait: learn that invocations ended without polling (a long-poll
with a bounded wait)."""

from __future__ import annotations

import trio
from quart import Response
from quart_trio import QuartTrio

from api.context import NodeContext
from api.http import ANY_OPERATOR, decode_body, ready_supervisor, require_role
from api.responses import json_response
from supervisor.core import Supervisor, UnknownInvocation
from supervisor.wire import InvocationState, InvocationStatus, WaitReply, WaitRequest

__all__ = ["register_wait_routes"]

_RUNNING = frozenset({InvocationState.queued, InvocationState.running})


async def _wait(sup: Supervisor, ids: list[str], *, first: bool) -> None:
    events = [e for e in (sup.until_ended(i) for i in ids) if e is not None]
    if first and len(events) < len(ids):
        return  # one of them has already ended (or is unknown)
    if not first:
        # Most of a batch ends together: an event already set costs no pass through the
        # scheduler (waiting on it would checkpoint once per id).
        for event in events:
            if not event.is_set():
                await event.wait()
        return
    async with trio.open_nursery() as nursery:

        async def one(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(one, event)


def _reply(sup: Supervisor, ids: list[str]) -> WaitReply:
    ended: list[InvocationStatus] = []
    pending: list[str] = []
    unknown: list[str] = []
    for invocation_id in ids:
        try:
            status = sup.get(invocation_id)
        except UnknownInvocation:
            unknown.append(invocation_id)
            continue
        if status.state in _RUNNING:
            pending.append(invocation_id)
        else:
            ended.append(status)
    return WaitReply(ended=ended, pending=pending, unknown=unknown)


def register_wait_routes(app: QuartTrio, ctx: NodeContext) -> None:
    # A custom method on the collection, like :batch; ids cannot hold ':'.
    @app.post("/v1/invocations:wait")
    async def wait_invocations() -> Response:
        require_role(ctx, ANY_OPERATOR)
        sup = ready_supervisor(ctx)
        asked: WaitRequest = await decode_body(WaitRequest)
        ids = list(dict.fromkeys(asked.ids))  # each once, in the order asked
        with trio.move_on_after(asked.timeout_s):
            await _wait(sup, ids, first=asked.any)
        return json_response(_reply(sup, ids))
