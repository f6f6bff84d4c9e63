"""A deterministic lane host for tests: the real `LaneState` and NumPy kernels in
the test's own process, plus kernels that take (mock-clock) time or misbehave.

`sleep` waits `seconds` of trio time, `boom` raises what no kernel should (the
session running it crashes), `crash` makes the host fail like a dead process. `die()` ends
a host as if its process exited while idle; `hang()` makes it answer nothing
more, as a SIGSTOPped process would. The factory can make the hosts it makes
from then on fail to start (`refuse_starts`) or wait at start (`start_gate`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import trio

from lanehost.backend import select_backend
from lanehost.kernels import load_kernels
from lanehost.protocol import (
    PROTOCOL_VERSION,
    Alloc,
    AllocReply,
    ErrorReply,
    Free,
    FreeAll,
    FreeAllReply,
    FreeReply,
    Hello,
    HelloReply,
    Read,
    ReadReply,
    Reply,
    Request,
    Run,
    RunReply,
    Scalar,
    Stats,
    StatsReply,
    Write,
    WriteReply,
)
from lanehost.state import LaneState
from machine.cgroups import InvocationCgroup
from machine.lanes import Lane
from supervisor.lane_host import LaneHostError, LaneHostFailed

__all__ = ["InProcessHost", "InProcessHosts"]

_R = TypeVar("_R", bound=Reply)


class InProcessHost:
    def __init__(self, lane: Lane) -> None:
        self.lane_id = lane.lane_id
        self.state = LaneState(select_backend("numpy"), lane.vram_bytes, load_kernels())
        self.dead = False
        self.closed = False
        self.hung = False
        self.heartbeats = 0  # `stats` requests
        self.deadlines: list[float | None] = []  # each kernel's, as asked
        self.cgroup: InvocationCgroup | None = None  # where it was started
        self.refuse_start = False
        self.start_gate: trio.Event | None = None
        self.close_gate: trio.Event | None = None  # set: closing waits for it
        self._ids = 0
        self._exited = trio.Event()
        self._resumed = trio.Event()

    async def _call(self, request: Request, expected: type[_R]) -> _R:
        await trio.lowlevel.checkpoint()
        if self.hung and not self.closed:
            await self._resumed.wait()  # stopped: no answer until resumed, killed or given up on
        if self.dead or self.closed:
            raise LaneHostFailed(self.lane_id, "crashed", "the lane host is not running")
        self._ids += 1
        reply = self.state.handle(request)
        if isinstance(reply, ErrorReply):
            raise LaneHostError(reply.code, reply.message)
        assert isinstance(reply, expected)
        return reply

    async def start(self, *, cgroup: InvocationCgroup | None = None) -> HelloReply:
        self.cgroup = cgroup
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.refuse_start:
            self.die()
            raise LaneHostFailed(self.lane_id, "start_failed", "the lane host would not start")
        return await self._call(Hello(id=1, version=PROTOCOL_VERSION), HelloReply)

    async def aclose(self) -> None:
        if self.close_gate is not None:
            await self.close_gate.wait()  # a process slow to die
        self.closed = True
        self._exited.set()
        self._resumed.set()  # a stopped process that is killed answers its pipe with EOF

    async def wait_exited(self) -> None:
        await self._exited.wait()

    def die(self) -> None:
        self.dead = True
        self._exited.set()

    def hang(self) -> None:
        """Stop answering, without exiting (a SIGSTOPped process)."""
        self.hung = True

    def resume(self) -> None:
        """Answer again (SIGCONT): what was asked meanwhile is answered now."""
        self.hung = False
        self._resumed.set()

    async def stats(self, *, seconds: float | None = None) -> StatsReply:
        self.heartbeats += 1
        return await self._call(Stats(id=1), StatsReply)

    async def alloc(self, buffer_id: str, dtype: str, shape: Sequence[int]) -> int:
        msg = Alloc(id=1, buffer_id=buffer_id, dtype=dtype, shape=tuple(shape))  # type: ignore[arg-type]
        return (await self._call(msg, AllocReply)).nbytes

    async def free(self, buffer_id: str) -> int:
        return (await self._call(Free(id=1, buffer_id=buffer_id), FreeReply)).nbytes

    async def free_all(self, buffer_ids: Sequence[str]) -> int:
        return (await self._call(FreeAll(id=1, buffer_ids=list(buffer_ids)), FreeAllReply)).nbytes

    async def write(self, buffer_id: str, offset: int, data: bytes) -> int:
        msg = Write(id=1, buffer_id=buffer_id, offset=offset, data=memoryview(data))
        return (await self._call(msg, WriteReply)).nbytes

    async def read(self, buffer_id: str, offset: int, length: int) -> bytes:
        msg = Read(id=1, buffer_id=buffer_id, offset=offset, length=length)
        return bytes((await self._call(msg, ReadReply)).data)

    async def run(
        self,
        kernel: str,
        args: Mapping[str, Scalar],
        buffers: Mapping[str, str],
        *,
        seconds: float | None = None,
    ) -> dict[str, Scalar]:
        self.deadlines.append(seconds)
        if kernel == "sleep":
            # Past its deadline the host is killed, as LaneHost kills one that overran.
            with trio.move_on_after(float("inf") if seconds is None else seconds) as late:
                await trio.sleep(float(args.get("seconds", 0)))
            if late.cancelled_caught:
                self.die()
                raise LaneHostFailed(self.lane_id, "timeout", f"no answer to Run in {seconds} s")
            return {"seconds": args.get("seconds", 0)}
        if kernel == "boom":
            raise RuntimeError("a kernel that should never raise did")
        if kernel == "crash":
            self.die()
            raise LaneHostFailed(self.lane_id, "crashed", "the lane host died")
        msg = Run(id=1, kernel=kernel, args=dict(args), buffers=dict(buffers))
        return (await self._call(msg, RunReply)).result


class InProcessHosts:
    """The factory a supervisor gets; remembers every host it made, per lane."""

    def __init__(self) -> None:
        self.made: defaultdict[str, list[InProcessHost]] = defaultdict(list)
        self.made_at: defaultdict[str, list[float]] = defaultdict(list)  # trio time of each
        self.refuse_starts = False  # hosts made from now on fail to start
        self.start_gate: trio.Event | None = None  # hosts made from now on wait for it to start

    def __call__(self, lane: Lane) -> InProcessHost:
        host = InProcessHost(lane)
        host.refuse_start, host.start_gate = self.refuse_starts, self.start_gate
        self.made[lane.lane_id].append(host)
        self.made_at[lane.lane_id].append(trio.current_time())
        return host

    def current(self, lane_id: str) -> InProcessHost:
        """The host made last for the lane (its sentinel, or its newest session's)."""
        return self.made[lane_id][-1]

    def live(self, lane_id: str) -> list[InProcessHost]:
        return [host for host in self.made[lane_id] if not (host.dead or host.closed)]

    def used(self, lane_id: str) -> int:
        """The buffer bytes the lane's live hosts hold between them."""
        return sum(host.state.used for host in self.live(lane_id))

    def asked(self, lane_id: str) -> int:
        """The requests the lane's hosts have answered, heartbeats aside."""
        return sum(host._ids - host.heartbeats for host in self.made[lane_id])

    def summary(self) -> dict[str, Any]:
        return {lane: len(hosts) for lane, hosts in self.made.items()}
