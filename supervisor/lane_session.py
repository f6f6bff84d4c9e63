"""A lane session: one invocation's work on one lane, in a lane host of its own.

Each invocation that works on a lane gets its own host process there, started at
its first request and ended with the invocation. The host holds only that
invocation's buffers, so whatever it does to its host (a kernel that overruns the
deadline, a crash, memory exhausted, a hang, a sticky device error: `device_failed`)
ends its own session, and with it
(at most) its own invocation: no other invocation's buffers or requests are in
that process. Sessions of different invocations run side by side, so one
invocation's queue of slow kernels never waits in front of another's request.

A session serves its own jobs one at a time, in order, from a bounded queue
(`share` jobs; a full one is 429 `lane_busy` at once). While idle it sends its
host a heartbeat, so a hung host is found without a request.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable

import trio

from capabilities import TokenRefused
from machine.cgroups import CgroupError, InvocationCgroup
from supervisor.lane_host_errors import LaneHostError, LaneHostFailed
from supervisor.lane_jobs import LaneJobRunner
from supervisor.lane_work import (
    KernelError,
    LaneBusy,
    LaneDevice,
    LaneJob,
    LaneWorkError,
    LaneWorkReply,
    MemoryReserve,
)
from supervisor.process_cgroup import CGROUP_THREAD

__all__ = [
    "CLOSE_SECONDS",
    "HOST_CODES",
    "LaneSession",
    "SessionJob",
    "heartbeat",
    "unplaced",
]

# The name these lines have always been logged under: operators' filters keep matching.
log = logging.getLogger("supervisor.lane_owner")

# The most a session's ending waits for its host to go (LaneHost's own kill and reap
# take at most about 16 s).
CLOSE_SECONDS = 20.0

# The host's refusals as the edge answers them; anything else is the caller's args (422).
HOST_CODES = {
    "unknown_buffer": (404, "buffer_not_found"),
    "out_of_range": (416, "out_of_range"),
    "out_of_memory": (409, "insufficient_vram"),
    "too_many_buffers": (429, "too_many_buffers"),
    "unknown_kernel": (422, "unknown_kernel"),
}


@dataclasses.dataclass(eq=False)
class SessionJob:
    token: str
    work: LaneJob
    invocation_id: str
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    reply: LaneWorkReply | None = None
    data: bytes | None = None
    error: Exception | None = None
    abandoned: bool = False  # the caller stopped waiting while the job ran


async def heartbeat(lane_id: str, host: LaneDevice, seconds: float) -> None:
    """Ask an idle host something cheap; no answer in time and it has failed."""
    # LaneHost bounds (and ends) its own request; this bounds any other device. A
    # request cancelled halfway ends the host, as one that timed out does.
    with trio.move_on_after(seconds) as late:
        await host.stats(seconds=seconds)
    if late.cancelled_caught:
        raise LaneHostFailed(lane_id, "timeout", f"no answer to a heartbeat in {seconds} s")


def _failure_code(exc: LaneHostFailed, running: SessionJob | None) -> str:
    """The typed reason a failed session ends its invocation with; `running`: the
    request it failed under, if any."""
    if exc.reason == "timeout" and running is not None:
        return "kernel_timeout"  # its own request overran the deadline
    if exc.reason == "device_failed":
        # A sticky device error in its own request (a run, alloc, write or read): its
        # host's context is dead and its buffers with it; the lane's next host is fresh.
        return "device_failed"
    return "lane_session_failed"


def _out_of_memory(cgroup: InvocationCgroup) -> bool:
    """Whether the kernel's OOM killer struck in the cgroup (blocking: a cgroupfs read)."""
    try:
        return cgroup.usage().oom_killed
    except CgroupError:
        return False  # gone with its invocation: nothing says it was memory


async def unplaced(_lane_id: str, _invocation_id: str) -> InvocationCgroup | None:
    return None


