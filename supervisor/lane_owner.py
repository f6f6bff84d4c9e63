"""Lane owners: one trio task per lane owns that lane's mutable state.

The presented capability token is checked before anything is queued (a
junk or foreign token never takes a place), then work waits in the lane's
`FairQueue`: each invocation has its own bounded share, served in turn, and a
full share refuses at once (`LaneBusy`, 429 at the edge). When its turn comes
the owner validates the token again for this lane, the operation and the
VRAM the invocation would then hold. An owner that crashes is restarted; more than
`max_restarts` crashes within `window` seconds fault the lane (it leaves
allocatable) and its pending work is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections import deque
from collections.abc import Callable

import msgspec
import trio

from capabilities import Claims, LaneOp, LaneValidator, TokenRefusal, TokenRefused
from node.machine.lanes import Lane
from supervisor.lane_queue import FairQueue, Full
from supervisor.lane_work import (
    Execute,
    KernelError,
    LaneExecutor,
    LaneWorkReply,
    LaneWorkRequest,
    MemoryRelease,
    MemoryReserve,
)

__all__ = ["LaneBusy", "LaneOwner", "LaneWorkError"]

log = logging.getLogger(__name__)

_OPS = {MemoryReserve: LaneOp.MEMORY_RESERVE, MemoryRelease: LaneOp.MEMORY_RELEASE}


class LaneWorkError(Exception):
    """Lane work refused or failed; `status` is the honest HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class LaneBusy(LaneWorkError):
    def __init__(self, lane_id: str) -> None:
        super().__init__(429, "lane_busy", f"lane {lane_id} has too much work queued")


@dataclasses.dataclass(eq=False)
class _Job:
    token: str
    work: LaneWorkRequest
    invocation_id: str  # the token's subject, checked before queueing
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    reply: LaneWorkReply | None = None
    error: Exception | None = None
    abandoned: bool = False  # the caller stopped waiting while it ran: undo a reserve


@dataclasses.dataclass(frozen=True)
class _Buffer:
    invocation_id: str
    nbytes: int


