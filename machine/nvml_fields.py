"""Reading NVML one field at a time, and what each kind of error means.

The driver answers a field it does not have with NVMLError_NotSupported: the
field is None, nothing is wrong. It refuses a field for other reasons too:
NoPermission (a field needs privileges the daemon lacks), FunctionNotFound (an
older driver), InvalidArgument, Unknown. Those make that field None with the
driver's reason and leave the rest of the reading alone. A few errors say that
nothing on the device can be read now (`device_level`: the GPU is lost, NVML
is not initialised, the driver is missing, mismatched or wants a reset); they
fail the whole reading. Used in the worker threads only (blocking calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Fields", "device_level", "text"]

T = TypeVar("T")


def text(value: Any) -> str:
    """NVML strings: `str` from nvidia-ml-py, `bytes` from older bindings."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def device_level(nv: Any, exc: BaseException) -> bool:
    """An error that concerns the whole device (or NVML itself), not one field."""
    return isinstance(
        exc,
        (
            nv.NVMLError_GpuIsLost,
            nv.NVMLError_Uninitialized,
            nv.NVMLError_DriverNotLoaded,
            nv.NVMLError_LibraryNotFound,
            nv.NVMLError_LibRmVersionMismatch,
            nv.NVMLError_ResetRequired,
            nv.NVMLError_IrqIssue,
        ),
    )


class Fields:
    """Guarded reads of one device: each field on its own.

    `get` returns the value, or None when the device does not support the field
    or refused it (then "field: reason" is added to `unread`); device-level
    errors propagate. `answered` counts the fields the device answered at all
    (NotSupported is an answer), so a device that refused every field can be
    told from one that refused some.
    """

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.unread: list[str] = []
        self.answered = 0

    def get(self, field: str, fn: Callable[..., T], *args: Any) -> T | None:
        nv = self.nv
        try:
            value = fn(*args)
        except nv.NVMLError_NotSupported:
            self.answered += 1
            return None
        except nv.NVMLError as exc:
            if device_level(nv, exc):
                raise
            self.unread.append(f"{field}: {exc}")
            return None
        self.answered += 1
        return value
