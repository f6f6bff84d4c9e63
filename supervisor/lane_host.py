"""The lane owner's client for its lane host process (`lanehost`, docs/lane-host-protocol.md).

`LaneHost` starts the host with the lane's environment (its device in
`CUDA_VISIBLE_DEVICES`, none for the CPU pool), greets it, and then sends one
request at a time, each under its own deadline. A host given a device must
keep its buffers with CuPy: one that refuses its hello `cuda_unavailable`, or
answers with NumPy, fails with that reason, and its lane is never served from
host memory. A sticky device error (`device_failed`) ends the host too. The host is trusted code but
still a process that can crash, hang or garble: any of those raises
`LaneHostFailed` and the host is killed, so a `LaneHost` never stays half
alive. A request the host refuses raises `LaneHostError` with the protocol's
code; that changed nothing and the host stays in service.

The host never outlives the daemon: it leads its own process group, which
`aclose` and every failure kill, and it is started with PR_SET_PDEATHSIG =
SIGKILL, so a daemon killed with SIGKILL takes its hosts with it
(`supervisor.lane_host_process`; the frames travel by `supervisor.lane_host_pipes`).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NoReturn, TypeVar

import msgspec
import trio

from lanehost.backend import ArrayBackend
from lanehost.protocol import (
    PROTOCOL_VERSION,
    Alloc,
    AllocReply,
    EndOfStream,
    ErrorReply,
    FrameError,
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
    frame,
)
from machine.cgroups import InvocationCgroup
from machine.lanes import Lane
from supervisor.lane_host_errors import FailureReason, LaneHostError, LaneHostFailed
from supervisor.lane_host_pipes import HostPipes
from supervisor.lane_host_process import (
    DEFAULT_COMMAND,
    REAP_SECONDS,
    HostProcess,
    host_environment,
    start_host,
)

__all__ = [
    "DEFAULT_COMMAND",
    "FailureReason",
    "LaneHost",
    "LaneHostError",
    "LaneHostFailed",
    "host_environment",
    "lane_host_factory",
    "request_frames",
]

log = logging.getLogger(__name__)

_R = TypeVar("_R", bound=Reply)

Backend = Literal["auto", "numpy", "cupy"]


def request_frames(request: Request) -> list[bytes | memoryview]:
    """The bytes of one request's frame. A request that does not encode - a value
    msgpack cannot carry, a frame over the bound - is `LaneHostError("bad_args")`:
    nothing was sent, so the host is still in step and in service. The lane owner
    checks lane work before it gets here (`supervisor.lane_checks`); this is the
    last word for anything that slipped past, never the host's end."""
    try:
        return frame(request)
    except FrameError as exc:
        raise LaneHostError("bad_args", str(exc)) from None


