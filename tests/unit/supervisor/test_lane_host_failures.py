"""A lane host that crashes, hangs, garbles or speaks another version is killed, and
the owner gets `LaneHostFailed`; the host never outlives the daemon."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import pytest
import trio

from lanehost.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    decode_reply,
    encode,
    frame_length,
)
from supervisor.lane_host import LaneHost, LaneHostError, LaneHostFailed, host_environment
from supervisor.spawn import spawn
from tests.lanehost_fixtures import BUDGET, HELLO_THEN, fake_host, host, process_gone, wait_gone

__all__ = ["host"]


async def fails_while_stuck(host: LaneHost, meanwhile: Callable[[], Awaitable[object]]) -> str:
    """Stop the host, send a request, run `meanwhile` once it is in flight; the
    request's failure reason."""
    assert host.pid is not None
    os.kill(host.pid, signal.SIGSTOP)  # so the request is surely in flight
    failure: list[LaneHostFailed] = []

    async def request() -> None:
        with pytest.raises(LaneHostFailed) as caught:
            await host.run("noop", seconds=30)
        failure.append(caught.value)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await trio.sleep(0.2)
            await meanwhile()
    return failure[0].reason


async def test_a_host_killed_mid_request_fails_the_request(host: LaneHost) -> None:
    pid = host.pid
    assert pid is not None

    async def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    assert await fails_while_stuck(host, kill) == "crashed"
    assert process_gone(pid)
    with pytest.raises(LaneHostFailed) as again:
        await host.stats()
    assert again.value.reason == "crashed"


async def test_a_hung_host_times_out_and_is_gone(host: LaneHost) -> None:
    pid = host.pid
    assert pid is not None
    await host.alloc("a", "float32", (4,))
    os.kill(pid, signal.SIGSTOP)
    with trio.fail_after(5):
        with pytest.raises(LaneHostFailed) as caught:
            await host.read("a", 0, 16, seconds=0.3)
    assert caught.value.reason == "timeout"
    assert process_gone(pid)
    assert not host.running


async def test_a_cancelled_request_kills_the_host(host: LaneHost) -> None:
    pid = host.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    with trio.move_on_after(0.2):
        await host.run("noop")
    assert process_gone(pid)  # half a conversation cannot be resumed
    with pytest.raises(LaneHostFailed):
        await host.run("noop")


async def test_aclose_ends_the_host_and_later_calls_fail_closed() -> None:
    lane = LaneHost("lane_test", BUDGET, backend="numpy")
    await lane.start()
    pid = lane.pid
    assert pid is not None
    await lane.aclose()
    assert process_gone(pid)
    with pytest.raises(LaneHostFailed) as caught:
        await lane.stats()
    assert caught.value.reason == "closed"


async def test_aclose_kills_a_host_stuck_in_a_request(host: LaneHost) -> None:
    pid = host.pid
    assert pid is not None
    assert await fails_while_stuck(host, host.aclose) == "closed"
    assert process_gone(pid)


async def test_a_host_that_never_answers_hello_fails_start(tmp_path: pathlib.Path) -> None:
    lane = LaneHost(
        "lane_test", BUDGET, command=fake_host(tmp_path, "time.sleep(60)"), start_timeout=0.5
    )
    with trio.fail_after(5), pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "timeout"
    assert lane.pid is not None and process_gone(lane.pid)


async def test_a_host_that_exits_at_start_fails_start(tmp_path: pathlib.Path) -> None:
    lane = LaneHost("lane_test", BUDGET, command=fake_host(tmp_path, "sys.exit(3)"))
    with pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "start_failed"
    assert "exit status 3" in str(caught.value)


async def test_a_missing_host_command_fails_start(tmp_path: pathlib.Path) -> None:
    lane = LaneHost("lane_test", BUDGET, command=[str(tmp_path / "no-such-host")])
    with pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "start_failed"


