"""The lane owner's client for its lane host process (`lanehost`, docs/lane-host-protocol.md).

`LaneHost` starts the host with the lane's environment (its device in
`CUDA_VISIBLE_DEVICES`, none for the CPU pool), greets it, and then sends one
request at a time, each under its own deadline. The host is trusted code but
still a process that can crash, hang or garble: any of those raises
`LaneHostFailed` and the host is killed, so a `LaneHost` never stays half
alive. A request the host refuses raises `LaneHostError` with the protocol's
code; that changed nothing and the host stays in service.

The host never outlives the daemon: it leads its own process group, which
`aclose` and every failure kill, and it is started with PR_SET_PDEATHSIG =
SIGKILL, so a daemon killed with SIGKILL takes its hosts with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NoReturn, TypeVar

import msgspec
import trio

from lanehost.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Alloc,
    AllocReply,
    EndOfStream,
    ErrorReply,
    FrameError,
    FrameReader,
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
    decode_reply,
    frame,
    frame_length,
)
from machine.lanes import Lane
from supervisor.identity import drop_capabilities
from supervisor.process import DEVICE_ENV_NAMES, ENV_ALLOW_LIST
from supervisor.spawn import popen

__all__ = [
    "DEFAULT_COMMAND",
    "FailureReason",
    "LaneHost",
    "LaneHostError",
    "LaneHostFailed",
    "lane_host_factory",
]

log = logging.getLogger(__name__)

# -P: the daemon's working directory is not put on sys.path, so a planted
# lanehost/ or numpy.py there is never imported into the trusted host.
DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-P", "-m", "lanehost")

FailureReason = Literal["start_failed", "version", "crashed", "protocol", "timeout", "closed"]

_PIPE_BYTES = 1 << 20  # a bigger pipe: fewer wake-ups per megabyte moved
_REAP_SECONDS = 5.0  # after SIGKILL: how long the process may take to be gone
_PR_SET_PDEATHSIG = 1


class LaneHostFailed(Exception):
    """The host is gone or cannot be trusted any more, and has been killed."""

    def __init__(self, lane_id: str, reason: FailureReason, message: str) -> None:
        super().__init__(f"lane host {lane_id}: {reason}: {message}")
        self.lane_id = lane_id
        self.reason: FailureReason = reason
        self.message = message


class LaneHostError(Exception):
    """The host refused one request with a protocol error code; nothing changed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _libc_prctl() -> Callable[..., int] | None:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _libc_prctl()


def _die_with_parent(parent: int) -> Callable[[], None]:
    # Runs in the forked child before exec, with other threads' locks possibly
    # held: syscalls only - no imports, logging or allocation-heavy work.
    def setup() -> None:
        # Trusted, yet it needs none of the capabilities a non-root daemon holds (the
        # unit's CAP_SETUID, CAP_KILL...). Root would get them all back at exec, which
        # also clears the parent-death signal. First: a change of credentials clears it.
        if os.geteuid() != 0:
            drop_capabilities()
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the daemon died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def _widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size: the default size still works


def host_environment(
    visible_devices: Sequence[str], extra: Mapping[str, str], parent: Mapping[str, str]
) -> dict[str, str]:
    """Allow-listed daemon variables and the daemon's module path < `extra` < the
    lane's devices ("" = none)."""
    env = {name: parent[name] for name in ENV_ALLOW_LIST if name in parent}
    module_path = _absolute_entries(parent.get("PYTHONPATH", ""))
    if module_path:
        # The trusted host imports from where the daemon does (a daemon found only
        # through PYTHONPATH would start hosts that exit with "No module named").
        env["PYTHONPATH"] = module_path
    env.update(extra)
    for name in DEVICE_ENV_NAMES:
        env[name] = ",".join(visible_devices)
    return env


def _absolute_entries(path: str) -> str:
    # An empty or relative entry names the working directory, which `-P` keeps out.
    return os.pathsep.join(p for p in path.split(os.pathsep) if os.path.isabs(p))


_R = TypeVar("_R", bound=Reply)


