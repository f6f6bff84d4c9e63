"""Lane owners: one trio task per lane owns that lane's mutable state and its host.

The presented capability token is checked before anything is queued (a
junk or foreign token never takes a place), then work waits in the lane's
`FairQueue`: each invocation has its own bounded share, served in turn, and a
full share refuses at once (`LaneBusy`, 429 at the edge). When its turn comes
the owner validates the token again for this lane, the operation and the
VRAM the invocation would then hold. An owner that crashes is restarted; more than
`max_restarts` crashes within `window` seconds fault the lane and its pending
work is refused; a GPU lane also leaves allocatable, while the CPU pool keeps
its processes and builtins (they never use its host). Either way the lane is
shown unhealthy with the reason (`on_fault`). A faulted lane is probed with
backoff (`LaneRecovery`: 1 s, doubling to 60 s): the probe starts a host, and
its answered hello returns the lane to service by itself, with a fresh restart
window (`on_recovered`); a failed probe doubles the wait.

The work runs in the lane's host process (one per lane, started here): the
owner keeps which buffer belongs to which invocation (`supervisor.lane_buffers`)
and forwards only ids the caller holds (`supervisor.lane_jobs` runs each job).
A host that crashes, hangs or garbles is replaced, counted against the same
restart limits; the invocations that held buffers in it are cancelled
(`on_host_failed`), and its memory is accounted back. An idle host is asked
for its `stats` every `heartbeat_interval` seconds: one that does not answer
within `heartbeat_timeout` (stopped, wedged) has failed with `timeout`, so a
hang is found while idle rather than by the next request's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import trio

from capabilities import Claims, LaneOp, LaneValidator, TokenRefusal, TokenRefused
from lanehost.protocol import MAX_BUFFERS
from machine.lanes import Lane
from supervisor.lane_buffers import BUFFERS_PER_INVOCATION, LaneBuffers
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

__all__ = ["LaneBusy", "LaneOwner", "LaneRecovery", "LaneWorkError"]

log = logging.getLogger(__name__)

_PROBLEM_CHARS = 200  # of the last host failure, in a faulted lane's reason

# The host's refusals as the edge answers them; anything else is the caller's args (422).
_HOST_CODES = {
    "unknown_buffer": (404, "buffer_not_found"),
    "out_of_range": (416, "out_of_range"),
    "out_of_memory": (409, "insufficient_vram"),
    "too_many_buffers": (429, "too_many_buffers"),
    "unknown_kernel": (422, "unknown_kernel"),
}


@dataclasses.dataclass(frozen=True)
class LaneRecovery:
    """How a lane owner watches its host while idle and brings a faulted lane back."""

    heartbeat_interval: float = 2.0  # seconds without an answer from the host before asking
    heartbeat_timeout: float = 2.0  # for it to answer the heartbeat
    retry_initial: float = 1.0  # before the first probe of a faulted lane
    retry_max: float = 60.0  # the wait doubles after each failed probe, up to this


@runtime_checkable
class _Heartbeat(Protocol):
    """A host that answers `stats`, the protocol's cheapest request (`LaneHost` does)."""

    async def stats(self, *, seconds: float | None = None) -> object: ...


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
        on_fault: Callable[[str, str], None],
        on_recovered: Callable[[str], None] = lambda _lane: None,
        on_host_failed: Callable[[str, Iterable[str]], None] = lambda _lane, _subs: None,
        on_host_call: Callable[[str, float], None] = lambda _op, _seconds: None,
        share: int = 8,
        max_queued_invocations: int = 1024,
        max_buffers: int = MAX_BUFFERS,
        max_buffers_per_invocation: int = BUFFERS_PER_INVOCATION,
        max_restarts: int = 5,
        window: float = 60.0,
        recovery: LaneRecovery = LaneRecovery(),
    ) -> None:
        self.lane = lane
        self._validator = validator
        self._host_factory = host_factory
        self._on_fault = on_fault
        self._on_recovered = on_recovered
        self._recovery = recovery
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
            max_buffers_per_invocation=max_buffers_per_invocation,
        )
        self._max_restarts = max_restarts
        self._window = window
        self.restarts: deque[float] = deque(maxlen=max_restarts + 1)
        self.host_starts = 0
        self.faulted = False
        self.fault_reason = ""  # why the lane is out of service, while it is
        self.retry_delay = recovery.retry_initial  # the wait before the next probe
        self.next_probe_at: float | None = None  # trio time, while a faulted lane waits
        self._recovered_at: float | None = None  # when a probe last brought the lane back
        self.stopped = False
        self._host: LaneDevice | None = None
        self._current: _Job | None = None
        # Where the host stands, for readiness: starting, ready, restarting, faulted, stopped.
        self.host_status = "starting"
        self.host_problem = ""  # why it is restarting
        self.first_start = trio.Event()  # the first host answered its hello, or failed to
        self._exited: LaneDevice | None = None  # a host seen to exit on its own
        self._idle: trio.CancelScope | None = None  # set while waiting for work
        self._freeing = 0  # `free_invocation` calls to the host in flight (other tasks')

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
        self._freeing += 1  # the host is asked something: no heartbeat queues behind it
        try:
            await self._jobs.free(self._host, ids)
        finally:
            self._freeing -= 1
        return freed

    # -- the owner task ---------------------------------------------------------------
    async def run(self) -> None:
        """Start the lane's host and serve until cancelled, restarting owner and host
        after a crash or a host failure with bounded intensity; past it the lane is
        out of service and probed with backoff until a host starts again. Each host's
        process is watched beside the work, so one that dies while idle is replaced
        at once, and an idle host is sent heartbeats, so one that hangs is too."""
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
                if self.faulted:  # a probe failed: wait twice as long for the next
                    self.retry_delay = min(self.retry_delay * 2, self._recovery.retry_max)
                elif self._too_many_restarts():
                    self._fault()
                if self.faulted:
                    await self._wait_for_probe()
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
        if not self.faulted:  # a faulted lane's failed probe: it stays out of service
            self.host_status = "restarting"
        self.host_problem = problem
        self.first_start.set()

    def _too_many_restarts(self) -> bool:
        now = trio.current_time()
        self.restarts.append(now)
        return sum(now - t <= self._window for t in self.restarts) > self._max_restarts

    def _fault(self) -> None:
        """Out of service: its work is refused, a GPU lane leaves allocatable (the CPU
        pool's processes and builtins never use its host: only its lane work goes),
        and the lane is shown unhealthy until a probe brings it back."""
        now = trio.current_time()
        flapping = self._recovered_at is not None and now - self._recovered_at <= self._window
        # Back and out again within the window: wait longer than last time.
        self.retry_delay = (
            min(self.retry_delay * 2, self._recovery.retry_max)
            if flapping
            else self._recovery.retry_initial
        )
        self.faulted, self.host_status = True, "faulted"
        what = "out of service" if self.lane.is_gpu else "its lane work refused"
        self.fault_reason = (
            f"lane_host_failed: its lane host failed too often"
            f" ({self.host_problem[:_PROBLEM_CHARS]}); {what} until a new host answers"
        )
        log.error("lane %s: its host failed too often; %s", self.lane.lane_id, what)
        self._on_fault(self.lane.lane_id, self.fault_reason)
        self._refuse_queued("lane_unhealthy", "the lane's owner failed too often")

    async def _wait_for_probe(self) -> None:
        self.next_probe_at = trio.current_time() + self.retry_delay
        log.info("lane %s: probing a new host in %s s", self.lane.lane_id, self.retry_delay)
        await trio.sleep(self.retry_delay)

    def _recover(self) -> None:
        """A probe's host answered its hello: back in service, with a fresh window."""
        self.faulted, self.fault_reason, self.next_probe_at = False, "", None
        self.restarts.clear()
        self._recovered_at = trio.current_time()
        log.warning("lane %s: a new host answered; back in service", self.lane.lane_id)
        self._on_recovered(self.lane.lane_id)

    async def _heartbeat(self, host: LaneDevice) -> None:
        """Ask an idle host something cheap; no answer in time and it has failed."""
        seconds = self._recovery.heartbeat_timeout
        # LaneHost bounds (and ends) its own request; this bounds any other device. A
        # request cancelled halfway ends the host, as one that timed out does.
        with trio.move_on_after(seconds) as late:
            if isinstance(host, _Heartbeat):
                await host.stats(seconds=seconds)
            else:
                await host.run("noop", {}, {})
        if late.cancelled_caught:
            raise LaneHostFailed(
                self.lane.lane_id, "timeout", f"no answer to a heartbeat in {seconds} s"
            )

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
        if self.faulted:
            self._recover()  # the probe's hello answered
        self.host_status, self.host_problem = "ready", ""
        self.first_start.set()
        watchers.start_soon(self._watch, host)
        heard = trio.current_time()  # when the host last answered
        while True:
            if self._exited is host:
                raise LaneHostFailed(self.lane.lane_id, "crashed", "the lane host exited")
            # Wait for work, but not longer than the heartbeat interval.
            with trio.CancelScope(deadline=heard + self._recovery.heartbeat_interval) as idle:
                self._idle = idle
                job = await self._queue.get()
            self._idle = None
            if idle.cancelled_caught:
                if self._exited is not host:  # not the watcher: quiet for an interval
                    if not self._freeing:  # (a free in flight is bounded by its own deadline)
                        await self._heartbeat(host)
                    heard = trio.current_time()
                continue
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
            heard = trio.current_time()
            await self._undo_unclaimed_reserve(job)

    async def _undo_unclaimed_reserve(self, job: _Job) -> None:
        """A reserve whose caller left while it ran: nobody got the buffer id, so
        nobody could release it; undo it."""
        if job.abandoned and job.reply is not None and isinstance(job.work, MemoryReserve):
            assert job.reply.buffer_id is not None
            if job.reply.buffer_id in self._buffers:
                await self._jobs.free(self._host, [job.reply.buffer_id])
