"""The lane host's CUDA path against a fake CuPy (tests/fakes/fake_cupy.py): no GPU.

What is checked is the host's own logic, which real hardware would only make
slower to see: a device lane never falls back to NumPy; the host proves its CUDA
libraries work before it serves; its pool is limited to the lane's budget less
the context it measured (and reported); freed blocks go back to the device;
temporaries are counted, so a kernel never takes the pool past the budget; and a
sticky error, in whichever request, ends the host with `device_failed`.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

from lanehost.backend import Backend, BackendUnavailable, cupy_backend, select_backend
from lanehost.host import EXIT_BACKEND_UNAVAILABLE, EXIT_DEVICE_FAILED, refuse, serve
from lanehost.kernels import Kernel, load_kernels
from lanehost.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Alloc,
    ErrorReply,
    Free,
    FreeAll,
    Hello,
    HelloReply,
    Read,
    ReadReply,
    Reply,
    Request,
    Run,
    RunReply,
    Stats,
    StatsReply,
    Write,
    WriteReply,
    decode_reply,
    encode,
)
from lanehost.state import LaneState
from tests.fakes.fake_cupy import FakeCupy

MiB = 1 << 20
CONTEXT = 4 * MiB
BUDGET = 16 * MiB  # the lane's budget: 12 MiB are left for buffers and temporaries


def backend_on(fake: FakeCupy) -> Backend:
    return cupy_backend(fake, "GPU-fake", device_used=fake.nvml_used)


def greeted(fake: FakeCupy, budget: int = BUDGET) -> LaneState:
    state = LaneState(backend_on(fake), budget, load_kernels())
    reply = state.handle(Hello(id=1, version=PROTOCOL_VERSION))
    assert isinstance(reply, HelloReply)
    return state


def ok(state: LaneState, request: Request) -> Reply:
    reply = state.handle(request)
    assert not isinstance(reply, ErrorReply), reply
    return reply


def refused(state: LaneState, request: Request, code: str) -> ErrorReply:
    reply = state.handle(request)
    assert isinstance(reply, ErrorReply) and reply.code == code, reply
    return reply


def alloc(state: LaneState, buffer_id: str, nbytes: int, dtype: str = "uint8") -> None:
    itemsize = np.dtype(dtype).itemsize
    ok(state, Alloc(id=2, buffer_id=buffer_id, dtype=dtype, shape=(nbytes // itemsize,)))  # type: ignore[arg-type]


def stats(state: LaneState) -> StatsReply:
    reply = ok(state, Stats(id=9))
    assert isinstance(reply, StatsReply)
    return reply


# -- choosing the backend: never NumPy for a device ----------------------------------


def test_auto_with_a_device_named_never_falls_back_to_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`auto` used to fall back to host memory with a warning when CuPy could not
    run: a GPU lane then computed on the CPU with the GPU's whole VRAM as its
    budget. Now a device named means CuPy or BackendUnavailable; only no device
    at all means NumPy."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    for name in ("auto", "cupy"):
        with pytest.raises(BackendUnavailable, match="CuPy does not import"):
            select_backend(name)  # type: ignore[arg-type]
    assert select_backend("numpy").name == "numpy"  # only when asked for by name
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert select_backend("auto").name == "numpy"


@pytest.mark.parametrize(
    ("fake", "why"),
    [
        (FakeCupy(missing={"nvrtc"}), "elementwise kernel (NVRTC"),
        (FakeCupy(missing={"cublas"}), "matmul (cuBLAS)"),
        (FakeCupy(devices=0), "CUDA sees 0"),
        (FakeCupy(devices=2), "CUDA sees 2"),
        (FakeCupy(fail_on={"synchronize"}), "reduction"),
    ],
    ids=["no-nvrtc", "no-cublas", "no-device", "two-devices", "dead-device"],
)
def test_cupy_that_cannot_run_the_kernels_is_unavailable_with_the_reason(
    fake: FakeCupy, why: str
) -> None:
    """cupy-cuda12x without its CUDA libraries imports and counts the device on a
    driver-only host, then fails every kernel: the host finds that out before it
    serves, and says which library is missing."""
    with pytest.raises(BackendUnavailable, match=re.escape(why)):
        backend_on(fake)


def test_a_host_that_cannot_run_cuda_answers_its_hello_cuda_unavailable() -> None:
    """Refused at the hello, typed, with the reason: the owner needs no exit status
    or stderr to know why."""
    to_host, from_owner = os.pipe()
    to_owner, from_host = os.pipe()
    os.write(from_owner, b"".join(encode(Hello(id=1, version=PROTOCOL_VERSION))))
    os.close(from_owner)
    status = refuse(to_host, from_host, "cuda_unavailable", "CuPy does not import: no cupy")
    os.close(from_host)
    reply = decode_reply(os.read(to_owner, 1 << 16)[HEADER.size :])
    os.close(to_host)
    os.close(to_owner)
    assert status == EXIT_BACKEND_UNAVAILABLE
    assert isinstance(reply, ErrorReply)
    assert (reply.id, reply.code, reply.message) == (
        1,
        "cuda_unavailable",
        "CuPy does not import: no cupy",
    )


# -- honest VRAM ------------------------------------------------------------------------


def test_the_context_is_measured_reserved_reported_and_the_pool_limited_to_the_rest() -> None:
    fake = FakeCupy(context_bytes=CONTEXT)
    state = LaneState(backend_on(fake), BUDGET, load_kernels())
    hello = state.handle(Hello(id=1, version=PROTOCOL_VERSION))
    assert isinstance(hello, HelloReply)
    assert (hello.backend, hello.memory_total, hello.memory_reserved) == ("cupy", BUDGET, CONTEXT)
    assert "NVIDIA Fake H200 (GPU-fake)" == hello.device
    assert fake.pool.limits == [BUDGET - CONTEXT]  # buffers and temporaries together
    first = stats(state)
    assert (first.total, first.reserved, first.free, first.used) == (
        BUDGET,
        CONTEXT,
        BUDGET - CONTEXT,
        0,
    )
    # The budget's rest fits exactly; a byte more is refused before the device is asked.
    alloc(state, "a", BUDGET - CONTEXT)
    error = refused(state, Alloc(id=3, buffer_id="b", dtype="uint8", shape=(1,)), "out_of_memory")
    assert "reserved by the host" in error.message
    assert fake.pool.peak <= fake.pool.limit


def test_freed_buffers_are_given_back_to_the_device_at_once() -> None:
    """CuPy's pool keeps freed blocks: NVML's used memory stayed at the high-water
    mark, and a guest given the rest of the GPU found it held."""
    fake = FakeCupy(context_bytes=CONTEXT)
    state = greeted(fake)
    idle = fake.nvml_used()
    assert idle == CONTEXT
    alloc(state, "a", 4 * MiB)
    alloc(state, "b", 2 * MiB)
    assert fake.nvml_used() == CONTEXT + 6 * MiB
    ok(state, Free(id=4, buffer_id="a"))
    assert fake.pool.total_bytes() == fake.pool.used_bytes() == 2 * MiB
    ok(state, FreeAll(id=5, buffer_ids=["b", "nothing"]))
    assert fake.nvml_used() == idle
    assert stats(state).used == 0


def test_an_axpy_at_the_edge_of_the_budget_is_refused_not_over_allocated() -> None:
    """axpy computes alpha * x, a temporary of x's size: with x and y filling the
    budget it would take the device past it. It is refused `out_of_memory` and
    changes nothing; with room for the temporary it runs, and the temporary's
    block goes back to the device."""
    fake = FakeCupy(context_bytes=CONTEXT)
    state = greeted(fake)
    usable = BUDGET - CONTEXT
    alloc(state, "x", usable // 2, "float32")
    alloc(state, "y", usable // 2, "float32")
    ok(state, Run(id=6, kernel="fill", args={"value": 1.0}, buffers={"out": "x"}))
    axpy = Run(id=7, kernel="axpy", args={"alpha": 2.0}, buffers={"x": "x", "y": "y"})
    error = refused(state, axpy, "out_of_memory")
    assert "temporaries" in error.message
    assert fake.pool.peak <= fake.pool.limit
    y = ok(state, Read(id=8, buffer_id="y", offset=0, length=16))
    assert isinstance(y, ReadReply) and bytes(y.data) == bytes(16)  # untouched

    roomy = greeted(FakeCupy(context_bytes=CONTEXT))
    alloc(roomy, "x", usable // 4, "float32")
    alloc(roomy, "y", usable // 4, "float32")
    ok(roomy, Run(id=6, kernel="fill", args={"value": 1.0}, buffers={"out": "x"}))
    assert isinstance(ok(roomy, axpy), RunReply)
    got = ok(roomy, Read(id=8, buffer_id="y", offset=0, length=8))
    assert isinstance(got, ReadReply)
    assert np.frombuffer(got.data, dtype=np.float32).tolist() == [2.0, 2.0]
    pool = roomy._backend.pool
    assert pool.total_bytes() == pool.used_bytes() == usable // 2  # the temporary is back


def test_a_kernel_past_the_pools_limit_is_out_of_memory_not_kernel_failed() -> None:
    """A kernel whose temporaries were not declared still cannot pass the budget:
    the pool's limit refuses, and the run is `out_of_memory`."""
    fake = FakeCupy(context_bytes=CONTEXT)
    kernels = load_kernels()
    kernels["sneaky"] = Kernel(
        "sneaky", lambda xp, args, buffers: {"n": int(xp.zeros((BUDGET,), xp.uint8).size)}
    )
    state = LaneState(backend_on(fake), BUDGET, kernels)
    ok(state, Hello(id=1, version=PROTOCOL_VERSION))
    refused(state, Run(id=2, kernel="sneaky"), "out_of_memory")
    assert fake.pool.peak <= fake.pool.limit
    assert state.failed is None


