"""A deterministic stand-in for CuPy, on NumPy, for the lane host's CUDA path.

No GPU and no CuPy are needed. `FakeCupy()` is a module-like object with what
`lanehost.backend` and the kernels use of CuPy: arrays, `cuda.runtime`,
`cuda.memory.OutOfMemoryError`, `Stream.null` and the default memory pool. The
"device" is host memory, and its pool behaves as CuPy's does:

- every new array (a buffer, or a temporary such as axpy's `alpha * x`) is a
  block of the pool: `used_bytes()` counts what live arrays hold, and a freed
  block stays in the pool (`total_bytes()`) until `free_all_blocks()`;
- past `set_limit` an allocation raises `OutOfMemoryError`, after the pool has
  given back its own freed blocks (as CuPy's retries); `peak` is the most the
  pool ever held;
- the device's memory in use, as NVML would read it (`nvml_used`), is the
  context (made at the first allocation, `context_bytes`) plus the pool;
  `cuda.runtime.memGetInfo()` says the same from the other side.

It fails the way real hardware and packaging do: `missing` ("cublas", "nvrtc")
makes a matmul or an elementwise kernel fail as a wheel without its CUDA
libraries does; `devices` is what `getDeviceCount` answers; `fail_on` (op names:
"zeros", "ufunc", "fill", "matmul", "copyto", "set", "asnumpy", "synchronize")
and `sticky_fill` (a fill with that value) raise `CUDARuntimeError` once, and
from then on every call does (a sticky error: the context is dead).

`FakeCupy.from_environment()` reads the same settings from FAKE_CUPY_* variables,
for `tests/fakes/fake_cupy_host.py`, a real lane host process with this as `cupy`.
"""

from __future__ import annotations

import os
import types
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["CUDARuntimeError", "FakeCupy", "FakePool", "OutOfMemoryError"]

MiB = 1 << 20


class CUDARuntimeError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError (a MemoryError, as CuPy's is)."""


class FakePool:
    """cupy.cuda.MemoryPool: blocks for arrays, kept after they are freed."""

    def __init__(self) -> None:
        self.limit = 0  # 0: none
        self.limits: list[int] = []  # every set_limit(size=...)
        self.releases = 0  # free_all_blocks calls
        self.used = 0
        self.cached = 0  # freed blocks the pool still holds
        self.peak = 0

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        assert fraction is None, "the lane host limits by size"
        self.limit = int(size or 0)
        self.limits.append(self.limit)

    def get_limit(self) -> int:
        return self.limit

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used + self.cached

    def free_all_blocks(self) -> None:
        self.releases += 1
        self.cached = 0

    def malloc(self, nbytes: int) -> None:
        if self.cached >= nbytes:  # a freed block is reused
            self.cached -= nbytes
        else:
            if self.limit and self.used + self.cached + nbytes > self.limit:
                self.cached = 0  # CuPy frees its own cache and retries
            if self.limit and self.used + nbytes > self.limit:
                raise OutOfMemoryError(
                    f"Out of memory allocating {nbytes} bytes "
                    f"(allocated so far: {self.used} bytes, limit set to: {self.limit} bytes)."
                )
        self.used += nbytes
        self.peak = max(self.peak, self.total_bytes())

    def free(self, nbytes: int) -> None:
        self.used -= nbytes
        self.cached += nbytes


class DeviceArray(np.ndarray):  # type: ignore[type-arg]
    """A cupy.ndarray: NumPy's, whose new arrays are pool blocks of its FakeCupy."""

    _fake: FakeCupy | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._fake = getattr(obj, "_fake", None)

    def _device(self) -> FakeCupy:
        assert self._fake is not None
        return self._fake

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        fake = self._device()
        fake.enter("ufunc")
        args = [np.asarray(x) if isinstance(x, DeviceArray) else x for x in inputs]
        out = kwargs.pop("out", None)
        if out is not None:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, DeviceArray) else o for o in out)
            getattr(ufunc, method)(*args, **kwargs)
            return out[0] if len(out) == 1 else out
        result = getattr(ufunc, method)(*args, **kwargs)
        return fake.adopt(result) if isinstance(result, np.ndarray) else result

    def fill(self, value: Any) -> None:
        fake = self._device()
        fake.enter("fill")
        if fake.sticky_fill is not None and value == fake.sticky_fill:
            fake.broken = True
            raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access")
        np.asarray(self).fill(value)

    def set(self, arr: Any) -> None:
        """cupy.ndarray.set: host bytes into this array's own device memory."""
        self._device().enter("set")
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.shape != arr.shape or self.dtype != arr.dtype:
            raise ValueError("Shape or dtype mismatch")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        np.copyto(np.asarray(self), arr)


