"""Lane owners: one trio task per lane owns that lane's state, its sessions and its sentinel.

The presented capability token is checked before anything is queued (a junk or
foreign token never takes a place). The work then goes to the invocation's own
lane session (`supervisor.lane_session`): a lane host process of its own on this
lane, started at its first request, holding only its buffers, serving its jobs in
order from a bounded queue (a full one is `LaneBusy`, 429 at the edge) and ended
with the invocation. Whatever one invocation's work does to its host (overrun the
kernel deadline, crash it, exhaust its memory, hang it) ends that session and (at
most) that invocation, with a typed reason (`kernel_timeout`,
`lane_session_failed`); every other invocation's buffers and requests live in
other processes and go on. At most `max_sessions` invocations hold a session on
the lane at once.

The owner keeps the lane's book of buffers (`supervisor.lane_buffers`): which
invocation holds which buffer, the bytes held against the lane's memory, and the
bounds per invocation and per lane; `supervisor.lane_jobs` checks and runs each
job. When its turn comes a job's token is validated again for this lane, the
operation and the VRAM the invocation would then hold.

The lane's own health is its sentinel's: a host that holds no tenant's buffers,
started first (readiness waits for its hello) and sent a heartbeat while idle. A
sentinel that fails is replaced; more than `max_restarts` failures within
`window` seconds fault the lane: its sessions are ended, a GPU lane also leaves
allocatable, while the CPU pool keeps its processes and builtins (they never use
a host), and the lane is shown unhealthy with the reason (`on_fault`). A faulted
lane is probed with backoff (`LaneRecovery`: 1 s, doubling to 60 s): the probe
starts a sentinel, and its answered hello returns the lane to service by itself,
with a fresh restart window (`on_recovered`); a failed probe doubles the wait.

A device lane's hosts must run CUDA: a sentinel that cannot (`cuda_unavailable`:
no CuPy, no cuBLAS or NVRTC, an unwritable kernel cache) faults the lane at
once, with that reason, rather than after five restarts, and it is probed with
the same backoff; its lane work is refused, never served from host memory. What
each host holds for itself (its CUDA context, from its hello) is booked as the
lane's memory, and the sentinel's is reported to the node (`on_reserved`: the
ledger keeps it back with the headroom).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from capabilities import Claims, LaneOp, LaneValidator, TokenRefusal, TokenRefused
from lanehost.protocol import MAX_BUFFERS
from machine.cgroups import InvocationCgroup
from machine.lanes import Lane
from supervisor.lane_buffers import BUFFERS_PER_INVOCATION, SENTINEL, LaneBuffers, reserved_by
from supervisor.lane_host_errors import LaneHostFailed
from supervisor.lane_jobs import LaneJobRunner
from supervisor.lane_session import CLOSE_SECONDS, LaneSession, SessionJob, heartbeat, unplaced
from supervisor.lane_work import (
    Download,
    LaneBusy,
    LaneDevice,
    LaneJob,
    LaneWorkError,
    LaneWorkReply,
    lane_op,
)

__all__ = ["KERNEL_SECONDS", "LaneBusy", "LaneOwner", "LaneRecovery", "LaneWorkError"]

log = logging.getLogger(__name__)

_PROBLEM_CHARS = 200  # of the last host failure, in a faulted lane's reason
# A faulted lane's reason when its hosts cannot run CUDA (health_coupling keeps such a
# lane allocatable: processes that bring their own CUDA still run on its device).
CUDA_UNAVAILABLE = "cuda_unavailable"
# Invocations with a lane session on one lane at once: the default --max-running,
# so every running invocation can have one; each is a process (about 31 MiB of
# host memory with NumPy, a CUDA context on a GPU).
SESSIONS_PER_LANE = 64
# A kernel's deadline when its request names none, and the most one may name
# (the daemon's --max-kernel-seconds).
KERNEL_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class LaneRecovery:
    """How a lane owner watches its hosts while idle and brings a faulted lane back."""

    heartbeat_interval: float = 2.0  # seconds without an answer from a host before asking
    heartbeat_timeout: float = 2.0  # for it to answer the heartbeat
    retry_initial: float = 1.0  # before the first probe of a faulted lane
    retry_max: float = 60.0  # the wait doubles after each failed probe, up to this


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
        on_session_failed: Callable[[str, str, str], None] = lambda _lane, _sub, _code: None,
        on_host_call: Callable[[str, float], None] = lambda _op, _seconds: None,
        on_reserved: Callable[[str, int], None] = lambda _lane, _nbytes: None,
        place: Callable[[str, str], Awaitable[InvocationCgroup | None]] = unplaced,
        share: int = 8,
        max_sessions: int = SESSIONS_PER_LANE,
        max_buffers: int = MAX_BUFFERS,
        max_buffers_per_invocation: int = BUFFERS_PER_INVOCATION,
        max_kernel_seconds: float = KERNEL_SECONDS,
        max_restarts: int = 5,
        window: float = 60.0,
        recovery: LaneRecovery = LaneRecovery(),
    ) -> None:
        self.lane = lane
        self._validator = validator
        self._host_factory = host_factory
        self._on_fault = on_fault
        self._on_recovered = on_recovered
        self._on_session_failed = on_session_failed
        self._on_reserved = on_reserved
        self._recovery = recovery
        self._place = place
        # Invocations whose session's host failed to start: (failures, no new session
        # before this trio time). Kept while the invocation lives (`free_invocation`).
        self._start_backoff: dict[str, tuple[int, float]] = {}
        self.share = share  # jobs one invocation may have queued on this lane
        self._max_sessions = max_sessions
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
            max_kernel_seconds=max_kernel_seconds,
        )
        self.sessions: dict[str, LaneSession] = {}  # by invocation
        self._closing: dict[str, LaneSession] = {}  # sessions being ended, by invocation
        self.session_starts = 0
        self._max_restarts = max_restarts
        self._window = window
        self.restarts: deque[float] = deque(maxlen=max_restarts + 1)
        self.host_starts = 0  # sentinels started
        self.faulted = False
        self.fault_reason = ""  # why the lane is out of service, while it is
        self.retry_delay = recovery.retry_initial  # the wait before the next probe
        self.next_probe_at: float | None = None  # trio time, while a faulted lane waits
        self._recovered_at: float | None = None  # when a probe last brought the lane back
        self.stopped = False
        self._host: LaneDevice | None = None  # the sentinel
        self._nursery: trio.Nursery | None = None  # where sessions run
        # Where the sentinel stands, for readiness: starting, ready, restarting, faulted,
        # stopped.
        self.host_status = "starting"
        self.host_problem = ""  # why it is restarting
        self.host_reserved = 0  # what the sentinel holds for itself (its CUDA context)
        self.cuda_unavailable = False  # faulted because its hosts cannot run CUDA
        self.first_start = trio.Event()  # the first sentinel answered its hello, or failed to
        self._exited: LaneDevice | None = None  # a sentinel seen to exit on its own
        self._idle: trio.CancelScope | None = None  # set while the sentinel idles

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
        """Check the token, queue the work in its invocation's session (never waiting
        for room) and wait for its reply; the caller bounds the wait."""
        job = await self._submit(token, work)
        assert job.reply is not None
        return job.reply

    async def download(self, token: str, work: Download) -> bytes:
        job = await self._submit(token, work)
        assert job.data is not None
        return job.data

    async def _submit(self, token: str, work: LaneJob) -> SessionJob:
        if self.faulted:
            # Why it is out: its hosts failed too often, or cannot run CUDA at all.
            raise LaneWorkError(503, "lane_unhealthy", self.fault_reason or "the lane is out")
        if self.stopped or self._nursery is None:
            raise LaneWorkError(503, "shutting_down", "the lane owner is not running")
        claims = self._validator.validate(token, lane_id=self.lane.lane_id, op=lane_op(work))
        job = SessionJob(token, work, claims.sub)
        self._session_of(claims.sub, self._nursery).put(job)
        try:
            await job.done.wait()
        finally:
            # Not answered: still queued, it never runs; running, a reserve is undone.
            job.abandoned = not job.done.is_set()
        if job.error is not None:
            raise job.error
        return job

    def _session_of(self, invocation_id: str, nursery: trio.Nursery) -> LaneSession:
        session = self.sessions.get(invocation_id)
        if session is not None:
            return session
        if len(self.sessions) >= self._max_sessions:
            raise LaneBusy(self.lane.lane_id)
        failures, retry_at = self._start_backoff.get(invocation_id, (0, 0.0))
        if trio.current_time() < retry_at:  # a host of its own just failed to start
            raise LaneWorkError(
                503,
                "lane_session_failed",
                f"its lane host failed to start {failures} time(s); "
                f"retry in {retry_at - trio.current_time():.1f} s",
            )
        session = LaneSession(
            self.lane.lane_id,
            invocation_id,
            self._host_factory(self.lane),
            self._jobs,
            share=self.share,
            heartbeat_interval=self._recovery.heartbeat_interval,
            heartbeat_timeout=self._recovery.heartbeat_timeout,
            on_failed=self._session_failed,
            place=self._place,
        )
        self.sessions[invocation_id] = session
        self.session_starts += 1
        nursery.start_soon(self._run_session, session)
        nursery.start_soon(session.watch)
        return session

    async def _run_session(self, session: LaneSession) -> None:
        invocation_id = session.invocation_id
        try:
            await session.run()
        finally:
            if self.sessions.get(invocation_id) is session:
                del self.sessions[invocation_id]
                self._note_start(session)
            if invocation_id not in self.sessions:  # (not a newer session's book)
                self._buffers.forget(invocation_id)  # its host is gone, and every buffer

    def _note_start(self, session: LaneSession) -> None:
        """A session whose host failed to start: its invocation waits before the next
        (1 s, doubling to 60 s), so a host that cannot start is not spawned for every
        request; one that started clears the wait."""
        invocation_id = session.invocation_id
        if not session.start_failed:
            self._start_backoff.pop(invocation_id, None)
            return
        failures = self._start_backoff.get(invocation_id, (0, 0.0))[0] + 1
        wait = min(self._recovery.retry_initial * 2 ** (failures - 1), self._recovery.retry_max)
        self._start_backoff[invocation_id] = (failures, trio.current_time() + wait)

    def _session_failed(self, session: LaneSession, code: str, message: str) -> None:
        """A session that had started failed: its invocation ends with the reason;
        one that never started only refused its work (the sentinel speaks for the lane).
        A session closed on purpose is no longer in the table: nothing to say."""
        if self.sessions.get(session.invocation_id) is session and session.started:
            self._on_session_failed(self.lane.lane_id, session.invocation_id, code)

    @property
    def sentinel(self) -> LaneDevice | None:
        """The lane's own host, which holds no tenant's buffers: its health is the lane's."""
        return self._host

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
        """Whether freeing the invocation here has anything to do (it has a session or
        holds a buffer): otherwise `free_invocation` need not be awaited."""
        return (
            invocation_id in self.sessions
            or invocation_id in self._closing
            or self._buffers.holds_any(invocation_id)
            or invocation_id in self._start_backoff
        )

    async def free_invocation(self, invocation_id: str) -> int:
        """End the invocation's session, and with its host every buffer it held; the
        bytes given back. Its tokens are revoked first, so nothing new reaches it;
        work of it still running ends with the session. Callers shield this with a
        deadline."""
        freed = self._buffers.held_by(invocation_id)
        session = self.sessions.pop(invocation_id, None) or self._closing.get(invocation_id)
        if session is not None:
            # A second caller waits for the same ending, never returns before it.
            self._closing[invocation_id] = session
            try:
                await session.close()
            finally:
                if self._closing.get(invocation_id) is session:
                    del self._closing[invocation_id]
        if invocation_id not in self.sessions:
            self._buffers.forget(invocation_id)
        self._start_backoff.pop(invocation_id, None)
        return freed

    # -- the owner task ---------------------------------------------------------------
    async def run(self) -> None:
        """Start the lane's sentinel and serve until cancelled, restarting it after a
        failure with bounded intensity; past it the lane is out of service and probed
        with backoff until a sentinel starts again. Sessions run in this task's
        nursery, so they end with it."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await self._supervise(nursery)
            finally:
                self._nursery = None
            nursery.cancel_scope.cancel()

    async def _supervise(self, nursery: trio.Nursery) -> None:
        try:
            while True:
                no_cuda = False
                try:
                    await self._serve(nursery)
                except LaneHostFailed as exc:
                    log.error("lane %s: %s", self.lane.lane_id, exc)
                    self._restarting(f"{exc.reason}: {exc.message}")
                    # Restarting will not bring CUDA: out of service at once, probed.
                    no_cuda = exc.reason == "cuda_unavailable"
                    await self._lose_host()
                except Exception as exc:
                    log.exception("lane owner %s crashed", self.lane.lane_id)
                    self._restarting(f"the lane owner crashed: {exc!r}")
                    await self._lose_host()
                if self.faulted:  # a probe failed: wait twice as long for the next
                    self.retry_delay = min(self.retry_delay * 2, self._recovery.retry_max)
                elif no_cuda or self._too_many_restarts():
                    await self._fault(cuda_unavailable=no_cuda)
                if self.faulted:
                    await self._wait_for_probe()
        finally:
            # Cancelled (shutdown): nobody will serve what is queued; the sessions
            # end with the nursery, each refusing what it had queued.
            self.stopped = True
            if not self.faulted:
                self.host_status = "stopped"
            self.first_start.set()
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

    async def _fault(self, *, cuda_unavailable: bool = False) -> None:
        """Out of service: its sessions end, a GPU lane leaves allocatable (the CPU
        pool's processes and builtins never use its hosts: only its lane work goes),
        and the lane is shown unhealthy until a probe brings it back. A lane whose
        hosts cannot run CUDA loses only its lane work too: its device is healthy,
        and processes that bring their own CUDA still run there."""
        now = trio.current_time()
        flapping = self._recovered_at is not None and now - self._recovered_at <= self._window
        # Back and out again within the window: wait longer than last time.
        self.retry_delay = (
            min(self.retry_delay * 2, self._recovery.retry_max)
            if flapping
            else self._recovery.retry_initial
        )
        self.faulted, self.host_status = True, "faulted"
        self.cuda_unavailable = cuda_unavailable
        problem = self.host_problem[:_PROBLEM_CHARS]
        if cuda_unavailable:
            why = problem.removeprefix(f"{CUDA_UNAVAILABLE}: ")
            self.fault_reason = (
                f"{CUDA_UNAVAILABLE}: {why}; its lane work is refused (never run on the"
                " CPU instead) until a new host runs CUDA"
            )
            log.error("lane %s: its hosts cannot run CUDA: %s", self.lane.lane_id, why)
        else:
            what = "out of service" if self.lane.is_gpu else "its lane work refused"
            self.fault_reason = (
                f"lane_host_failed: its lane host failed too often"
                f" ({problem}); {what} until a new host answers"
            )
            log.error("lane %s: its host failed too often; %s", self.lane.lane_id, what)
        self._on_fault(self.lane.lane_id, self.fault_reason)
        # Every session ends at once, side by side; the wait is bounded as each one's is.
        ending, self.sessions = list(self.sessions.values()), {}
        for session in ending:
            session.begin_close()
            self._buffers.forget(session.invocation_id)
        with trio.move_on_after(CLOSE_SECONDS, shield=True):
            for session in ending:
                await session.ended.wait()

    async def _wait_for_probe(self) -> None:
        self.next_probe_at = trio.current_time() + self.retry_delay
        log.info("lane %s: probing a new host in %s s", self.lane.lane_id, self.retry_delay)
        await trio.sleep(self.retry_delay)

    def _recover(self) -> None:
        """A probe's sentinel answered its hello: back in service, with a fresh window."""
        self.faulted, self.fault_reason, self.next_probe_at = False, "", None
        self.cuda_unavailable = False
        self.restarts.clear()
        self._recovered_at = trio.current_time()
        log.warning("lane %s: a new host answered; back in service", self.lane.lane_id)
        self._on_recovered(self.lane.lane_id)

    async def _watch(self, host: LaneDevice) -> None:
        """Notice the sentinel's process exiting on its own, even while it idles."""
        await host.wait_exited()
        if self._host is host:
            self._exited = host
            if self._idle is not None:
                self._idle.cancel()  # wake the owner to replace it

    async def _close_host(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            await host.aclose()  # shielded, bounded and killing by LaneHost's own contract

    def _host_reserved(self, nbytes: int) -> None:
        """The sentinel's hello said what it holds for itself. Kept while it is
        replaced: its successor needs the same room, which no guest may take."""
        if nbytes != self.host_reserved:
            self.host_reserved = nbytes
            self._on_reserved(self.lane.lane_id, nbytes)
        self._buffers.host_started(SENTINEL, nbytes)

    async def _lose_host(self) -> None:
        """The sentinel (or the owner's view of it) cannot be trusted: end it. It held
        no tenant's buffers, so nobody else loses anything."""
        with trio.CancelScope(shield=True):
            await self._close_host()

    async def _serve(self, nursery: trio.Nursery) -> None:
        host = self._host = self._host_factory(self.lane)
        self.host_starts += 1
        self._host_reserved(reserved_by(await host.start()))
        if self.faulted:
            self._recover()  # the probe's hello answered
        self.host_status, self.host_problem = "ready", ""
        self.first_start.set()
        nursery.start_soon(self._watch, host)
        while True:
            if self._exited is host:
                raise LaneHostFailed(self.lane.lane_id, "crashed", "the lane host exited")
            # Idle for an interval (or until the watcher sees it exit), then ask.
            with trio.CancelScope() as idle:
                self._idle = idle
                await trio.sleep(self._recovery.heartbeat_interval)
            self._idle = None
            if self._exited is not host:
                await heartbeat(self.lane.lane_id, host, self._recovery.heartbeat_timeout)
