"""One invocation's record: what was asked, what it holds, where it stands."""

from __future__ import annotations

import datetime
import time

import trio

from machine.cgroups import CgroupUsage
from machine.ledger import Reservation
from supervisor.lifecycle import Ending, next_state
from supervisor.logstore import InvocationLogs
from supervisor.output import OutputRing
from supervisor.wire import (
    MAX_COMMAND_ARGS,
    MAX_COMMAND_CHARS,
    BuiltinWork,
    Command,
    GrantedLane,
    GuestNetwork,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    ProcessWork,
    SubmitResponse,
    Usage,
)

__all__ = ["Invocation", "command_of", "duration_between", "utc_now"]

OUTPUT_BYTES = 64 * 1024
TAIL_CHARS = 4096


_second: list[tuple[int, str]] = [(-1, "")]  # the last second formatted, and its text


def utc_now() -> str:
    """RFC 3339 in UTC, written as snapshots write it (`rfc3339`: milliseconds, "Z").
    Several per invocation: the text up to the second is formatted once a second."""
    now = time.time()
    second = int(now)
    cached, prefix = _second[0]
    if cached != second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
        _second[0] = (second, prefix)
    return f"{prefix}{int((now - second) * 1000):03d}Z"


def unix_time(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time; None for one that does not parse."""
    try:
        stamp = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return stamp.timestamp()


def duration_between(
    start: str | None, end: str | None, *, now: float | None = None
) -> float | None:
    """Seconds from `start` to `end` (to `now` when `end` is None), in milliseconds as
    the times are written; None when `start` is unknown or a time does not parse."""
    began = None if start is None else unix_time(start)
    until = (time.time() if now is None else now) if end is None else unix_time(end)
    if began is None or until is None:
        return None
    return round(max(0.0, until - began), 3)


def command_of(work: ProcessWork | BuiltinWork) -> Command:
    """What the status shows of `work`: a builtin's name, or a process's argv in at most
    MAX_COMMAND_ARGS arguments and MAX_COMMAND_CHARS characters (the first argument past
    the size is cut to fit and ends with "…"); never its environment nor a builtin's args."""
    if isinstance(work, BuiltinWork):
        return Command(kind="builtin", name=work.name)
    shown: list[str] = []
    room = MAX_COMMAND_CHARS
    cut = len(work.argv) > MAX_COMMAND_ARGS
    for arg in work.argv[:MAX_COMMAND_ARGS]:
        if len(arg) > room:
            if room > 0:
                shown.append(arg[: room - 1] + "…")
            cut = True
            break
        shown.append(arg)
        room -= len(arg)
    return Command(kind="process", argv=shown, argc=len(work.argv), argv_cut=cut)


class Invocation:
    """Mutable, owned by the supervisor; everything outside sees `status()`."""

    def __init__(self, request: InvocationRequest, scope: trio.CancelScope) -> None:
        self.request = request
        self.command = command_of(request.work)
        self.scope = scope
        self.state = InvocationState.queued
        self.reason: str | None = None
        self.cancel_reason: str | None = None  # set by whoever asked for the cancel
        self.reservation: Reservation | None = None
        self.tokens: dict[str, str] = {}
        self.exit_code: int | None = None
        self.pid: int | None = None
        self.uid: int | None = None
        self.network: GuestNetwork | None = None
        self.usage: Usage | None = None
        self.wall_deadline = 0.0  # Unix time its tokens may not outlive (set at admission)
        self.stuck = False  # its process survived SIGKILL: its resources stay held
        self.submitted_at = utc_now()
        self.started_at: str | None = None
        self.ended_at: str | None = None
        self.stdout = OutputRing(OUTPUT_BYTES)
        self.stderr = OutputRing(OUTPUT_BYTES)
        self.logs: InvocationLogs | None = None  # its files on disk, when the node keeps them
        self._lanes: tuple[Reservation | None, list[GrantedLane]] = (None, [])
        self.admission_over = False  # admission succeeded or failed
        self._admission: trio.Event | None = None  # made only if someone waits for it
        self.finished = trio.Event()  # set once released and terminal

    @property
    def id(self) -> str:
        return self.request.id

    def end_admission(self) -> None:
        self.admission_over = True
        if self._admission is not None:
            self._admission.set()

    async def admission_ended(self) -> None:
        """Return once admission succeeded or failed (a resubmission waits for it)."""
        if not self.admission_over:
            if self._admission is None:
                self._admission = trio.Event()
            await self._admission.wait()

    def cancel(self, reason: str) -> None:
        """Cancel its scope; the first reason asked for is the one it ends with."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.scope.cancel()

    def advance(self, ending: Ending, *, at: str | None = None) -> InvocationState:
        self.state = next_state(self.state, ending)
        if ending is Ending.start:
            self.started_at = at or utc_now()
        else:
            self.ended_at = at or utc_now()
        return self.state

    def record_usage(self, usage: CgroupUsage) -> None:
        self.usage = Usage(
            cpu_seconds=round(usage.cpu_seconds, 6),
            peak_memory_bytes=usage.peak_memory_bytes,
            oom_killed=usage.oom_killed,
            pids_limit_hit=usage.pids_limit_hit,
        )

    def failure_reason(self) -> str:
        """Why a process that exited non-zero failed, in the kernel's words where it knows."""
        if self.usage is not None and self.usage.oom_killed:
            return "oom_killed"
        if self.usage is not None and self.usage.pids_limit_hit:
            return "pids_limit"
        return "nonzero_exit"

    def lanes(self) -> list[GrantedLane]:
        """The granted lanes (built once per reservation; read-only, shared by every
        status built from it)."""
        reservation, lanes = self._lanes
        if reservation is not self.reservation:
            reservation = self.reservation
            lanes = [
                GrantedLane(lane_id=g.lane_id, kind=g.kind.value, vram_bytes=g.vram_bytes)
                for g in (reservation.lanes if reservation is not None else ())
            ]
            self._lanes = (reservation, lanes)
        return lanes

    def status(
        self, *, state: InvocationState | None = None, ended_at: str | None = None
    ) -> InvocationStatus:
        """Its status now; or, with `state` and `ended_at`, as it will be once it reaches
        that state then (built once per ending: journaled, listed and announced)."""
        request = self.request
        ended_at = ended_at or self.ended_at
        return InvocationStatus(
            id=self.id,
            state=state or self.state,
            reason=self.reason,
            requirement=request.requirement,
            isolation=request.isolation,
            command=self.command,
            resources=request.resources,
            labels=request.labels,
            lanes=self.lanes(),
            exit_code=self.exit_code,
            submitted_at=self.submitted_at,
            started_at=self.started_at,
            ended_at=ended_at,
            duration_s=duration_between(self.started_at or self.submitted_at, ended_at),
            stdout_tail=self.stdout.tail(TAIL_CHARS),
            stderr_tail=self.stderr.tail(TAIL_CHARS),
            stdout_bytes=self.stdout.total_bytes,
            stderr_bytes=self.stderr.total_bytes,
            logs_cut=self.logs.cut if self.logs is not None else None,
            usage=self.usage,
            uid=self.uid,
            network=self.network,
        )

    def submit_response(self) -> SubmitResponse:
        return SubmitResponse(
            id=self.id, state=self.state, lanes=self.lanes(), tokens=dict(self.tokens)
        )