def test_a_write_makes_no_device_copy_of_its_chunk() -> None:
    """A write copied its chunk (up to 64 MiB) to the device before storing it: past
    the budget on a full lane. Now the bytes go straight into the buffer."""
    fake = FakeCupy(context_bytes=CONTEXT)
    state = greeted(fake)
    alloc(state, "full", BUDGET - CONTEXT)
    data = bytes(range(256)) * 16
    assert isinstance(
        ok(state, Write(id=3, buffer_id="full", offset=100, data=memoryview(data))), WriteReply
    )
    assert fake.pool.peak == BUDGET - CONTEXT
    back = ok(state, Read(id=4, buffer_id="full", offset=100, length=len(data)))
    assert isinstance(back, ReadReply) and bytes(back.data) == data


# -- a sticky error ends the host, whichever request met it -----------------------------


# The fake's device call each request's failure is injected into.
FAILING_CALL = {"run": "fill", "alloc": "zeros", "write": "set", "read": "asnumpy"}


def _sticky(op: str) -> tuple[LaneState, Request]:
    fake = FakeCupy(context_bytes=CONTEXT)
    state = greeted(fake)
    alloc(state, "a", 1024, "float32")
    fake.fail_on = {FAILING_CALL[op]}
    requests: dict[str, Request] = {
        "run": Run(id=10, kernel="fill", args={"value": 3.0}, buffers={"out": "a"}),
        "alloc": Alloc(id=10, buffer_id="b", dtype="uint8", shape=(8,)),
        "write": Write(id=10, buffer_id="a", offset=0, data=memoryview(b"1234")),
        "read": Read(id=10, buffer_id="a", offset=0, length=4),
    }
    return state, requests[op]


