"""`litegraph-node run -- CMD ...`: submit a process invocation, stream every byte of its
stdout to ours and its stderr to ours as it is written (GET .../logs, follow), wait for
its end (POST /v1/invocations:wait), exit with its status; cancel on Ctrl-C.

A node that stops under it answers first (its API serves until its running work has
ended): `run` says how the invocation ended, `cancelled (shutdown)`, and exits with
that state's status. A node that goes away without an answer (killed, the connection
lost for good) gets one line saying so and NODE_GONE_EXIT."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import BinaryIO, TypeVar, cast

import httpx
import msgspec
import trio

from api.errors import ErrorEnvelope, error_text
from supervisor.wire import (
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    ProcessWork,
    WaitReply,
    WaitRequest,
)

__all__ = [
    "BROKEN_PIPE_EXIT",
    "NODE_GONE_EXIT",
    "LogsLost",
    "NodeGone",
    "OutputClosed",
    "follow_command",
    "follow_log",
]

# How long one wait lasts while the invocation is queued (so `running` shows at once).
STATE_SECONDS = 0.25
# ... and once it runs (the node answers the moment it ends).
END_SECONDS = 30.0
REQUEST_SECONDS = 15.0
# A log stream cut by the network is resumed from its offset this many times in a row.
RESUMES = 5
RESUME_SECONDS = 0.5
EXIT_CODES = {
    InvocationState.succeeded: 0,
    InvocationState.cancelled: 130,
    InvocationState.timed_out: 124,
}
# Ended by Ctrl-C, as a shell reports a death by SIGINT.
INTERRUPTED_EXIT = 130
# Our own stdout closed early (`run ... | head`): what a shell reports for SIGPIPE.
BROKEN_PIPE_EXIT = 141
SECOND_INTERRUPT = (
    "second Ctrl-C: not waiting for the node's answer; the cancel may not have reached it"
    " (`litegraph-node ls` shows where the invocation stands)"
)
# The node went away before it said how the invocation ended (sysexits' EX_UNAVAILABLE).
NODE_GONE_EXIT = 69


class LogsLost(Exception):
    """The node no longer answers for the invocation."""


class NodeGone(LogsLost):
    """The node stopped answering at all (refused, reset, cut) and did not come back."""


class OutputClosed(Exception):
    """Whoever reads our output stopped reading."""


def _error_text(reply: httpx.Response) -> str:
    return error_text(reply.content)


# After a refused cwd: `run` sent its current folder unless told otherwise.
CWD_HINT = (
    "litegraph-node run: the process starts in the folder run sends, the current one "
    "unless --cwd DIR names another; --cwd none sends none, and it starts in its "
    "private /tmp (a node allows a cwd only under its --guest-cwd-roots; dev: the "
    "folder it was started in)"
)


CWD_FALLBACK = (
    "litegraph-node run: starting it in its private /tmp instead "
    "(--cwd DIR insists on a folder; --cwd none says so)"
)


def _error_code(reply: httpx.Response) -> str | None:
    try:
        return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code
    except msgspec.DecodeError:
        return None


def _say(err: BinaryIO, line: str) -> None:
    err.write(line.encode() + b"\n")
    err.flush()


def _generator(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """httpx's chunk iterator is an async generator (typed as an iterator): closed at
    once when the copy stops early, never left to the garbage collector."""
    return cast("AsyncGenerator[bytes, None]", chunks)


async def follow_log(
    client: httpx.AsyncClient,
    invocation_id: str,
    stream: str,
    sink: BinaryIO,
    *,
    follow: bool = True,
) -> None:
    """Copy one log stream into `sink`, byte for byte, as it is written; returns once
    every byte was copied (with `follow`, once the invocation's output is complete).
    A connection cut on the way is resumed from the last byte copied."""
    offset, resumed = 0, 0
    params = {"stream": stream, "follow": "1" if follow else "0"}
    # No read deadline: a quiet guest sends nothing for as long as it likes.
    timeout = httpx.Timeout(REQUEST_SECONDS, read=None)
    while True:
        try:
            async with client.stream(
                "GET",
                f"/v1/invocations/{invocation_id}/logs",
                params={**params, "offset": str(offset)},
                timeout=timeout,
            ) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    raise LogsLost(_error_text(reply))
                async with contextlib.aclosing(_generator(reply.aiter_bytes())) as chunks:
                    async for chunk in chunks:
                        try:
                            sink.write(chunk)
                            sink.flush()
                        except BrokenPipeError:
                            raise OutputClosed from None
                        offset += len(chunk)
                        resumed = 0
            return
        except httpx.TransportError as exc:
            resumed += 1
            if resumed > RESUMES:
                raise NodeGone(f"the {stream} stream broke: {exc!r}") from None
            await trio.sleep(RESUME_SECONDS)


async def follow_command(
    base_url: str,
    secret: str,
    request: InvocationRequest,
    *,
    out: BinaryIO | None = None,
    err: BinaryIO | None = None,
    cwd_fallback: bool = False,
) -> int:
    """Submit `request` and follow it to its end; its exit status. `cwd_fallback`: a
    refused cwd (one run chose, not the user) is dropped and the request sent again
    without it, once, with a line saying so."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    invocation_id = request.id
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=REQUEST_SECONDS
    ) as client:
        # Ctrl-C is taken as a signal, not raised as KeyboardInterrupt wherever the
        # code happens to be (half way through a request, a lock held), from before the
        # submission on: one during the submission (bounded) waits for the node's
        # answer and cancels what it accepted; one later cancels the follow at its
        # checkpoints; a second one stops the wait for the cancel's answer.
        with _interrupts() as interrupts:
            try:
                accepted = await _submit(client, request, err, cwd_fallback)
                if accepted is False:
                    return 1
                ended = None
                if accepted:
                    ended = await _until_interrupted(
                        interrupts, _follow(client, invocation_id, out, err)
                    )
                if ended is not None:
                    return ended
                closed = False
            except BaseException as raised:  # the reader left, or the caller's cancel
                closed = isinstance(raised, OutputClosed)
                if not closed:
                    with trio.CancelScope(shield=True):
                        await _say_cancel(client, invocation_id, base_url, err, interrupts)
                    raise
            await _say_cancel(client, invocation_id, base_url, err, interrupts)
        return BROKEN_PIPE_EXIT if closed else INTERRUPTED_EXIT