class LaneSession:
    def __init__(
        self,
        lane_id: str,
        invocation_id: str,
        host: LaneDevice,
        jobs: LaneJobRunner,
        *,
        share: int,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        on_failed: Callable[[LaneSession, str, str], None],
        place: Callable[[str, str], Awaitable[InvocationCgroup | None]] = unplaced,
    ) -> None:
        self.lane_id = lane_id
        self.invocation_id = invocation_id
        self.host = host
        self._jobs = jobs
        self._send, self._receive = trio.open_memory_channel[SessionJob](share)
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._on_failed = on_failed  # (this session, reason code, message)
        self._place = place  # the cgroup its host runs in: the invocation's (LaneCharges)
        self.cgroup: InvocationCgroup | None = None
        self.start_failed = False  # its host never answered its hello
        self.current: SessionJob | None = None
        self.started = False  # its host answered its hello: a failure is then the session's
        self.ended = trio.Event()
        self._ending: str | None = None  # why queued work is refused, once it is
        self._scope = trio.CancelScope()
        self._idle: trio.CancelScope | None = None  # set while waiting for a job
        self._exited = False  # the watcher saw the host exit
        self._watching = trio.CancelScope()  # the watcher's, cancelled when the session ends
        self._host_started = trio.Event()
        self._failed_as: str | None = None  # the reason a failed request gave its caller
        self._refused: LaneWorkError | None = None  # why its work may not run (placement)

    # -- what other tasks call ------------------------------------------------------
    def put(self, job: SessionJob) -> None:
        """Queue a job, never waiting for room: a full queue is 429 at once."""
        if self._ending is not None:
            raise self._refusal()
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            raise LaneBusy(self.lane_id) from None

    def begin_close(self) -> None:
        """Start ending the session and its host; `ended` is set once they are gone."""
        self._stop("the invocation's lane session ended")
        self._scope.cancel()

    async def close(self) -> None:
        """End the session and its host (the invocation ended); bounded by
        CLOSE_SECONDS, and safe to call from a cancelled caller's shielded cleanup."""
        self.begin_close()
        await self.ended.wait()

    # -- the session task ---------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the host, then serve this invocation's jobs until closed or failed.
        The host is always ended on the way out, shielded, by its own bounded contract."""
        try:
            with self._scope:
                task_status.started()
                try:
                    self.cgroup = await self._place(self.lane_id, self.invocation_id)
                except LaneWorkError as exc:  # nowhere its work may run: refused, not failed
                    self._refused = exc
                    self._stop(str(exc))
                    return
                try:
                    hello = await self.host.start(cgroup=self.cgroup)
                except LaneHostFailed:
                    self.start_failed = True
                    raise
                self._jobs.host_started(self.invocation_id, hello)
                self.started = True
                self._host_started.set()
                await self._serve()
        except (LaneHostFailed, Exception) as exc:
            if isinstance(exc, LaneHostFailed):
                code = self._failed_as or _failure_code(exc, None)
                message = f"{exc.reason}: {exc.message}"
                # (A request it failed under has read the cgroup already.)
                if self._failed_as is None and await self._oom_killed():
                    code, message = "out_of_memory", f"out of memory in its cgroup ({message})"
            else:  # a fault of ours: it ends this session only, never the owner
                log.exception(
                    "lane %s: the session of %s crashed", self.lane_id, self.invocation_id
                )
                code, message = "lane_session_failed", f"the lane session crashed: {exc!r}"
            log.warning(
                "lane %s: the session of %s failed: %s", self.lane_id, self.invocation_id, message
            )
            self._stop(message)
            self._on_failed(self, code, message)
        finally:
            self._stop("the invocation's lane session ended")
            self._watching.cancel()
            try:
                # LaneHost bounds and kills by its own contract; this bounds any device.
                with trio.move_on_after(CLOSE_SECONDS, shield=True):
                    await self.host.aclose()
            finally:
                self.ended.set()

    async def _oom_killed(self) -> bool:
        cgroup = self.cgroup
        if cgroup is None:
            return False
        with trio.move_on_after(CLOSE_SECONDS, shield=True):
            return await CGROUP_THREAD.run(functools.partial(_out_of_memory, cgroup), shield=True)
        return False

    def _refusal(self) -> LaneWorkError:
        assert self._ending is not None
        return self._refused or LaneWorkError(503, "lane_session_failed", self._ending)

    def _stop(self, why: str) -> None:
        """Refuse what is queued and anything put later."""
        if self._ending is None:
            self._ending = why
        while True:
            try:
                job = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                return
            if not job.done.is_set():
                job.error = self._refusal()
                job.done.set()

    async def watch(self) -> None:
        """Beside `run`: notice the host's process exiting on its own, even while the
        session idles. Ends when the session does."""
        with self._watching:
            await self._host_started.wait()  # before its start there is no process to watch
            await self.host.wait_exited()
            self._exited = True
            if self._idle is not None:
                self._idle.cancel()

    def _host_exited(self) -> bool:
        return self._exited  # set by the watcher task, between any two awaits here

    async def _serve(self) -> None:
        heard = trio.current_time()  # when the host last answered
        while True:
            if self._host_exited():  # (seen while a job ran)
                raise LaneHostFailed(self.lane_id, "crashed", "the lane host exited")
            job: SessionJob | None = None
            with trio.CancelScope(deadline=heard + self._heartbeat_interval) as idle:
                self._idle = idle  # the wait only: a running job is never cut short here
                job = await self._receive.receive()
            self._idle = None
            if self._host_exited():
                if job is not None:  # taken just as the host went: answered, not dropped
                    job.error = LaneWorkError(503, "lane_session_failed", "the lane host exited")
                    job.done.set()
                raise LaneHostFailed(self.lane_id, "crashed", "the lane host exited")
            if job is None:  # quiet for an interval: is the host still there?
                await heartbeat(self.lane_id, self.host, self._heartbeat_timeout)
                heard = trio.current_time()
            else:
                heard = await self._answer(job)

    async def _answer(self, job: SessionJob) -> float:
        """Run one job and answer its caller; when the host last answered."""
        if job.abandoned:  # its caller left before its turn: it never runs
            job.done.set()
            return trio.current_time()
        self.current = job
        try:
            job.reply, job.data = await self._jobs.handle(self.host, job.token, job.work)
        except (LaneWorkError, TokenRefused) as exc:
            job.error = exc
        except KernelError as exc:
            status = 503 if exc.code == "lane_unhealthy" else 422
            job.error = LaneWorkError(status, exc.code, str(exc))
        except LaneHostError as exc:
            status, code = HOST_CODES.get(exc.code, (422, exc.code))
            job.error = LaneWorkError(status, code, exc.message)
        except LaneHostFailed as exc:
            code = self._failed_as = _failure_code(exc, job)
            if await self._oom_killed():
                code = self._failed_as = "out_of_memory"
            job.error = LaneWorkError(503, code, f"the invocation's lane host failed: {exc.reason}")
            raise
        except BaseException:
            job.error = LaneWorkError(503, "lane_session_failed", "the lane session ended")
            raise
        finally:
            self.current = None
            job.done.set()
        await self._undo_unclaimed_reserve(job)
        return trio.current_time()

    async def _undo_unclaimed_reserve(self, job: SessionJob) -> None:
        """A reserve whose caller left while it ran: nobody got the buffer id, so
        nobody could release it; undo it."""
        if job.abandoned and job.reply is not None and isinstance(job.work, MemoryReserve):
            assert job.reply.buffer_id is not None
            await self._jobs.free(self.host, [job.reply.buffer_id])