@pytest.mark.parametrize("backend", ["cupy", "auto"])
async def test_a_device_lanes_host_without_cuda_fails_start_cuda_unavailable(
    backend: Literal["cupy", "auto"],
) -> None:
    """A host given a device never serves it from host memory: without CuPy (or a
    GPU) it refuses its hello with the reason, typed, whether asked for CuPy or
    `auto`, and exits."""
    lane = LaneHost("lane_test", BUDGET, backend=backend, visible_devices=["GPU-none"])
    assert lane.backend == "cupy"
    with pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "cuda_unavailable"
    assert "CuPy does not import" in caught.value.message or "CUDA" in caught.value.message
    assert lane.pid is not None and await wait_gone(lane.pid)


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0])
async def test_a_host_of_another_version_is_refused(tmp_path: pathlib.Path, version: int) -> None:
    body = HELLO_THEN.replace("version=p.PROTOCOL_VERSION", f"version={version}")
    lane = LaneHost("lane_test", BUDGET, command=fake_host(tmp_path, body))
    with pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "version"
    assert lane.pid is not None and await wait_gone(lane.pid)


def test_the_host_refuses_an_owner_of_another_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lanehost", "--lane-id", "x", "--memory-bytes", "16"],
        input=b"".join(encode(Hello(id=1, version=PROTOCOL_VERSION + 1))),
        capture_output=True,
        timeout=30,
        check=True,
    )
    reply = decode_reply(proc.stdout[HEADER.size :])
    assert isinstance(reply, ErrorReply) and reply.code == "unsupported_version"


@pytest.mark.parametrize(
    "garbage",
    [
        "os.write(1, (2**32 - 1).to_bytes(4, 'big'))",  # a length far over the bound
        f"os.write(1, ({MAX_FRAME_BYTES} + 1).to_bytes(4, 'big'))",
        "os.write(1, (3).to_bytes(4, 'big') + b'abc')",  # not msgpack
        "send(p.StatsReply(id=99, used=0, free=0, total=0, buffers=0))",  # another id
        "send(p.StatsReply(id=request.id, used=0, free=0, total=0, buffers=0))",  # wrong type
    ],
)
async def test_a_garbled_reply_kills_the_host(tmp_path: pathlib.Path, garbage: str) -> None:
    body = HELLO_THEN + garbage + "\ntime.sleep(60)\n"
    lane = LaneHost("lane_test", BUDGET, command=fake_host(tmp_path, body))
    await lane.start()
    with trio.fail_after(5), pytest.raises(LaneHostFailed) as caught:
        await lane.run("noop")
    assert caught.value.reason == "protocol"
    assert lane.pid is not None and process_gone(lane.pid)


@pytest.mark.parametrize(
    "args",
    [{"x": 2**70}, {"x": -(2**64)}, {"x": object()}, {"x": 1j}, {("a",): 1}],
    ids=["2**70", "-2**64", "an object", "a complex", "a tuple key"],
)
async def test_a_request_that_cannot_be_encoded_is_refused_and_the_host_serves_on(
    host: LaneHost, args: dict[Any, Any]
) -> None:
    """msgpack refusing a value while the request is framed is that request's
    `bad_args`: nothing was sent, so the host is neither killed nor out of step."""
    pid = host.pid
    await host.alloc("a", "uint8", (4,))
    with pytest.raises(LaneHostError) as refused:
        await host.run("noop", args)
    assert refused.value.code == "bad_args"
    assert host.running and host.pid == pid and not process_gone(pid or 0)
    assert await host.run("noop") == {}
    assert (await host.stats()).buffers == 1