class LaneHost:
    """One lane host process and the one conversation the owner has with it."""

    def __init__(
        self,
        lane_id: str,
        memory_bytes: int,
        *,
        visible_devices: Sequence[str] = (),
        backend: Backend = "auto",
        command: Sequence[str] = DEFAULT_COMMAND,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        op_timeout: float = 30.0,
        close_timeout: float = 5.0,
    ) -> None:
        self.lane_id = lane_id
        self.memory_bytes = memory_bytes
        # What the host must keep its buffers with: `auto` is CuPy on a device, NumPy
        # without one. A host that answers otherwise is refused (`start`).
        self.backend: ArrayBackend = (
            ("cupy" if visible_devices else "numpy") if backend == "auto" else backend
        )
        self._argv = [
            *command,
            "--lane-id",
            lane_id,
            "--memory-bytes",
            str(memory_bytes),
            "--backend",
            self.backend,
        ]
        self._env = host_environment(visible_devices, env or {}, os.environ)
        self._start_timeout = start_timeout
        self._op_timeout = op_timeout
        self._close_timeout = close_timeout
        self._lock = trio.Lock()
        self._process: HostProcess | None = None
        self._ids = 0
        self._hello: HelloReply | None = None
        self._closed = False

    # -- life --------------------------------------------------------------

    @property
    def hello(self) -> HelloReply:
        """What the host said at start: version, backend, device, budget, kernels."""
        if self._hello is None:
            raise RuntimeError("the lane host is not started")
        return self._hello

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.popen.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._hello is not None

    async def __aenter__(self) -> LaneHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self, *, cgroup: InvocationCgroup | None = None) -> HelloReply:
        """Start the host (in `cgroup`, when given: an invocation's, which is then charged
        for all it spends) and greet it within `start_timeout`; LaneHostFailed if it cannot."""
        async with self._lock:
            if self._process is not None or self._closed:
                raise RuntimeError("a LaneHost starts once")
            await self._spawn(None if cgroup is None else cgroup.preexec_join())
            hello = Hello(id=self._next_id(), version=PROTOCOL_VERSION)
            try:
                reply = await self._exchange(hello, HelloReply, self._start_timeout)
            except LaneHostError as exc:
                if exc.code == "cuda_unavailable":
                    await self._fail("cuda_unavailable", exc.message)
                await self._fail("protocol", f"hello refused: {exc}")
            if reply.version != PROTOCOL_VERSION:
                await self._fail("version", f"host speaks version {reply.version}")
            if reply.memory_total != self.memory_bytes:
                await self._fail("protocol", f"host reports a budget of {reply.memory_total}")
            if reply.backend != self.backend:
                # Never a device lane served from host memory, whatever the host command.
                reason: FailureReason = "cuda_unavailable" if self.backend == "cupy" else "protocol"
                await self._fail(
                    reason, f"the host keeps its buffers with {reply.backend}, not {self.backend}"
                )
            self._hello = reply
            log.info(
                "lane host for %s: pid %s, %s on %s, %d of %d bytes reserved by the host",
                self.lane_id,
                self.pid,
                reply.backend,
                reply.device,
                reply.memory_reserved,
                reply.memory_total,
            )
            return reply

    async def _spawn(self, join: Callable[[], None] | None) -> None:
        try:
            self._process = await start_host(self.lane_id, self._argv, self._env, join)
        except BaseException as exc:
            self._closed = True
            if isinstance(exc, (OSError, subprocess.SubprocessError)):
                raise LaneHostFailed(self.lane_id, "start_failed", repr(exc)) from exc
            raise

    async def aclose(self) -> None:
        """End the host: EOF first, SIGKILL to its group after `close_timeout`. Shielded."""
        with trio.CancelScope(shield=True):
            self._closed = True
            if self._lock.locked():
                self._kill_group()  # a request in flight ends with "closed" at once
            with trio.move_on_after(self._close_timeout + REAP_SECONDS + 1):
                async with self._lock:
                    await self._end(graceful=True)

    # -- requests ----------------------------------------------------------

    async def alloc(
        self, buffer_id: str, dtype: str, shape: Sequence[int], *, seconds: float | None = None
    ) -> int:
        """A zeroed buffer; its size in bytes. `out_of_memory` beyond the lane's budget."""
        msg = Alloc(id=0, buffer_id=buffer_id, dtype=dtype, shape=tuple(shape))  # type: ignore[arg-type]
        return (await self._call(msg, AllocReply, seconds)).nbytes

    async def free(self, buffer_id: str, *, seconds: float | None = None) -> int:
        """Bytes given back. `unknown_buffer` if the host holds no such buffer."""
        return (await self._call(Free(id=0, buffer_id=buffer_id), FreeReply, seconds)).nbytes

    async def free_all(self, buffer_ids: Sequence[str], *, seconds: float | None = None) -> int:
        """Bytes given back; ids the host does not hold are skipped."""
        msg = FreeAll(id=0, buffer_ids=list(buffer_ids))
        return (await self._call(msg, FreeAllReply, seconds)).nbytes

    async def write(
        self, buffer_id: str, offset: int, data: bytes, *, seconds: float | None = None
    ) -> int:
        msg = Write(id=0, buffer_id=buffer_id, offset=offset, data=memoryview(data))
        return (await self._call(msg, WriteReply, seconds)).nbytes

    async def read(
        self, buffer_id: str, offset: int, length: int, *, seconds: float | None = None
    ) -> bytes:
        msg = Read(id=0, buffer_id=buffer_id, offset=offset, length=length)
        return bytes((await self._call(msg, ReadReply, seconds)).data)

    async def run(
        self,
        kernel: str,
        args: Mapping[str, Scalar] | None = None,
        buffers: Mapping[str, str] | None = None,
        *,
        seconds: float | None = None,
    ) -> dict[str, Scalar]:
        """Run a kernel of the host's registry; its scalar results."""
        msg = Run(id=0, kernel=kernel, args=dict(args or {}), buffers=dict(buffers or {}))
        return (await self._call(msg, RunReply, seconds)).result

    async def stats(self, *, seconds: float | None = None) -> StatsReply:
        return await self._call(Stats(id=0), StatsReply, seconds)

    # -- the conversation --------------------------------------------------

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def _call(self, request: Request, expected: type[_R], seconds: float | None) -> _R:
        # The lock without its own scheduler pass when free: the exchange waits
        # for the reply anyway, which is this call's checkpoint.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            if not self.running:
                reason: FailureReason = "closed" if self._closed else "crashed"
                raise LaneHostFailed(self.lane_id, reason, "the lane host is not running")
            request = msgspec.structs.replace(request, id=self._next_id())
            return await self._exchange(
                request, expected, self._op_timeout if seconds is None else seconds
            )
        finally:
            self._lock.release()

    async def _exchange(self, request: Request, expected: type[_R], seconds: float) -> _R:
        """One request and its reply, under the lock. Anything but a well-formed
        answer - or being cancelled halfway - kills the host."""
        parts = request_frames(request)  # never sent if it does not encode: nothing changed
        done = False
        try:
            # A bare scope rather than fail_after, whose context-manager layers
            # cost a fifth of a noop's round trip.
            with trio.CancelScope(deadline=trio.current_time() + seconds) as scope:
                pipes = self._pipes()
                for data in parts:
                    await pipes.send(data)
                reply = await pipes.receive()
            if scope.cancelled_caught:
                raise trio.TooSlowError
            done = True
        except trio.TooSlowError:
            await self._fail("timeout", f"no answer to {type(request).__name__} in {seconds} s")
        except (EndOfStream, OSError) as exc:
            with trio.CancelScope(shield=True):
                await self._end(graceful=True)  # it is on its way out: see how it ended
            status = None if self._process is None else self._process.popen.returncode
            reason: FailureReason = "closed" if self._closed else "crashed"
            if isinstance(request, Hello):
                reason = "start_failed"
            await self._fail(reason, f"the host went away ({exc!r}; exit status {status})")
        except (FrameError, msgspec.MsgspecError) as exc:
            await self._fail("protocol", f"unreadable reply: {exc}")
        finally:
            if not done:
                with trio.CancelScope(shield=True):
                    await self._end(graceful=False)
        if isinstance(reply, ErrorReply) and reply.id in (0, request.id):
            if reply.code == "unsupported_version":
                await self._fail("version", reply.message)
            if reply.code == "device_failed":  # the host exits: its context is dead
                await self._fail("device_failed", reply.message)
            if reply.code in ("frame_too_large", "bad_request") and reply.id == 0:
                await self._fail("protocol", f"{reply.code}: {reply.message}")
            raise LaneHostError(reply.code, reply.message)
        if not isinstance(reply, expected) or reply.id != request.id:
            await self._fail("protocol", f"{type(reply).__name__} {reply.id} for {request.id}")
        return reply

    def _pipes(self) -> HostPipes:
        process = self._process
        assert process is not None and process.pipes is not None
        return process.pipes

    # -- ending ------------------------------------------------------------

    async def _fail(self, reason: FailureReason, message: str) -> NoReturn:
        log.error("lane host for %s failed: %s: %s", self.lane_id, reason, message)
        with trio.CancelScope(shield=True):
            await self._end(graceful=False)
        raise LaneHostFailed(self.lane_id, reason, message)

    def _kill_group(self) -> None:
        if self._process is not None:
            self._process.kill_group()

    async def wait_exited(self) -> None:
        """Return once the host's process has exited, however it ended (at once if it
        never started). It neither reaps nor kills (`HostProcess.wait_exited`)."""
        if self._process is not None:
            await self._process.wait_exited()

    async def _end(self, *, graceful: bool) -> None:
        """Close our pipe ends, see the process exit (EOF first if `graceful`, then
        SIGKILL to the group), reap it. Callers shield this and hold the lock."""
        self._hello = None
        if self._process is not None:
            await self._process.end(graceful=graceful, close_timeout=self._close_timeout)


def lane_host_factory(
    command: Sequence[str] = (),
    *,
    backend: Backend = "auto",
    op_timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> Callable[[Lane], LaneHost]:
    """How the daemon makes a lane's host: `command` (empty: the built-in one), the
    lane's own device only, and the lane's VRAM as its budget (a CPU lane's is 0:
    it holds no buffers, and its tokens grant only `execute`). `backend` `auto` is
    the lane's own (`Lane.array_backend`: CuPy on a real GPU or MIG instance, NumPy
    on simulated lanes); a lane without a device always gets NumPy. `env`: more
    variables for every host (the daemon's CuPy cache folder)."""
    argv = tuple(command) or DEFAULT_COMMAND
    extra = dict(env or {})

    def make(lane: Lane) -> LaneHost:
        devices = (lane.visible_uuid,) if lane.visible_uuid else ()
        chosen: Backend = lane.array_backend if backend == "auto" else backend
        return LaneHost(
            lane.lane_id,
            lane.vram_bytes,
            visible_devices=devices,
            backend=chosen if devices else "numpy",
            command=argv,
            env=extra,
            op_timeout=op_timeout,
        )

    return make
