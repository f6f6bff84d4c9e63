"""The array backend a lane host keeps its buffers in: CuPy on a CUDA lane, else NumPy.

Both expose the same array API, so the host and its kernels have one code
path; only moving bytes between the owner's frames and the buffers differs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["Backend", "BackendUnavailable", "select_backend"]

log = logging.getLogger(__name__)

BackendName = Literal["auto", "numpy", "cupy"]


class BackendUnavailable(Exception):
    """The backend asked for cannot run here (the host exits with status 2)."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: Literal["numpy", "cupy"]
    load: Callable[[], Any]  # the array module, imported at its first use
    device: str
    out_of_memory: tuple[type[BaseException], ...]

    @functools.cached_property
    def xp(self) -> Any:
        # NumPy's import is most of a host's start and memory (about 60 ms and 15 MiB);
        # a host asked only hellos and heartbeats (a lane's sentinel) never needs it.
        return self.load()

    def zeros(self, dtype: str, shape: tuple[int, ...]) -> Any:
        # Zeroed, so a buffer never shows what an earlier tenant left in that memory.
        return self.xp.zeros(shape, dtype=dtype)

    def write(self, array: Any, offset: int, data: bytes | memoryview) -> None:
        np = importlib.import_module("numpy")  # (imported already: the array is one)
        flat = array.reshape(-1).view(self.xp.uint8)
        chunk = np.frombuffer(data, dtype=np.uint8)
        if self.name == "cupy":
            chunk = self.xp.asarray(chunk)
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


def _cupy() -> Backend:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        raise BackendUnavailable("CUDA_VISIBLE_DEVICES names no device")
    try:
        cp = importlib.import_module("cupy")
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or CUDA failing to initialise
        raise BackendUnavailable(f"CuPy is not usable: {exc!r}") from exc
    if count != 1:
        raise BackendUnavailable(f"expected exactly one visible device, CUDA sees {count}")
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    oom = (cp.cuda.memory.OutOfMemoryError, MemoryError)
    return Backend("cupy", lambda: cp, f"{name} ({visible})", oom)


def select_backend(name: BackendName) -> Backend:
    """`auto`: CuPy when a device is visible and CuPy works, else NumPy."""
    if name == "numpy":
        return _numpy()
    if name == "cupy":
        return _cupy()
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return _numpy()
    try:
        return _cupy()
    except BackendUnavailable as exc:
        # Simulated devices name UUIDs CUDA has never heard of: host memory it is.
        log.warning("no CUDA backend (%s); using host memory", exc)
        return _numpy()