def test_the_host_refuses_an_oversized_frame_without_reading_it() -> None:
    header = HEADER.pack(MAX_FRAME_BYTES + 1)
    proc = subprocess.run(
        [sys.executable, "-m", "lanehost", "--lane-id", "x", "--memory-bytes", "16"],
        input=b"".join(encode(Hello(id=1, version=PROTOCOL_VERSION))) + header + b"x" * 100,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    out = proc.stdout
    first = frame_length(out[: HEADER.size])
    assert isinstance(decode_reply(out[HEADER.size : HEADER.size + first]), HelloReply)
    second = out[HEADER.size + first :]
    reply = decode_reply(second[HEADER.size :])
    assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == (0, "frame_too_large")


def test_the_host_answers_undecodable_frames_and_stays_in_step() -> None:
    frames = [
        encode(Hello(id=1, version=PROTOCOL_VERSION)),
        (HEADER.pack(3), b"\xc1\xc1\xc1"),  # not msgpack
        (HEADER.pack(2), b"\x81\xa0"),  # msgpack, not a request
    ]
    stats = msgspec.msgpack.encode({"op": "stats", "id": 4})
    frames.append((HEADER.pack(len(stats)), stats))
    proc = subprocess.run(
        [sys.executable, "-m", "lanehost", "--lane-id", "x", "--memory-bytes", "16"],
        input=b"".join(h + p for h, p in frames),
        capture_output=True,
        timeout=30,
        check=True,
    )
    replies, out = [], proc.stdout
    while out:
        n = frame_length(out[: HEADER.size])
        replies.append(decode_reply(out[HEADER.size : HEADER.size + n]))
        out = out[HEADER.size + n :]
    assert [type(r).__name__ for r in replies] == [
        "HelloReply",
        "ErrorReply",
        "ErrorReply",
        "StatsReply",
    ]
    assert [(r.id, r.code) for r in replies[1:3] if isinstance(r, ErrorReply)] == [
        (0, "bad_request"),
        (0, "bad_request"),
    ]


def test_the_host_environment_names_only_the_lanes_devices() -> None:
    parent = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "GPU-all", "SECRET": "x"}
    gpu = host_environment(["MIG-1234"], {}, parent)
    assert gpu == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "MIG-1234",
        "NVIDIA_VISIBLE_DEVICES": "MIG-1234",
    }
    cpu = host_environment([], {"CUDA_VISIBLE_DEVICES": "GPU-all"}, parent)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" == cpu["NVIDIA_VISIBLE_DEVICES"]


NAP_KERNEL = """
import time
from lanehost.kernels import Kernel

nap = Kernel("nap", lambda xp, args, buffers: time.sleep(60) or {})
"""

PARENT = """
import sys, trio
from supervisor.lane_host import LaneHost

async def main():
    lane = LaneHost("lane_test", 16, backend="numpy", env={"PYTHONPATH": sys.argv[1]})
    await lane.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane.run, "nap")
        await trio.sleep(0.3)  # the host is inside the kernel, not reading its stdin
        print(lane.pid, flush=True)

trio.run(main)
"""


def test_a_sigkilled_daemon_takes_its_busy_host_with_it(tmp_path: pathlib.Path) -> None:
    # Busy in a kernel, the host does not see its stdin close: only
    # PR_SET_PDEATHSIG can end it.
    (tmp_path / "nap_kernel.py").write_text(textwrap.dedent(NAP_KERNEL))
    info = tmp_path / "nap_kernel-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nap-kernel\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[litegraph.kernels]\nnap = nap_kernel:nap\n")
    parent_script = tmp_path / "daemon.py"
    parent_script.write_text(textwrap.dedent(PARENT))
    with subprocess.Popen(
        [sys.executable, str(parent_script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            host_pid = int(parent.stdout.readline())
            assert not process_gone(host_pid)
            parent.kill()
            parent.wait(timeout=10)
            assert trio.run(wait_gone, host_pid)
        finally:
            parent.kill()


async def test_modules_planted_in_the_working_directory_are_not_imported(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "planted-code-ran"
    planted = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    (tmp_path / "lanehost").mkdir()
    (tmp_path / "lanehost" / "__init__.py").write_text(planted)
    (tmp_path / "lanehost" / "__main__.py").write_text(planted)
    (tmp_path / "numpy.py").write_text(planted)
    monkeypatch.chdir(tmp_path)
    async with LaneHost("lane_test", BUDGET, backend="numpy") as lane:
        assert lane.hello.backend == "numpy"
        assert await lane.run("noop") == {}
    assert not marker.exists()


async def test_hosts_and_guests_are_forked_from_the_one_long_lived_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PR_SET_PDEATHSIG follows the forking thread: a worker thread that exits
    # when idle would take the host with it. Hosts and guests share the
    # daemon's fork thread, which never ends while the daemon runs.
    threads: list[threading.Thread] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        threads.append(threading.current_thread())
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    async with LaneHost("lane_test", BUDGET, backend="numpy"):
        pass
    child = await spawn(["true"], stdin=subprocess.DEVNULL, env={}, cwd=None, preexec_fn=None)
    assert await child.wait() == 0
    await child.aclose()
    host_thread, guest_thread = threads
    assert host_thread is guest_thread and host_thread.name == "litegraph-fork"
    assert host_thread is not threading.current_thread() and host_thread.is_alive()
