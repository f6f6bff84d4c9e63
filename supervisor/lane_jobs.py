"""What one piece of a lane's queued work does, once its turn has come.

The job is checked whole against what the host's wire carries
(`supervisor.lane_checks`: 422 `bad_args`, nothing sent); the token is validated
again for this lane, the operation and the VRAM the invocation would then hold
(it may have been revoked while the work waited); the invocation must still be
live; only buffer ids the caller holds are forwarded to the lane's host, and an
invocation holds at most `max_buffers_per_invocation` of the lane's
`max_buffers`. Each invocation's lane session (`supervisor.lane_session`) runs
its own jobs one at a time, on its own host; sessions run side by side, so what
the lane's book holds (bytes, buffer counts) is updated before the first await
of a job, never after it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from capabilities import LaneValidator
from machine.lanes import Lane
from supervisor.lane_buffers import LaneBuffers, reserved_by
from supervisor.lane_checks import check_job
from supervisor.lane_host_errors import LaneHostError, LaneHostFailed
from supervisor.lane_work import (
    Download,
    Execute,
    KernelError,
    LaneDevice,
    LaneJob,
    LaneWorkError,
    LaneWorkReply,
    MemoryRelease,
    MemoryReserve,
    Upload,
    lane_op,
)

__all__ = ["LaneJobRunner"]

# The name these lines have always been logged under: operators' filters keep matching.
log = logging.getLogger("supervisor.lane_owner")

_T = TypeVar("_T")


class LaneJobRunner:
    """Carries out lane work on a lane's host, keeping the lane's book of buffers."""

    def __init__(
        self,
        lane: Lane,
        validator: LaneValidator,
        buffers: LaneBuffers,
        *,
        is_live: Callable[[str], bool],
        usable: Callable[[str], bool],
        on_host_call: Callable[[str, float], None],
        max_buffers: int,
        max_buffers_per_invocation: int,
        max_kernel_seconds: float,
    ) -> None:
        if not 1 <= max_buffers_per_invocation <= max_buffers:
            raise ValueError(
                f"buffers per invocation must be from 1 to the lane's {max_buffers}, "
                f"not {max_buffers_per_invocation}"
            )
        self._lane = lane
        self._validator = validator
        self._buffers = buffers
        self._is_live = is_live
        self._usable = usable
        self._on_host_call = on_host_call
        self._max_buffers = max_buffers
        self._max_per_invocation = max_buffers_per_invocation
        self._max_kernel_seconds = max_kernel_seconds

    async def handle(
        self, host: LaneDevice, token: str, work: LaneJob
    ) -> tuple[LaneWorkReply, bytes | None]:
        """The work's reply, and a download's bytes (None for other work)."""
        lane_id = self._lane.lane_id
        check_job(work)  # before anything reads it: every value fits the host's wire
        op = lane_op(work)
        # Again: the token may have been revoked while the job waited.
        sub = self._validator.validate(token, lane_id=lane_id, op=op).sub
        held = self._buffers.held_by(sub)
        if isinstance(work, MemoryReserve):  # the budget covers what it would then hold
            self._validator.validate(token, lane_id=lane_id, op=op, vram_bytes=held + work.nbytes)
        if not self._is_live(sub):
            raise LaneWorkError(409, "invocation_not_live", "the invocation has ended")
        reply = LaneWorkReply(op=op.value, lane_id=lane_id, invocation_id=sub, bytes_held=held)
        if isinstance(work, MemoryReserve):
            return await self._reserve(host, reply, work), None
        if isinstance(work, MemoryRelease):
            return await self._release(host, reply, work.buffer_id), None
        if isinstance(work, Upload):
            self._buffers.own(sub, work.buffer_id)
            written = await self._host_call(
                "write", host.write(work.buffer_id, work.offset, work.data)
            )
            return _replace(reply, buffer_id=work.buffer_id, result={"nbytes": written}), None
        if isinstance(work, Download):
            self._buffers.own(sub, work.buffer_id)
            data = await self._host_call(
                "read", host.read(work.buffer_id, work.offset, work.length)
            )
            return reply, data
        return _replace(reply, result=await self._execute(host, sub, work)), None

    async def free(self, host: LaneDevice | None, buffer_ids: list[str]) -> None:
        """Forget the buffers, then free them in the host. A host that fails here
        is gone with all its memory: its session fails with it."""
        for buffer_id in buffer_ids:
            self._buffers.drop(buffer_id)
        if not buffer_ids or host is None:
            return
        try:
            await self._host_call("free_all", host.free_all(buffer_ids))
        except (LaneHostError, LaneHostFailed) as exc:
            log.error(
                "lane %s: freeing %d buffers failed: %s", self._lane.lane_id, len(buffer_ids), exc
            )

    def host_started(self, invocation_id: str, hello: object) -> None:
        """A session's host answered its hello: what it holds for itself (its CUDA
        context) is the lane's memory, booked until the session's book is forgotten."""
        self._buffers.host_started(invocation_id, reserved_by(hello))

    def kernel_seconds(self, work: Execute) -> float:
        """The kernel's deadline: the caller's own, never above the node's cap."""
        cap = self._max_kernel_seconds
        if work.timeout_s is None:
            return cap
        if work.timeout_s > cap:
            raise LaneWorkError(
                422, "bad_args", f"timeout_s: at most this node's --max-kernel-seconds, {cap}"
            )
        return work.timeout_s

    async def _execute(self, host: LaneDevice, sub: str, work: Execute) -> dict[str, object]:
        seconds = self.kernel_seconds(work)
        for buffer_id in work.buffers.values():
            self._buffers.own(sub, buffer_id)
        if not self._usable(self._lane.lane_id):
            raise KernelError("lane_unhealthy", "the lane is not healthy")
        result = await self._host_call(
            "run", host.run(work.kernel, work.args, work.buffers, seconds=seconds)
        )
        if not self._usable(self._lane.lane_id):  # a fault reached the lane while it ran
            raise KernelError("lane_unhealthy", "the lane failed while the work ran")
        return dict(result)

    async def _host_call(self, op: str, call: Awaitable[_T]) -> _T:
        """Await one host request, reporting how long the owner waited for it:
        the host hop's share of lane work, seen from where it is paid."""
        started = time.perf_counter()
        try:
            return await call
        finally:
            self._on_host_call(op, time.perf_counter() - started)

    async def _reserve(
        self, host: LaneDevice, reply: LaneWorkReply, work: MemoryReserve
    ) -> LaneWorkReply:
        nbytes = work.nbytes
        free = self._buffers.free_bytes
        if nbytes > free:
            raise LaneWorkError(409, "insufficient_vram", f"the lane has {free} bytes free")
        # Its own bound first: one invocation never fills the lane for the others.
        count = self._buffers.count_of(reply.invocation_id)
        if count >= self._max_per_invocation:
            raise LaneWorkError(
                429, "too_many_buffers", f"this invocation holds {count} buffers on the lane"
            )
        if len(self._buffers) >= self._max_buffers:
            raise LaneWorkError(
                429, "too_many_buffers", f"the lane holds {len(self._buffers)} buffers"
            )
        buffer_id = "buf_" + secrets.token_hex(16)
        # Booked before the host is asked: another session's reserve meanwhile sees it.
        held = self._buffers.add(buffer_id, reply.invocation_id, nbytes)
        try:
            await self._host_call("alloc", host.alloc(buffer_id, work.dtype, work.shape))
        except BaseException:
            self._buffers.drop(buffer_id)
            raise
        return _replace(reply, buffer_id=buffer_id, bytes_held=held)

    async def _release(
        self, host: LaneDevice, reply: LaneWorkReply, buffer_id: str
    ) -> LaneWorkReply:
        self._buffers.own(reply.invocation_id, buffer_id)
        await self.free(host, [buffer_id])
        return _replace(
            reply, buffer_id=buffer_id, bytes_held=self._buffers.held_by(reply.invocation_id)
        )


def _replace(reply: LaneWorkReply, **changes: object) -> LaneWorkReply:
    return msgspec.structs.replace(reply, **changes)
