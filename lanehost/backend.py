"""The array backend a lane host keeps its buffers in: CuPy on a CUDA lane, else NumPy.

Both expose the same array API, so the host and its kernels have one code
path; only moving bytes between the owner's frames and the buffers differs.

A device lane never computes on the CPU by accident: a host asked for CuPy, or
for `auto` with a device named in CUDA_VISIBLE_DEVICES, that cannot run CUDA
kernels there raises `BackendUnavailable` (the host then refuses its hello
with `cuda_unavailable`), never falling back to host memory. Before it serves,
a CuPy host proves that what its kernels need loads and runs (an allocation,
an NVRTC-compiled elementwise kernel and a reduction, a cuBLAS matmul) and
measures the device memory that took: its CUDA context, cuBLAS's workspace
and the modules it loaded, kept out of the lane's budget (`Backend.overhead`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any, Literal

__all__ = [
    "ArrayBackend",
    "Backend",
    "BackendName",
    "BackendUnavailable",
    "cupy_backend",
    "select_backend",
]

log = logging.getLogger(__name__)

BackendName = Literal["auto", "numpy", "cupy"]
CUPY_POOL_UNIT = 512  # cupy.cuda.MemoryPool rounds every allocation up to this
ArrayBackend = Literal["numpy", "cupy"]


class BackendUnavailable(Exception):
    """The backend asked for cannot run here: the host refuses its hello with
    `cuda_unavailable` and exits with status 2."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: ArrayBackend
    load: Callable[[], Any]  # the array module, imported at its first use
    device: str
    out_of_memory: tuple[type[BaseException], ...]
    # Errors after which the device's context cannot be trusted: a sticky CUDA error
    # (an illegal address, a launch failure, the GPU falling off the bus) makes every
    # later call fail too. The host answers `device_failed` and exits, so its owner
    # starts a fresh one; empty on NumPy.
    device_errors: tuple[type[BaseException], ...] = ()
    # Device memory the host holds for itself, measured at start (its CUDA context,
    # cuBLAS's workspace, loaded modules): kept out of the lane's budget. 0 on NumPy.
    overhead: int = 0
    # CuPy's memory pool (None on NumPy): limited to the budget, emptied after frees.
    pool: Any = None
    # The pool's allocation unit: every block it hands out is a multiple of it, so
    # that is what an array costs the budget (512 bytes on CuPy; 1 on NumPy).
    granule: int = 1

    def charge(self, nbytes: int) -> int:
        """What `nbytes` of array cost the budget: rounded up to the pool's unit."""
        return -(-nbytes // self.granule) * self.granule

    @functools.cached_property
    def xp(self) -> Any:
        # NumPy's import is most of a host's start and memory (about 60 ms and 15 MiB);
        # a host asked only hellos and heartbeats (a lane's sentinel) never needs it.
        return self.load()

    def limit(self, nbytes: int) -> None:
        """The most device memory the pool may hold: buffers and temporaries together."""
        if self.pool is not None:
            self.pool.set_limit(size=max(0, nbytes))

    def release(self) -> None:
        """Give the pool's freed blocks back to the device: CuPy's pool keeps them for
        reuse otherwise, and the device (NVML, the next tenant) sees them as in use."""
        if self.pool is not None:
            self.pool.free_all_blocks()

    def zeros(self, dtype: str, shape: tuple[int, ...]) -> Any:
        # Zeroed, so a buffer never shows what an earlier tenant left in that memory.
        return self.xp.zeros(shape, dtype=dtype)

    def write(self, array: Any, offset: int, data: bytes | memoryview) -> None:
        np = importlib.import_module("numpy")  # (imported already: the array is one)
        flat = array.reshape(-1).view(self.xp.uint8)
        chunk = np.frombuffer(data, dtype=np.uint8)
        if self.name == "cupy":
            # Host bytes straight into the buffer's own device memory: no device copy of
            # the chunk, which would be up to 64 MiB outside the lane's budget.
            flat[offset : offset + len(data)].set(chunk)
        else:
            flat[offset : offset + len(data)] = chunk

    def read(self, array: Any, offset: int, length: int) -> memoryview:
        """A view of the bytes (a host copy first on CuPy), valid until the buffer changes."""
        flat = array.reshape(-1).view(self.xp.uint8)[offset : offset + length]
        host = flat if self.name == "numpy" else self.xp.asnumpy(flat)
        return memoryview(host)

    def synchronize(self) -> None:
        # CuPy kernels are asynchronous: wait, so a reply means the work is done
        # and a device fault surfaces in the request that caused it.
        if self.name == "cupy":
            self.xp.cuda.Stream.null.synchronize()


def _numpy() -> Backend:
    return Backend(
        "numpy", functools.partial(importlib.import_module, "numpy"), "host", (MemoryError,)
    )


def _nvml_used(uuid: str) -> int | None:
    """The device's used memory as NVML reads it (no CUDA context needed), or None
    where NVML cannot read it (no driver library, a device named by index)."""
    try:
        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: S110 - a failed shutdown changes nothing here
            pass


def _self_test(cp: Any) -> None:
    """Run once what the kernels need; BackendUnavailable names what fails.

    cupy-cuda12x without its CUDA libraries imports and sees the device (the
    driver is enough for that), then fails every kernel: NVRTC compiles each
    elementwise and reduction kernel, and cuBLAS does matmul."""
    what = "an allocation"
    try:
        a = cp.zeros((2, 2), dtype=cp.float32)
        what = "an elementwise kernel (NVRTC, and CuPy's kernel cache in CUPY_CACHE_DIR)"
        b = a + 1
        what = "a matmul (cuBLAS)"
        c = cp.matmul(b, b)
        what = "a reduction"
        total = float(c.sum(dtype=cp.float64))
        cp.cuda.Stream.null.synchronize()
    except Exception as exc:
        raise BackendUnavailable(f"{what} fails: {exc!r}") from exc
    if total != 8.0:
        raise BackendUnavailable(f"a 2x2 self-test summed to {total}, not 8")


def cupy_backend(
    cp: Any, visible: str, *, device_used: Callable[[], int | None] | None = None
) -> Backend:
    """CuPy (the module `cp`) on the one device `visible` names, checked and measured.

    `device_used` reads the device's used memory without a CUDA context (NVML's);
    its rise across the self-test is the host's overhead. Where it cannot read
    (None), the overhead is what the device has in use after the self-test, an
    upper bound. BackendUnavailable if the device or its libraries cannot run."""
    used = device_used if device_used is not None else functools.partial(_nvml_used, visible)
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, or CUDA failing to initialise
        raise BackendUnavailable(f"CUDA does not initialise: {exc!r}") from exc
    if count != 1:
        raise BackendUnavailable(f"expected exactly one visible device, CUDA sees {count}")
    try:
        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    except Exception as exc:
        raise BackendUnavailable(f"the device's properties are unreadable: {exc!r}") from exc
    name = name.decode() if isinstance(name, bytes) else str(name)
    before = used()
    _self_test(cp)  # creates the context, loads cuBLAS and NVRTC's kernels
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()  # the self-test's arrays are not overhead
    after = used()
    if before is not None and after is not None:
        overhead = max(0, after - before)
    else:
        free, total = (int(v) for v in cp.cuda.runtime.memGetInfo())
        overhead = max(0, total - free)
        log.warning(
            "NVML cannot read %s: its memory in use now (%d bytes) is taken as this "
            "host's overhead",
            visible,
            overhead,
        )
    device_errors = tuple(
        error
        for error in (
            getattr(cp.cuda.runtime, "CUDARuntimeError", None),
            getattr(getattr(cp.cuda, "driver", None), "CUDADriverError", None),
        )
        if isinstance(error, type) and issubclass(error, BaseException)
    )
    return Backend(
        "cupy",
        lambda: cp,
        f"{name} ({visible})",
        (cp.cuda.memory.OutOfMemoryError, MemoryError),
        device_errors=device_errors,
        overhead=overhead,
        pool=pool,
        granule=CUPY_POOL_UNIT,
    )


def _cupy() -> Backend:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        raise BackendUnavailable("CUDA_VISIBLE_DEVICES names no device")
    try:
        cp = importlib.import_module("cupy")
    except Exception as exc:  # not installed, or its import failing (an unwritable cache)
        raise BackendUnavailable(f"CuPy does not import: {exc!r}") from exc
    return cupy_backend(cp, visible)


def select_backend(name: BackendName) -> Backend:
    """`numpy`: host memory. `cupy`: the one device CUDA_VISIBLE_DEVICES names, or
    BackendUnavailable. `auto`: `cupy` when CUDA_VISIBLE_DEVICES names a device,
    `numpy` when it names none; never NumPy in place of a device that is named."""
    if name == "numpy":
        return _numpy()
    if name == "cupy" or os.environ.get("CUDA_VISIBLE_DEVICES"):
        return _cupy()
    return _numpy()
