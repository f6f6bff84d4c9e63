"""`litegraph-node run -- CMD ...`: submit its process invocation, follow it (waiting for
its end with POST /v1/invocations:wait, printing output as it comes), cancel on Ctrl-C."""

from __future__ import annotations

import sys
from typing import TextIO

import httpx
import msgspec
import trio

from api.errors import error_text
from supervisor.wire import (
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    WaitReply,
    WaitRequest,
)

__all__ = ["follow_command"]

# How long one wait lasts before the output written so far is printed.
OUTPUT_SECONDS = 0.25
REQUEST_SECONDS = 15.0
EXIT_CODES = {
    InvocationState.succeeded: 0,
    InvocationState.cancelled: 130,
    InvocationState.timed_out: 124,
}


class _Lost(Exception):
    """The node no longer answers for the invocation."""


def _new_output(tail: str, total: int, printed: int) -> tuple[str, int]:
    """What of `tail` was not printed yet, given the byte counts."""
    fresh = total - printed
    if fresh <= 0:
        return "", printed
    data = tail.encode()
    if fresh > len(data):
        return f"[... {fresh - len(data)} bytes not kept ...]\n" + tail, total
    return data[-fresh:].decode(errors="replace"), total


def _error_text(reply: httpx.Response) -> str:
    return error_text(reply.content)


async def follow_command(
    base_url: str,
    secret: str,
    request: InvocationRequest,
    *,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    invocation_id = request.id
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=REQUEST_SECONDS
    ) as client:
        reply = await client.post("/v1/invocations", content=msgspec.json.encode(request))
        if reply.status_code != 202:
            print(
                f"litegraph-node run: refused ({reply.status_code}) {_error_text(reply)}", file=err
            )
            return 1
        print(f"{invocation_id}: submitted", file=err, flush=True)
        try:
            return await _follow(client, invocation_id, out, err)
        except BaseException:
            with trio.move_on_after(REQUEST_SECONDS, shield=True):
                await client.delete(f"/v1/invocations/{invocation_id}")
                print(f"\n{invocation_id}: cancelled", file=err, flush=True)
            raise


async def _wait(client: httpx.AsyncClient, invocation_id: str) -> InvocationStatus | None:
    """Its status once it has ended, or None after OUTPUT_SECONDS (still running)."""
    asked = WaitRequest(ids=[invocation_id], timeout_s=OUTPUT_SECONDS)
    reply = await client.post("/v1/invocations:wait", content=msgspec.json.encode(asked))
    if reply.status_code != 200:
        raise _Lost(_error_text(reply))
    waited = msgspec.json.decode(reply.content, type=WaitReply)
    if waited.unknown:
        raise _Lost("unknown_invocation: no such invocation")
    return waited.ended[0] if waited.ended else None


async def _status(client: httpx.AsyncClient, invocation_id: str) -> InvocationStatus:
    reply = await client.get(f"/v1/invocations/{invocation_id}")
    if reply.status_code != 200:
        raise _Lost(_error_text(reply))
    return msgspec.json.decode(reply.content, type=InvocationStatus)


async def _follow(client: httpx.AsyncClient, invocation_id: str, out: TextIO, err: TextIO) -> int:
    """Wait for the end (the node answers the moment it ends); between waits, print
    the output written so far."""
    printed_out = printed_err = 0
    state: InvocationState | None = None
    while True:
        try:
            ended = await _wait(client, invocation_id)
            status = ended if ended is not None else await _status(client, invocation_id)
        except _Lost as lost:
            print(f"litegraph-node run: lost the invocation: {lost}", file=err)
            return 1
        text, printed_out = _new_output(status.stdout_tail, status.stdout_bytes, printed_out)
        out.write(text)
        text, printed_err = _new_output(status.stderr_tail, status.stderr_bytes, printed_err)
        err.write(text)
        out.flush()
        if status.state is not state:
            state = status.state
            reason = f" ({status.reason})" if status.reason else ""
            print(f"{invocation_id}: {state.value}{reason}", file=err, flush=True)
        if state in (InvocationState.queued, InvocationState.running):
            continue
        if state is InvocationState.failed and status.exit_code is not None:
            return status.exit_code if status.exit_code > 0 else 128 - status.exit_code
        return EXIT_CODES.get(state, 1)