async def _submit(
    client: httpx.AsyncClient, request: InvocationRequest, err: BinaryIO, cwd_fallback: bool
) -> bool:
    """Submit `request`; whether the node accepted it (a refusal is said)."""
    reply = await client.post("/v1/invocations", content=msgspec.json.encode(request))
    work = request.work
    if (
        cwd_fallback
        and reply.status_code == 422
        and _error_code(reply) == "invalid_cwd"
        and isinstance(work, ProcessWork)
    ):
        _say(err, f"litegraph-node run: {_error_text(reply)}")
        _say(err, CWD_FALLBACK)
        # A refusal changed nothing at the node: the id is still free.
        request = msgspec.structs.replace(request, work=msgspec.structs.replace(work, cwd=None))
        reply = await client.post("/v1/invocations", content=msgspec.json.encode(request))
    if reply.status_code != 202:
        _say(err, f"litegraph-node run: refused ({reply.status_code}) {_error_text(reply)}")
        if _error_code(reply) == "invalid_cwd":
            _say(err, CWD_HINT)
        return False
    _say(err, f"{request.id}: submitted")
    return True


_T = TypeVar("_T")


def _interrupts() -> contextlib.AbstractContextManager[AsyncIterator[int] | None]:
    """Ctrl-C's signals, where they arrive: only Python's main thread gets them."""
    if threading.current_thread() is threading.main_thread():
        return trio.open_signal_receiver(signal.SIGINT)
    return contextlib.nullcontext()


async def _until_interrupted(
    interrupts: AsyncIterator[int] | None, work: Coroutine[object, object, _T]
) -> _T | None:
    """What `work` returns, or None once an interrupt came (`work` cancelled); what
    `work` raises, as it raised it."""
    if interrupts is None:
        return await work
    found: list[_T] = []
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in interrupts:
                    nursery.cancel_scope.cancel()
                    return

            async def run() -> None:
                found.append(await work)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(run)
    except BaseExceptionGroup as group:
        # Only `work` raises (or both tasks an outer cancel's Cancelled): not wrapped.
        raise group.exceptions[0] from None
    return found[0] if found else None


async def _say_cancel(
    client: httpx.AsyncClient,
    invocation_id: str,
    base_url: str,
    err: BinaryIO,
    interrupts: AsyncIterator[int] | None,
) -> None:
    """Ask the node to cancel and say its answer; a second Ctrl-C stops the wait."""
    answer = await _until_interrupted(interrupts, _cancel(client, invocation_id, base_url))
    _say(err, f"\n{invocation_id}: {SECOND_INTERRUPT if answer is None else answer}")


def _gone(base_url: str) -> str:
    return f"the node at {base_url} went away"


def _ending(status: InvocationStatus) -> str:
    """Its state and, where the node gave one, why: `cancelled (shutdown)`."""
    return f"{status.state.value} ({status.reason})" if status.reason else status.state.value