class LaneOwner:
    def __init__(
        self,
        lane: Lane,
        validator: LaneValidator,
        executor: LaneExecutor,
        *,
        is_live: Callable[[str], bool],
        on_fault: Callable[[str], None],
        share: int = 8,
        max_queued_invocations: int = 1024,
        max_buffers: int = 4096,
        max_restarts: int = 5,
        window: float = 60.0,
    ) -> None:
        self.lane = lane
        self._validator = validator
        self._executor = executor
        self._is_live = is_live
        self._on_fault = on_fault
        self.share = share  # jobs one invocation may have queued on this lane
        self._queue = FairQueue[_Job](share=share, max_keys=max_queued_invocations)
        self._buffers: dict[str, _Buffer] = {}
        self._held: dict[str, int] = {}
        self._max_buffers = max_buffers
        self._max_restarts = max_restarts
        self._window = window
        self.restarts: deque[float] = deque(maxlen=max_restarts + 1)
        self.faulted = False
        self.stopped = False
        self._current: tuple[trio.CancelScope, _Job] | None = None

    # -- what other tasks call ------------------------------------------------------
    def identify(self, token: str) -> Claims:
        """The claims of a token that is authority on this lane for some op: every
        check but the op's scope (cached, so cheap); TokenRefused otherwise."""
        refused: TokenRefused | None = None
        for op in LaneOp:
            try:
                return self._validator.validate(token, lane_id=self.lane.lane_id, op=op)
            except TokenRefused as exc:
                if exc.reason is not TokenRefusal.OP_NOT_GRANTED:
                    raise
                refused = exc
        assert refused is not None
        raise refused

    async def request(self, token: str, work: LaneWorkRequest) -> LaneWorkReply:
        """Check the token, queue the work in its invocation's share (never waiting
        for room) and wait for its reply; the caller bounds the wait."""
        if self.faulted:
            raise LaneWorkError(503, "lane_unhealthy", "the lane's owner failed too often")
        if self.stopped:
            raise LaneWorkError(503, "shutting_down", "the lane owner stopped")
        op = _OPS.get(type(work), LaneOp.EXECUTE)
        claims = self._validator.validate(token, lane_id=self.lane.lane_id, op=op)
        job = _Job(token, work, claims.sub)
        try:
            self._queue.put_nowait(claims.sub, job)
        except Full:
            raise LaneBusy(self.lane.lane_id) from None
        try:
            await job.done.wait()
        finally:
            if not job.done.is_set():
                # Still queued: give its place back. Running: undo a reserve after.
                job.abandoned = not self._queue.remove(job.invocation_id, job)
        if job.error is not None:
            raise job.error
        assert job.reply is not None
        return job.reply

    def held_by(self, invocation_id: str) -> int:
        return self._held.get(invocation_id, 0)

    @property
    def used_bytes(self) -> int:
        return sum(self._held.values())

    def free_invocation(self, invocation_id: str) -> int:
        """Stop the invocation's running work and drop its buffers; synchronous so
        cleanup cannot skip it. Nothing of the invocation outlives it on the lane."""
        if self._current is not None and self._current[1].invocation_id == invocation_id:
            scope, job = self._current
            job.error = LaneWorkError(409, "invocation_not_live", "the invocation has ended")
            scope.cancel()
        freed = self._held.pop(invocation_id, 0)
        for buffer_id in [
            b for b, buf in self._buffers.items() if buf.invocation_id == invocation_id
        ]:
            del self._buffers[buffer_id]
        return freed

    # -- the owner task ---------------------------------------------------------------
    async def run(self) -> None:
        """Serve until cancelled, restarting after a crash with bounded intensity."""
        try:
            while True:
                try:
                    await self._serve()
                except Exception:
                    log.exception("lane owner %s crashed", self.lane.lane_id)
                    now = trio.current_time()
                    self.restarts.append(now)
                    recent = [t for t in self.restarts if now - t <= self._window]
                    if len(recent) > self._max_restarts:
                        self.faulted = True
                        self._on_fault(self.lane.lane_id)
                        self._refuse_queued("lane_unhealthy", "the lane's owner failed too often")
                        return
        finally:
            # Cancelled (shutdown): nobody will serve what is queued; answer it now.
            self.stopped = True
            self._refuse_queued("shutting_down", "the lane owner stopped")

    def _refuse_queued(self, code: str, message: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except trio.WouldBlock:
                return
            job.error = LaneWorkError(503, code, message)
            job.done.set()

    async def _serve(self) -> None:
        while True:
            job = await self._queue.get()
            with trio.CancelScope() as scope:
                self._current = (scope, job)
                try:
                    job.reply = await self._handle(job)
                except (LaneWorkError, TokenRefused) as exc:
                    job.error = exc
                except KernelError as exc:
                    status = 503 if exc.code == "lane_unhealthy" else 422
                    job.error = LaneWorkError(status, exc.code, str(exc))
                except trio.Cancelled:
                    if job.error is None:  # not ended by free_invocation: shutdown
                        job.error = LaneWorkError(503, "shutting_down", "the lane owner stopped")
                    raise
                except BaseException:
                    job.error = LaneWorkError(503, "lane_owner_crashed", "the lane owner failed")
                    raise
                finally:
                    self._current = None
                    job.done.set()
            self._undo_unclaimed_reserve(job)

    def _undo_unclaimed_reserve(self, job: _Job) -> None:
        """A reserve whose caller left while it ran: nobody got the buffer id, so
        nobody could release it; undo it."""
        if job.abandoned and job.reply is not None and isinstance(job.work, MemoryReserve):
            assert job.reply.buffer_id is not None
            self._drop_buffer(job.reply.buffer_id)

    async def _handle(self, job: _Job) -> LaneWorkReply:
        token, work = job.token, job.work
        lane_id = self.lane.lane_id
        op = _OPS.get(type(work), LaneOp.EXECUTE)
        # Again: the token may have been revoked while the job waited.
        sub = self._validator.validate(token, lane_id=lane_id, op=op).sub
        held = self._held.get(sub, 0)
        if isinstance(work, MemoryReserve):  # the budget covers what it would then hold
            self._validator.validate(token, lane_id=lane_id, op=op, vram_bytes=held + work.bytes)
        if not self._is_live(sub):
            raise LaneWorkError(409, "invocation_not_live", "the invocation has ended")
        reply = LaneWorkReply(op=op.value, lane_id=lane_id, invocation_id=sub, bytes_held=held)
        if isinstance(work, MemoryReserve):
            return self._reserve(reply, work.bytes)
        if isinstance(work, MemoryRelease):
            return self._release(reply, work.buffer_id)
        assert isinstance(work, Execute)
        result = await self._executor.execute(self.lane, work.kernel, work.args)
        return _replace(reply, result=result)

    def _reserve(self, reply: LaneWorkReply, nbytes: int) -> LaneWorkReply:
        lane_free = self.lane.vram_bytes - self.used_bytes
        if nbytes > lane_free:
            raise LaneWorkError(409, "insufficient_vram", f"the lane has {lane_free} bytes free")
        if len(self._buffers) >= self._max_buffers:
            raise LaneWorkError(429, "too_many_buffers", "the lane holds too many buffers")
        buffer_id = "buf_" + secrets.token_hex(16)
        self._buffers[buffer_id] = _Buffer(reply.invocation_id, nbytes)
        self._held[reply.invocation_id] = reply.bytes_held + nbytes
        return _replace(reply, buffer_id=buffer_id, bytes_held=reply.bytes_held + nbytes)

    def _release(self, reply: LaneWorkReply, buffer_id: str) -> LaneWorkReply:
        buffer = self._buffers.get(buffer_id)
        # Another invocation's buffer looks exactly like a missing one.
        if buffer is None or buffer.invocation_id != reply.invocation_id:
            raise LaneWorkError(404, "buffer_not_found", "no such buffer for this invocation")
        return _replace(reply, buffer_id=buffer_id, bytes_held=self._drop_buffer(buffer_id))

    def _drop_buffer(self, buffer_id: str) -> int:
        """Forget a buffer; returns what its invocation still holds on this lane."""
        buffer = self._buffers.pop(buffer_id)
        held = self._held.get(buffer.invocation_id, 0) - buffer.nbytes
        if held > 0:
            self._held[buffer.invocation_id] = held
        else:
            self._held.pop(buffer.invocation_id, None)
        return max(0, held)


def _replace(reply: LaneWorkReply, **changes: object) -> LaneWorkReply:
    return msgspec.structs.replace(reply, **changes)