class LaneHost:
    """One lane host process and the one conversation the owner has with it."""

    def __init__(
        self,
        lane_id: str,
        memory_bytes: int,
        *,
        visible_devices: Sequence[str] = (),
        backend: Literal["auto", "numpy", "cupy"] = "auto",
        command: Sequence[str] = DEFAULT_COMMAND,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        op_timeout: float = 30.0,
        close_timeout: float = 5.0,
    ) -> None:
        self.lane_id = lane_id
        self.memory_bytes = memory_bytes
        self._argv = [
            *command,
            "--lane-id",
            lane_id,
            "--memory-bytes",
            str(memory_bytes),
            "--backend",
            backend,
        ]
        self._env = host_environment(visible_devices, env or {}, os.environ)
        self._start_timeout = start_timeout
        self._op_timeout = op_timeout
        self._close_timeout = close_timeout
        self._lock = trio.Lock()
        self._popen: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._to_host: int | None = None
        self._from_host: int | None = None
        self._reader: FrameReader | None = None
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
        return None if self._popen is None else self._popen.pid

    @property
    def running(self) -> bool:
        return self._popen is not None and self._hello is not None

    async def __aenter__(self) -> LaneHost:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> HelloReply:
        """Start the host and greet it within `start_timeout`; LaneHostFailed if it cannot."""
        async with self._lock:
            if self._popen is not None or self._closed:
                raise RuntimeError("a LaneHost starts once")
            await self._spawn()
            hello = Hello(id=self._next_id(), version=PROTOCOL_VERSION)
            try:
                reply = await self._exchange(hello, HelloReply, self._start_timeout)
            except LaneHostError as exc:
                await self._fail("protocol", f"hello refused: {exc}")
            if reply.version != PROTOCOL_VERSION:
                await self._fail("version", f"host speaks version {reply.version}")
            if reply.memory_total != self.memory_bytes:
                await self._fail("protocol", f"host reports a budget of {reply.memory_total}")
            self._hello = reply
            log.info(
                "lane host for %s: pid %s, %s on %s",
                self.lane_id,
                self.pid,
                reply.backend,
                reply.device,
            )
            return reply

    async def _spawn(self) -> None:
        # On the daemon's fork thread, as guests are (supervisor/spawn.py):
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends,
        # and that thread lives as long as the daemon.
        child_in, to_host = os.pipe()
        from_host, child_out = os.pipe()
        try:
            self._popen = await popen(
                self._argv,
                stdin=child_in,
                stdout=child_out,
                env=self._env,
                start_new_session=True,  # its own process group, away from terminal signals
                preexec_fn=_die_with_parent(os.getpid()),
            )
        except BaseException as exc:
            os.close(to_host)
            os.close(from_host)
            self._closed = True
            if isinstance(exc, (OSError, subprocess.SubprocessError)):
                raise LaneHostFailed(self.lane_id, "start_failed", repr(exc)) from exc
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        for fd in (to_host, from_host):
            _widen_pipe(fd)
            os.set_blocking(fd, False)
        self._to_host, self._from_host = to_host, from_host
        self._reader = FrameReader(from_host)
        try:
            self._pidfd = os.pidfd_open(self._popen.pid)
        except OSError:
            self._pidfd = None  # old kernel: exits are polled

    async def aclose(self) -> None:
        """End the host: EOF first, SIGKILL to its group after `close_timeout`. Shielded."""
        with trio.CancelScope(shield=True):
            self._closed = True
            if self._lock.locked():
                self._kill_group()  # a request in flight ends with "closed" at once
            with trio.move_on_after(self._close_timeout + _REAP_SECONDS + 1):
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
        try:
            parts = frame(request)
        except FrameError as exc:
            raise LaneHostError("bad_args", str(exc)) from None  # never sent: nothing changed
        done = False
        try:
            # A bare scope rather than fail_after, whose context-manager layers
            # cost a fifth of a noop's round trip.
            with trio.CancelScope(deadline=trio.current_time() + seconds) as scope:
                for data in parts:
                    await self._send(data)
                reply = await self._receive()
            if scope.cancelled_caught:
                raise trio.TooSlowError
            done = True
        except trio.TooSlowError:
            await self._fail("timeout", f"no answer to {type(request).__name__} in {seconds} s")
        except (EndOfStream, OSError) as exc:
            with trio.CancelScope(shield=True):
                await self._end(graceful=True)  # it is on its way out: see how it ended
            status = None if self._popen is None else self._popen.returncode
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
            if reply.code in ("frame_too_large", "bad_request") and reply.id == 0:
                await self._fail("protocol", f"{reply.code}: {reply.message}")
            raise LaneHostError(reply.code, reply.message)
        if not isinstance(reply, expected) or reply.id != request.id:
            await self._fail("protocol", f"{type(reply).__name__} {reply.id} for {request.id}")
        return reply

    async def _send(self, data: bytes | memoryview) -> None:
        """Write it all; a pipe with room takes a small frame in one write, no wait."""
        fd = self._to_host
        assert fd is not None
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)

    async def _read_exact(self, n: int) -> bytearray | memoryview:
        reader = self._reader
        assert reader is not None
        out, got = reader.start(n)
        while got < n:
            try:
                got = reader.read_into(out, got)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(reader.fd)
        return out

    async def _receive(self) -> Reply:
        reader = self._reader
        assert reader is not None
        # The reply cannot be here before the host has read the request: wait
        # first (this is the exchange's scheduling checkpoint), then read.
        if reader.pending:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await trio.lowlevel.wait_readable(reader.fd)
        length = frame_length(bytes(await self._read_exact(HEADER.size)))
        return decode_reply(await self._read_exact(length))

    # -- ending ------------------------------------------------------------

    async def _fail(self, reason: FailureReason, message: str) -> NoReturn:
        log.error("lane host for %s failed: %s: %s", self.lane_id, reason, message)
        with trio.CancelScope(shield=True):
            await self._end(graceful=False)
        raise LaneHostFailed(self.lane_id, reason, message)

    def _kill_group(self) -> None:
        # Only while the leader is unreaped: its pid, the group id, cannot be reused.
        if self._popen is not None and self._popen.returncode is None:
            try:
                os.killpg(self._popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def wait_exited(self) -> None:
        """Return once the host's process has exited, however it ended (at once if it
        never started). It neither reaps nor kills: a watcher beside the conversation,
        waiting on its own copy of the pidfd, which `_end` may close meanwhile."""
        popen = self._popen
        if popen is None or popen.returncode is not None:
            return
        if self._pidfd is None:
            with contextlib.suppress(ChildProcessError):  # reaped meanwhile: gone
                await trio.to_thread.run_sync(
                    os.waitid,
                    os.P_PID,
                    popen.pid,
                    os.WEXITED | os.WNOWAIT,
                    abandon_on_cancel=True,
                )
            return
        fd = os.dup(self._pidfd)
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)

    async def _wait_exit(self) -> None:
        if self._popen is None:
            return
        if self._pidfd is not None:
            await trio.lowlevel.wait_readable(self._pidfd)
            return
        pid = self._popen.pid  # no pidfd (an old kernel): wait in a thread, without reaping
        await trio.to_thread.run_sync(
            os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT, abandon_on_cancel=True
        )

    async def _end(self, *, graceful: bool) -> None:
        """Close our pipe ends, see the process exit (EOF first if `graceful`, then
        SIGKILL to the group), reap it. Callers shield this and hold the lock."""
        self._hello = None
        for fd in (self._to_host, self._from_host):
            if fd is not None:
                os.close(fd)
        self._to_host = self._from_host = None
        self._reader = None
        popen = self._popen
        if popen is None or popen.returncode is not None:
            return
        if graceful:  # the host exits on EOF, which closing our end just sent
            with trio.move_on_after(self._close_timeout):
                await self._wait_exit()
        self._kill_group()  # also any process the host left in its group
        with trio.move_on_after(_REAP_SECONDS):
            await self._wait_exit()
        try:
            popen.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            log.error("lane host %s (pid %d) survived SIGKILL", self.lane_id, popen.pid)
            return
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


Backend = Literal["auto", "numpy", "cupy"]


def lane_host_factory(
    command: Sequence[str] = (), *, backend: Backend = "auto", op_timeout: float = 30.0
) -> Callable[[Lane], LaneHost]:
    """How the daemon makes a lane's host: `command` (empty: the built-in one), the
    lane's own device only, and the lane's VRAM as its budget (a CPU lane's is 0:
    it holds no buffers, and its tokens grant only `execute`)."""
    argv = tuple(command) or DEFAULT_COMMAND

    def make(lane: Lane) -> LaneHost:
        devices = (lane.visible_uuid,) if lane.visible_uuid else ()
        return LaneHost(
            lane.lane_id,
            lane.vram_bytes,
            visible_devices=devices,
            backend=backend,
            command=argv,
            op_timeout=op_timeout,
        )

    return make