@pytest.mark.parametrize("op", ["run", "alloc", "write", "read"])
def test_a_sticky_device_error_is_device_failed_in_every_request(op: str) -> None:
    """A sticky error in `_run` was `kernel_failed` and the host served on with a
    dead context (every later run failed); in alloc, write and read it crashed the
    host. Now it is the same everywhere: that request answers `device_failed`,
    and the host is done."""
    state, request = _sticky(op)
    error = refused(state, request, "device_failed")
    assert error.id == 10 and "context is lost" in error.message
    assert state.failed is not None
    refused(state, Stats(id=11), "device_failed")  # nothing more is served


def test_the_host_exits_after_a_device_failure_so_its_owner_starts_a_fresh_one() -> None:
    state, request = _sticky("run")
    to_host, from_owner = os.pipe()
    to_owner, from_host = os.pipe()
    for message in (request, Stats(id=11)):
        os.write(from_owner, b"".join(encode(message)))
    os.close(from_owner)
    status = serve(to_host, from_host, state)
    os.close(from_host)
    answered = os.read(to_owner, 1 << 16)
    os.close(to_host)
    os.close(to_owner)
    assert status == EXIT_DEVICE_FAILED
    reply = decode_reply(answered[HEADER.size :])
    assert isinstance(reply, ErrorReply) and reply.code == "device_failed"
    # Exactly one reply: the stats behind it was never read.
    assert len(answered) == HEADER.size + HEADER.unpack(answered[: HEADER.size])[0]


def test_numpy_lanes_have_no_reserve_and_no_pool() -> None:
    state = LaneState(select_backend("numpy"), BUDGET, load_kernels())
    hello = state.handle(Hello(id=1, version=PROTOCOL_VERSION))
    assert isinstance(hello, HelloReply)
    assert (hello.backend, hello.device, hello.memory_reserved) == ("numpy", "host", 0)
    assert stats(state).free == BUDGET