class FakeCupy:
    """The `cupy` module a lane host imports, with a device of host memory."""

    def __init__(
        self,
        *,
        devices: int = 1,
        name: bytes = b"NVIDIA Fake H200",
        context_bytes: int = 4 * MiB,
        device_total: int = 1 << 36,
        missing: Iterable[str] = (),
        fail_on: Iterable[str] = (),
        sticky_fill: float | None = None,
    ) -> None:
        self.devices = devices
        self.name = name
        self.context_bytes = context_bytes
        self.device_total = device_total
        self.missing = set(missing)
        self.fail_on = set(fail_on)
        self.sticky_fill = sticky_fill
        self.broken = False
        self.context = False  # made at the first allocation
        self.calls: list[str] = []
        self.pool = FakePool()
        self.float16, self.float32, self.float64 = np.float16, np.float32, np.float64
        self.int32, self.int64, self.uint8 = np.int32, np.int64, np.uint8
        self.iinfo = np.iinfo
        self.ndarray = DeviceArray
        runtime = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError,
            getDeviceCount=self._device_count,
            getDeviceProperties=lambda _index: {"name": self.name},
            memGetInfo=self._mem_get_info,
        )
        stream = types.SimpleNamespace(null=types.SimpleNamespace(synchronize=self._synchronize))
        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
            Stream=stream,
        )

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> FakeCupy:
        env = dict(os.environ if env is None else env)

        def names(key: str) -> list[str]:
            return [n for n in env.get(key, "").split(",") if n]

        sticky = env.get("FAKE_CUPY_STICKY_FILL")
        return cls(
            devices=int(env.get("FAKE_CUPY_DEVICES", "1")),
            context_bytes=int(env.get("FAKE_CUPY_CONTEXT_BYTES", str(4 * MiB))),
            missing=names("FAKE_CUPY_MISSING"),
            fail_on=names("FAKE_CUPY_FAIL_ON"),
            sticky_fill=None if sticky is None else float(sticky),
        )

    # -- what a real device would do ------------------------------------------------
    def enter(self, op: str) -> None:
        """Every device call: a dead context fails it, as does an op set to fail."""
        self.calls.append(op)
        if self.broken:
            raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access")
        if op in self.fail_on:
            self.broken = True
            raise CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
        if op == "ufunc" and "nvrtc" in self.missing:
            raise RuntimeError("libnvrtc.so.12: cannot open shared object file")

    def adopt(self, array: np.ndarray) -> DeviceArray:  # type: ignore[type-arg]
        """A new array as a block of the pool, freed back to it when it is dropped."""
        self.context = True
        nbytes = int(array.nbytes)
        self.pool.malloc(nbytes)
        weakref.finalize(array, self.pool.free, nbytes)
        device = array.view(DeviceArray)
        device._fake = self
        return device

    def nvml_used(self) -> int:
        """The device's memory in use, as NVML reads it: context and pool."""
        return (self.context_bytes if self.context else 0) + self.pool.total_bytes()

    def _device_count(self) -> int:
        return self.devices

    def _mem_get_info(self) -> tuple[int, int]:
        self.context = True
        return self.device_total - self.nvml_used(), self.device_total

    def _synchronize(self) -> None:
        self.enter("synchronize")

    # -- the cupy API the host and kernels use -----------------------------------
    def get_default_memory_pool(self) -> FakePool:
        return self.pool

    def zeros(self, shape: Any, dtype: Any = np.float64) -> DeviceArray:
        self.enter("zeros")
        return self.adopt(np.zeros(shape, dtype=dtype))

    def asnumpy(self, array: Any) -> np.ndarray:  # type: ignore[type-arg]
        self.enter("asnumpy")
        return np.array(np.asarray(array), copy=True)

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        self.enter("matmul")
        if "cublas" in self.missing:
            raise RuntimeError("libcublas.so.12: cannot open shared object file")
        if out is not None:
            np.matmul(np.asarray(a), np.asarray(b), out=np.asarray(out))
            return out
        return self.adopt(np.matmul(np.asarray(a), np.asarray(b)))

    def copyto(self, dst: Any, src: Any) -> None:
        self.enter("copyto")
        np.copyto(np.asarray(dst), np.asarray(src))
