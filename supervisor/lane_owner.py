"""Lane owners: one trio task per lane owns that lane's mutable state and its host.

The presented capability token is checked before anything is queued (a
junk or foreign token never takes a place), then work waits in the lane's
`FairQueue`: each invocation has its own bounded share, served in turn, and a
full share refuses at once (`LaneBusy`, 429 at the edge). When its turn comes
the owner validates the token again for this lane, the operation and the
VRAM the invocation would then hold. An owner that crashes is restarted; more than
`max_restarts` crashes within `window` seconds fault the lane and its pending
work is refused; a GPU lane also leaves allocatable, while the CPU pool keeps
its processes and builtins (they never use its host).

The work runs in the lane's host process (one per lane, started here): the
owner keeps which buffer belongs to which invocation (`supervisor.lane_buffers`)
and forwards only ids the caller holds (`supervisor.lane_jobs` runs each job).
A host that crashes, hangs or garbles is replaced, counted against the same
restart limits; the invocations that held buffers in it are cancelled
(`on_host_failed`), and its memory is accounted back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable

import trio

from capabilities import Claims, LaneOp, LaneValidator, TokenRefusal, TokenRefused
from machine.lanes import Lane
from supervisor.lane_buffers import LaneBuffers
from supervisor.lane_host_errors import LaneHostError, LaneHostFailed
from supervisor.lane_jobs import LaneJobRunner
from supervisor.lane_queue import FairQueue, Full
from supervisor.lane_work import (
    Download,
    KernelError,
    LaneBusy,
    LaneDevice,
    LaneJob,
    LaneWorkError,
    LaneWorkReply,
    MemoryReserve,
    lane_op,
)

__all__ = ["LaneBusy", "LaneOwner", "LaneWorkError"]

log = logging.getLogger(__name__)

# The host's refusals as the edge answers them; anything else is the caller's args (422).
_HOST_CODES = {
    "unknown_buffer": (404, "buffer_not_found"),
    "out_of_range": (416, "out_of_range"),
    "out_of_memory": (409, "insufficient_vram"),
    "too_many_buffers": (429, "too_many_buffers"),
    "unknown_kernel": (422, "unknown_kernel"),
}


@dataclasses.dataclass(eq=False)
class _Job:
    token: str
    work: LaneJob
    invocation_id: str  # the token's subject, checked before queueing
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    reply: LaneWorkReply | None = None
    data: bytes | None = None  # a download's bytes
    error: Exception | None = None
    abandoned: bool = False  # the caller stopped waiting while it ran: undo a reserve


class LaneOwner:
    def __init__(
        self,
        lane: Lane,
        validator: LaneValidator,
        host_factory: Callable[[Lane], LaneDevice],
        *,
        is_live: Callable[[str], bool],
        usable: Callable[[str], bool],
        on_fault: Callable[[str], None],
        on_host_failed: Callable[[str, Iterable[str]], None] = lambda _lane, _subs: None,
        on_host_call: Callable[[str, float], None] = lambda _op, _seconds: None,
        share: int = 8,
        max_queued_invocations: int = 1024,
        max_buffers: int = 4096,
        max_restarts: int = 5,
        window: float = 60.0,
    ) -> None:
        self.lane = lane
        self._validator = validator
        self._host_factory = host_factory
        self._on_fault = on_fault
        self._on_host_failed = on_host_failed
        self.share = share  # jobs one invocation may have queued on this lane
        self._queue = FairQueue[_Job](share=share, max_keys=max_queued_invocations)
        self._buffers = LaneBuffers(lane.vram_bytes)
        self._jobs = LaneJobRunner(
            lane,
            validator,
            self._buffers,
            is_live=is_live,
            usable=usable,
            on_host_call=on_host_call,
            max_buffers=max_buffers,
        )
        self._max_restarts = max_restarts
        self._window = window
        self.restarts: deque[float] = deque(maxlen=max_restarts + 1)
        self.host_starts = 0
        self.faulted = False
        self.stopped = False
        self._host: LaneDevice | None = None
        self._current: _Job | None = None
        # Where the host stands, for readiness: starting, ready, restarting, faulted, stopped.
        self.host_status = "starting"
        self.host_problem = ""  # why it is restarting
        self.first_start = trio.Event()  # the first host answered its hello, or failed to
        self._exited: LaneDevice | None = None  # a host seen to exit on its own
        self._idle: trio.CancelScope | None = None  # set while waiting for work

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

    async def request(self, token: str, work: LaneJob) -> LaneWorkReply:
        """Check the token, queue the work in its invocation's share (never waiting
        for room) and wait for its reply; the caller bounds the wait."""
        job = await self._submit(token, work)
        assert job.reply is not None
        return job.reply

    async def download(self, token: str, work: Download) -> bytes:
        job = await self._submit(token, work)
        assert job.data is not None
        return job.data

    async def _submit(self, token: str, work: LaneJob) -> _Job:
        if self.faulted:
            raise LaneWorkError(503, "lane_unhealthy", "the lane's owner failed too often")
        if self.stopped:
            raise LaneWorkError(503, "shutting_down", "the lane owner stopped")
        claims = self._validator.validate(token, lane_id=self.lane.lane_id, op=lane_op(work))
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
        return job

    def held_by(self, invocation_id: str) -> int:
        return self._buffers.held_by(invocation_id)

    @property
    def used_bytes(self) -> int:
        return self._buffers.used_bytes

    @property
    def free_bytes(self) -> int:
        """The lane memory no invocation holds."""
        return self._buffers.free_bytes

    def holds(self, invocation_id: str) -> bool:
        """Whether freeing the invocation here has anything to do (its work is running,
        or it holds a buffer): otherwise `free_invocation` need not be awaited."""
        current = self._current
        if current is not None and current.invocation_id == invocation_id:
            return True
        return self._buffers.holds_any(invocation_id)

    async def free_invocation(self, invocation_id: str) -> int:
        """Drop the invocation's buffers, in the host too. Its tokens are revoked
        first, so none of its queued work runs; work of it already running is
        let finish (the host's per-operation deadline bounds it: cancelling a
        request halfway would kill the host and everyone's buffers in it).
        Callers shield this with a deadline."""
        current = self._current
        if current is not None and current.invocation_id == invocation_id:
            await current.done.wait()
        ids = self._buffers.of(invocation_id)
        freed = self._buffers.nbytes(ids)
        await self._jobs.free(self._host, ids)
        return freed

    # -- the owner task ---------------------------------------------------------------
    async def run(self) -> None:
        """Start the lane's host and serve until cancelled, restarting owner and host
        after a crash or a host failure with bounded intensity. Each host's process
        is watched beside the work, so one that dies while idle is replaced at once."""
        async with trio.open_nursery() as watchers:
            await self._supervise(watchers)
            watchers.cancel_scope.cancel()

    async def _supervise(self, watchers: trio.Nursery) -> None:
        try:
            while True:
                try:
                    await self._serve(watchers)
                except LaneHostFailed as exc:
                    log.error("lane %s: %s", self.lane.lane_id, exc)
                    self._restarting(f"{exc.reason}: {exc.message}")
                    await self._lose_host()
                except Exception as exc:
                    log.exception("lane owner %s crashed", self.lane.lane_id)
                    self._restarting(f"the lane owner crashed: {exc!r}")
                    await self._lose_host()
                now = trio.current_time()
                self.restarts.append(now)
                recent = [t for t in self.restarts if now - t <= self._window]
                if len(recent) > self._max_restarts:
                    self.faulted = True
                    self.host_status = "faulted"
                    log.error(
                        "lane %s: its host failed too often; out of service", self.lane.lane_id
                    )
                    if self.lane.is_gpu:
                        # The CPU pool's processes and builtins never use its host:
                        # only the lane work refused here goes with it.
                        self._on_fault(self.lane.lane_id)
                    self._refuse_queued("lane_unhealthy", "the lane's owner failed too often")
                    return
        finally:
            # Cancelled (shutdown): nobody will serve what is queued; answer it now.
            self.stopped = True
            if not self.faulted:
                self.host_status = "stopped"
            self.first_start.set()
            self._refuse_queued("shutting_down", "the lane owner stopped")
            with trio.CancelScope(shield=True):
                await self._close_host()

    def _restarting(self, problem: str) -> None:
        self.host_status, self.host_problem = "restarting", problem
        self.first_start.set()

    async def _watch(self, host: LaneDevice) -> None:
        """Notice the host's process exiting on its own, even with no work for it."""
        await host.wait_exited()
        if self._host is host:
            self._exited = host
            if self._idle is not None:
                self._idle.cancel()  # the owner waits for work: wake it to replace the host

    async def _close_host(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            await host.aclose()  # shielded, bounded and killing by LaneHost's own contract

    async def _lose_host(self) -> None:
        """The host (or the owner's view of it) cannot be trusted: end it, account its
        memory back and cancel the invocations that held buffers in it."""
        with trio.CancelScope(shield=True):
            await self._close_host()
        holders = self._buffers.holders()
        self._buffers.clear()
        if holders:
            self._on_host_failed(self.lane.lane_id, sorted(holders))

    def _refuse_queued(self, code: str, message: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except trio.WouldBlock:
                return
            job.error = LaneWorkError(503, code, message)
            job.done.set()

    async def _serve(self, watchers: trio.Nursery) -> None:
        host = self._host = self._host_factory(self.lane)
        self.host_starts += 1
        await host.start()
        self.host_status, self.host_problem = "ready", ""
        self.first_start.set()
        watchers.start_soon(self._watch, host)
        while True:
            if self._exited is host:
                raise LaneHostFailed(self.lane.lane_id, "crashed", "the lane host exited")
            with trio.CancelScope() as idle:
                self._idle = idle
                job = await self._queue.get()
            self._idle = None
            if idle.cancelled_caught:
                continue  # the watcher saw the host exit
            self._current = job
            try:
                job.reply, job.data = await self._jobs.handle(host, job.token, job.work)
            except (LaneWorkError, TokenRefused) as exc:
                job.error = exc
            except KernelError as exc:
                status = 503 if exc.code == "lane_unhealthy" else 422
                job.error = LaneWorkError(status, exc.code, str(exc))
            except LaneHostError as exc:
                status, code = _HOST_CODES.get(exc.code, (422, exc.code))
                job.error = LaneWorkError(status, code, exc.message)
            except LaneHostFailed:
                job.error = LaneWorkError(503, "lane_host_failed", "the lane host failed")
                raise
            except trio.Cancelled:
                job.error = LaneWorkError(503, "shutting_down", "the lane owner stopped")
                raise
            except BaseException:
                job.error = LaneWorkError(503, "lane_owner_crashed", "the lane owner failed")
                raise
            finally:
                self._current = None
                job.done.set()
            await self._undo_unclaimed_reserve(job)

    async def _undo_unclaimed_reserve(self, job: _Job) -> None:
        """A reserve whose caller left while it ran: nobody got the buffer id, so
        nobody could release it; undo it."""
        if job.abandoned and job.reply is not None and isinstance(job.work, MemoryReserve):
            assert job.reply.buffer_id is not None
            if job.reply.buffer_id in self._buffers:
                await self._jobs.free(self._host, [job.reply.buffer_id])
