"""The lane host over its pipes: handshake, budget, bytes in and out, kernels vs NumPy.

Every test talks to a real `python -m lanehost` subprocess through the owner's
client, `supervisor.lane_host.LaneHost`, once per backend: NumPy everywhere,
and CuPy on a CUDA lane where CuPy and a GPU are present (marked `cuda`,
skipped with the reason elsewhere).
"""

from __future__ import annotations

import numpy as np
import pytest

from lanehost.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from supervisor.lane_host import LaneHost, LaneHostError
from tests.lanehost_fixtures import (
    BUDGET,
    block,
    charged,
    cuda_device,
    device_backend,
    device_host,
    usable,
)

__all__ = ["device_backend", "device_host"]


@pytest.fixture
async def host(device_host: LaneHost) -> LaneHost:
    """Every test here runs on each backend."""
    return device_host


RNG = np.random.default_rng(7)


async def put(h: LaneHost, name: str, array: np.ndarray) -> None:
    await h.alloc(name, str(array.dtype), array.shape)
    await h.write(name, 0, array.tobytes())


async def get(h: LaneHost, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(await h.read(name, 0, nbytes), dtype=dtype).reshape(shape)


async def refused(code: str, call: object) -> LaneHostError:
    with pytest.raises(LaneHostError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code == code, caught.value
    return caught.value


async def test_handshake_names_version_backend_budget_and_kernels(
    host: LaneHost, device_backend: str
) -> None:
    hello = host.hello
    assert hello.version == PROTOCOL_VERSION == 1
    assert hello.backend == device_backend
    if device_backend == "numpy":
        assert (hello.device, hello.memory_total, hello.memory_reserved) == ("host", BUDGET, 0)
    else:
        assert str(cuda_device()[0]) in hello.device
        assert hello.memory_reserved > 0  # its CUDA context, measured at its start
    assert {"noop", "fill", "copy", "axpy", "matmul", "sum"} <= set(hello.kernels)
    stats = await host.stats()
    assert (stats.used, stats.free, stats.total, stats.reserved, stats.buffers) == (
        0,
        usable(host),
        hello.memory_total,
        hello.memory_reserved,
        0,
    )


async def test_alloc_within_the_budget_counts_and_beyond_it_is_refused(host: LaneHost) -> None:
    budget = usable(host)
    assert await host.alloc("a", "float32", (256, 256)) == 256 * 256 * 4  # 256 KiB
    assert await host.alloc("b", "float64", (3, 4, 5)) == 3 * 4 * 5 * 8
    used = charged(host, 256 * 256 * 4) + charged(host, 480)  # in the pool's blocks
    error = await refused("out_of_memory", host.alloc("c", "float32", (budget // 4,)))
    assert "free" in error.message
    stats = await host.stats()
    assert (stats.used, stats.free, stats.buffers) == (used, budget - used, 2)
    # What is left still fits, to the last whole block.
    room = stats.free - stats.free % block(host)
    assert await host.alloc("d", "uint8", (room,)) == room
    assert (await host.stats()).free < block(host)
    await refused("out_of_memory", host.alloc("e", "uint8", (1,)))


async def test_a_new_buffer_is_zeroed(host: LaneHost) -> None:
    await host.alloc("a", "int64", (64,))
    assert await host.read("a", 0, 512) == bytes(512)


async def test_write_read_round_trip_with_offsets_and_bounds(host: LaneHost) -> None:
    await host.alloc("a", "uint8", (1000,))
    payload = RNG.integers(0, 256, 300, dtype=np.uint8).tobytes()
    assert await host.write("a", 100, payload) == 300
    assert await host.read("a", 100, 300) == payload
    assert await host.read("a", 0, 100) == bytes(100)
    assert await host.read("a", 399, 2) == payload[-1:] + b"\x00"
    assert await host.read("a", 1000, 0) == b""
    await refused("out_of_range", host.write("a", 900, payload))
    await refused("out_of_range", host.read("a", 999, 2))
    # The refused write changed nothing.
    assert await host.read("a", 900, 100) == bytes(100)


async def test_buffer_ids_must_be_new_and_known(host: LaneHost) -> None:
    await host.alloc("a", "float32", (4,))
    await refused("bad_args", host.alloc("a", "float32", (4,)))
    await refused("unknown_buffer", host.read("nope", 0, 1))
    await refused("unknown_buffer", host.write("nope", 0, b"x"))
    await refused("unknown_buffer", host.free("nope"))
    await refused("unknown_buffer", host.run("sum", buffers={"x": "nope"}))
    assert (await host.stats()).buffers == 1


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("complex64", (4,)), ("float32", ()), ("float32", (0,)), ("float32", (-1,))],
)
async def test_bad_alloc_args_are_refused_and_change_nothing(
    host: LaneHost, dtype: str, shape: tuple[int, ...]
) -> None:
    await refused("bad_args", host.alloc("a", dtype, shape))
    assert (await host.stats()).used == 0


async def test_free_and_free_all_give_the_budget_back(host: LaneHost) -> None:
    for i in range(5):
        await host.alloc(f"b{i}", "float32", (1024,))
    assert await host.free("b0") == 4096
    assert await host.free_all(["b1", "b2", "b3", "b4", "b4", "never"]) == 4 * 4096
    stats = await host.stats()
    assert (stats.used, stats.free, stats.buffers) == (0, usable(host), 0)
    # The whole budget is usable again.
    room = usable(host) - usable(host) % block(host)
    assert await host.alloc("all", "uint8", (room,)) == room


async def test_unknown_kernel_and_bad_kernel_args(host: LaneHost) -> None:
    await refused("unknown_kernel", host.run("rm_rf"))
    await refused("bad_args", host.run("Not-A-Name"))
    await host.alloc("y", "float32", (4,))
    await refused("bad_args", host.run("fill", {}, {"out": "y"}))
    await refused("bad_args", host.run("fill", {"value": 1.0}, {}))
    await refused("bad_args", host.run("fill", {"value": 1.0, "extra": 2}, {"out": "y"}))
    await refused("bad_args", host.run("fill", {"value": True}, {"out": "y"}))
    await refused("bad_args", host.run("fill", {"value": float("nan")}, {"out": "y"}))
    assert await host.read("y", 0, 16) == bytes(16)


async def test_noop_and_fill(host: LaneHost) -> None:
    assert await host.run("noop") == {}
    await host.alloc("f", "float32", (3, 5))
    await host.run("fill", {"value": 2.5}, {"out": "f"})
    assert np.array_equal(await get(host, "f", "float32", (3, 5)), np.full((3, 5), 2.5, "f4"))
    await host.alloc("i", "uint8", (8,))
    await refused("bad_args", host.run("fill", {"value": 300}, {"out": "i"}))
    await refused("bad_args", host.run("fill", {"value": 1.5}, {"out": "i"}))
    await host.run("fill", {"value": 255}, {"out": "i"})
    assert await host.read("i", 0, 8) == b"\xff" * 8


async def test_copy_needs_matching_dtype_and_shape(host: LaneHost) -> None:
    src = RNG.standard_normal((4, 6)).astype("f4")
    await put(host, "src", src)
    await host.alloc("dst", "float32", (4, 6))
    await host.run("copy", buffers={"src": "src", "dst": "dst"})
    assert np.array_equal(await get(host, "dst", "float32", (4, 6)), src)
    await host.alloc("wrong_shape", "float32", (6, 4))
    await host.alloc("wrong_dtype", "float64", (4, 6))
    await refused("shape_mismatch", host.run("copy", buffers={"src": "src", "dst": "wrong_shape"}))
    await refused("dtype_mismatch", host.run("copy", buffers={"src": "src", "dst": "wrong_dtype"}))
    assert await host.read("wrong_shape", 0, 96) == bytes(96)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
async def test_axpy_matches_numpy(host: LaneHost, dtype: str) -> None:
    x = RNG.standard_normal(100).astype(dtype)
    y = RNG.standard_normal(100).astype(dtype)
    await put(host, "x", x)
    await put(host, "y", y)
    await host.run("axpy", {"alpha": 0.75}, {"x": "x", "y": "y"})
    expected = y + np.asarray(0.75, dtype) * x
    assert np.array_equal(await get(host, "y", dtype, (100,)), expected)
    assert np.array_equal(await get(host, "x", dtype, (100,)), x)  # x is read only


async def test_axpy_refuses_integer_buffers(host: LaneHost) -> None:
    await host.alloc("x", "int32", (4,))
    await host.alloc("y", "int32", (4,))
    await refused("dtype_mismatch", host.run("axpy", {"alpha": 2}, {"x": "x", "y": "y"}))


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [("float32", 1e-5, 1e-5), ("float16", 1e-2, 5e-2)]
)
async def test_matmul_matches_numpy(host: LaneHost, dtype: str, rtol: float, atol: float) -> None:
    a = RNG.standard_normal((33, 17)).astype(dtype)
    b = RNG.standard_normal((17, 9)).astype(dtype)
    await put(host, "a", a)
    await put(host, "b", b)
    await host.alloc("out", dtype, (33, 9))
    await host.run("matmul", buffers={"a": "a", "b": "b", "out": "out"})
    got = await get(host, "out", dtype, (33, 9))
    expected = a.astype("f8") @ b.astype("f8")
    np.testing.assert_allclose(got.astype("f8"), expected, rtol=rtol, atol=atol)


async def test_matmul_checks_shapes_and_dtypes(host: LaneHost) -> None:
    await host.alloc("a", "float32", (4, 3))
    await host.alloc("b", "float32", (4, 2))
    await host.alloc("out", "float32", (4, 2))
    await host.alloc("a64", "float64", (4, 4))
    await host.alloc("b64", "float64", (4, 2))
    await host.alloc("vec", "float32", (4,))
    names = {"a": "a", "b": "b", "out": "out"}
    await refused("shape_mismatch", host.run("matmul", buffers=names))
    await refused("shape_mismatch", host.run("matmul", buffers={**names, "a": "vec"}))
    await refused("dtype_mismatch", host.run("matmul", buffers={**names, "a": "a64", "b": "b64"}))
    await refused("dtype_mismatch", host.run("matmul", buffers={**names, "b": "b64"}))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "int64", "uint8"])
async def test_sum_returns_the_scalar(host: LaneHost, dtype: str) -> None:
    x = (RNG.standard_normal(500) * 10).astype(dtype)
    await put(host, "x", x)
    result = await host.run("sum", buffers={"x": "x"})
    if np.dtype(dtype).kind == "f":
        assert result["value"] == pytest.approx(float(x.astype("f8").sum()), rel=1e-9)
    else:
        assert result["value"] == int(x.astype("i8").sum())
        assert isinstance(result["value"], int)


async def test_a_write_over_the_frame_bound_is_refused_before_sending(host: LaneHost) -> None:
    await host.alloc("a", "uint8", (16,))
    await refused("bad_args", host.write("a", 0, bytes(MAX_FRAME_BYTES + 1)))
    assert await host.read("a", 0, 16) == bytes(16)  # the host is still in service
