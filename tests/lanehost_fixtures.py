"""A real lane host subprocess behind the owner's client, and fake hosts that misbehave."""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
import trio

from supervisor.lane_host import LaneHost

BUDGET = 1 << 20  # the lane's VRAM budget in these tests: 1 MiB
# On CUDA a host holds its own context out of its budget (some hundreds of MiB,
# measured at its start): a CUDA test host gets this much more, and the tests
# count in `usable(host)`, what its buffers may take.
CUDA_SLACK = 2 << 30


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting for a parent to reap it)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


async def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    with trio.move_on_after(seconds):
        while not process_gone(pid):  # noqa: ASYNC110 - /proc is polled, nothing signals
            await trio.sleep(0.02)
    return process_gone(pid)


@pytest.fixture
async def host() -> AsyncIterator[LaneHost]:
    async with LaneHost("lane_test", BUDGET, backend="numpy", op_timeout=10.0) as started:
        yield started


@functools.cache
def cuda_device() -> tuple[str | None, str]:
    """(the UUID of the first device CUDA can use, or None; why there is none).

    CUDA_VISIBLE_DEVICES naming one GPU or MIG UUID is that device. Otherwise the
    first GPU NVML lists, or, on a GPU in MIG mode, its first MIG instance: a
    MIG-enabled parent is no device CUDA can use."""
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None, "needs CuPy (pip install 'litegraph-node[cuda]'); it is not installed"
    named = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "needs a CUDA GPU; CuPy sees none"
        if named.startswith(("GPU-", "MIG-")) and "," not in named:
            return named, ""
        import pynvml

        pynvml.nvmlInit()
        return _first_cuda_uuid(pynvml), ""
    except Exception as exc:
        return None, f"needs a CUDA GPU; CuPy or NVML cannot open one: {exc!r}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_cuda_uuid(pynvml: Any) -> str:
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:
            mig = False  # NotSupported: a GPU without MIG
        if not mig:
            return _text(pynvml.nvmlDeviceGetUUID(handle))
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:
                continue  # an empty slot
            return _text(pynvml.nvmlDeviceGetUUID(instance))
    raise LookupError("NVML lists no GPU or MIG instance that CUDA can use")


def _cupy_skip() -> pytest.MarkDecorator:
    uuid, reason = cuda_device()
    return pytest.mark.skipif(uuid is None, reason=reason)


@pytest.fixture(
    params=[
        "numpy",
        pytest.param("cupy", marks=[pytest.mark.cuda, _cupy_skip()]),
    ]
)
def device_backend(request: pytest.FixtureRequest) -> str:
    """The lane host backends a kernel test runs on: NumPy, and CuPy on a GPU."""
    return str(request.param)


@pytest.fixture
async def device_host(device_backend: str) -> AsyncIterator[LaneHost]:
    """A real host on `device_backend`: on CuPy, a CUDA lane of the first GPU."""
    uuid, _ = cuda_device()
    devices = [uuid] if device_backend == "cupy" and uuid is not None else []
    backend: Literal["numpy", "cupy"] = "cupy" if device_backend == "cupy" else "numpy"
    budget = BUDGET + (CUDA_SLACK if backend == "cupy" else 0)
    async with LaneHost(
        "lane_test", budget, backend=backend, visible_devices=devices, op_timeout=10.0
    ) as started:
        yield started


def usable(host: LaneHost) -> int:
    """What a started host's buffers may take: its budget less what it holds for
    itself (its CUDA context; nothing on NumPy). BUDGET on NumPy."""
    return host.hello.memory_total - host.hello.memory_reserved


def block(host: LaneHost) -> int:
    """The unit an array costs the budget in: CuPy's pool blocks of 512 bytes."""
    return 512 if host.hello.backend == "cupy" else 1


def charged(host: LaneHost, nbytes: int) -> int:
    unit = block(host)
    return -(-nbytes // unit) * unit


def fake_host(tmp_path: pathlib.Path, body: str) -> list[str]:
    """The command of a host that runs `body` (with `sys`, `os`, `time` and the
    protocol module imported as `p`) instead of serving the protocol."""
    script = tmp_path / "fake_host.py"
    script.write_text(
        "import os, sys, time\nimport lanehost.protocol as p\n" + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


HELLO_THEN = """
def read_frame():
    n = p.frame_length(os.read(0, 4))
    data = b""
    while len(data) < n:
        data += os.read(0, n - len(data))
    return p.decode_request(data)

def send(reply):
    header, payload = p.encode(reply)
    os.write(1, header + payload)

hello = read_frame()
send(p.HelloReply(id=hello.id, version=p.PROTOCOL_VERSION, backend="numpy",
                  device="host", memory_total=int(sys.argv[sys.argv.index("--memory-bytes") + 1]),
                  kernels=["noop"]))
request = read_frame()
"""

__all__ = [
    "BUDGET",
    "CUDA_SLACK",
    "HELLO_THEN",
    "block",
    "charged",
    "fake_host",
    "host",
    "process_gone",
    "usable",
    "wait_gone",
]