async def _cancel(client: httpx.AsyncClient, invocation_id: str, base_url: str) -> str:
    """Ask the node to cancel (Ctrl-C, or the reader left) and say what it answered:
    the state it ended in, why it was not cancelled, or that no answer came in time."""
    # Not shielded here: a second Ctrl-C stops it (`_say_cancel`); the caller's own
    # cancel is shielded from by follow_command.
    with trio.move_on_after(REQUEST_SECONDS):
        try:
            reply = await client.delete(f"/v1/invocations/{invocation_id}")
        except httpx.TimeoutException:
            pass
        except httpx.TransportError:
            return f"not cancelled: {_gone(base_url)}"
        else:
            if reply.status_code != 200:
                return f"not cancelled: ({reply.status_code}) {_error_text(reply)}"
            try:
                return _ending(msgspec.json.decode(reply.content, type=InvocationStatus))
            except msgspec.DecodeError:
                return "not cancelled: the node's answer could not be read"
    return f"not cancelled: the node at {base_url} did not answer in {REQUEST_SECONDS:.0f} s"


async def _wait(
    client: httpx.AsyncClient, invocation_id: str, seconds: float
) -> InvocationStatus | None:
    """Its status once it has ended, or None after `seconds` (still queued or running)."""
    asked = WaitRequest(ids=[invocation_id], timeout_s=seconds)
    reply = await client.post(
        "/v1/invocations:wait",
        content=msgspec.json.encode(asked),
        timeout=REQUEST_SECONDS + seconds,
    )
    if reply.status_code != 200:
        raise LogsLost(_error_text(reply))
    waited = msgspec.json.decode(reply.content, type=WaitReply)
    if waited.unknown:
        raise LogsLost("unknown_invocation: no such invocation")
    return waited.ended[0] if waited.ended else None


async def _status(client: httpx.AsyncClient, invocation_id: str) -> InvocationStatus:
    reply = await client.get(f"/v1/invocations/{invocation_id}")
    if reply.status_code != 200:
        raise LogsLost(_error_text(reply))
    return msgspec.json.decode(reply.content, type=InvocationStatus)


async def _until_ended(
    client: httpx.AsyncClient, invocation_id: str, err: BinaryIO
) -> InvocationStatus:
    """Wait for the end, saying when the invocation starts to run. A request cut on
    the way is asked again, up to RESUMES times in a row; then the node is gone."""
    state: InvocationState | None = InvocationState.queued
    tries = 0
    while True:
        seconds = STATE_SECONDS if state is InvocationState.queued else END_SECONDS
        try:
            ended = await _wait(client, invocation_id, seconds)
            if ended is not None:
                return ended
            status = await _status(client, invocation_id)
        except httpx.TransportError as exc:
            tries += 1
            if tries > RESUMES:
                raise NodeGone(f"waiting for its end: {exc!r}") from None
            await trio.sleep(RESUME_SECONDS)
            continue
        tries = 0
        if status.state is not state:
            state = status.state
            _say(err, f"{invocation_id}: {state.value}")


async def _follow(
    client: httpx.AsyncClient, invocation_id: str, out: BinaryIO, err: BinaryIO
) -> int:
    """Both streams and the end, at once; the end is said after the last byte."""
    ended: list[InvocationStatus] = []
    problems: list[BaseException] = []

    async def guarded(job: Callable[..., Awaitable[None]], *args: object) -> None:
        try:
            await job(*args)
        except (LogsLost, OutputClosed) as exc:
            problems.append(exc)
            nursery.cancel_scope.cancel()

    async def end() -> None:
        ended.append(await _until_ended(client, invocation_id, err))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guarded, follow_log, client, invocation_id, "stdout", out)
        nursery.start_soon(guarded, follow_log, client, invocation_id, "stderr", err)
        nursery.start_soon(guarded, end)
    if problems and isinstance(problems[0], OutputClosed):
        raise problems[0]
    if problems and ended:
        # The node said how it ended before its logs were cut off (it stopped): say
        # that, and that the output is not whole, rather than that nothing is known.
        _say(err, f"{invocation_id}: the rest of its output was lost: {problems[0]}")
    elif problems:
        if isinstance(problems[0], NodeGone):
            # One line, not the transport's own words ("All connection attempts failed").
            _say(
                err,
                f"litegraph-node run: {_gone(str(client.base_url).rstrip('/'))} before"
                f" {invocation_id} ended; how it ended is unknown",
            )
            return NODE_GONE_EXIT
        _say(err, f"litegraph-node run: lost the invocation: {problems[0]}")
        return 1
    status = ended[0]
    _say(err, f"{invocation_id}: {_ending(status)}")
    if status.logs_cut:
        _say(err, f"{invocation_id}: output cut short on the node: {status.logs_cut}")
    if status.state is InvocationState.failed and status.exit_code is not None:
        return status.exit_code if status.exit_code > 0 else 128 - status.exit_code
    return EXIT_CODES.get(status.state, 1)
