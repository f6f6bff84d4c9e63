"""The registry of trusted kernels a lane host runs, by name.

Kernels are code the operator installed: the built-ins below, plus entry points
in the group `litegraph.kernels`, loaded once when the host starts. A guest
names a kernel and passes scalars and buffer ids; it never sends code. A
kernel gets the array module (`numpy` or `cupy`), so one body runs on both,
and declares the temporaries it allocates (`Kernel.scratch`), which the host
counts against the lane's budget before it runs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from lanehost.protocol import KERNEL_NAME_PATTERN, Scalar

__all__ = [
    "BUILTIN_KERNELS",
    "ENTRY_POINT_GROUP",
    "Kernel",
    "KernelError",
    "load_kernels",
    "no_scratch",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "litegraph.kernels"

# (xp, args, buffers) -> result. `buffers` are the arrays themselves, already
# looked up by the host; the body must not keep them.
KernelFn = Callable[[Any, Mapping[str, Scalar], Mapping[str, Any]], dict[str, Scalar]]
# buffers -> the bytes of temporaries the body allocates on the lane's device while it
# runs (axpy's alpha * x): the host refuses the run `out_of_memory` unless they fit
# in what the lane's budget has free, so a kernel never takes the device past it.
ScratchFn = Callable[[Mapping[str, Any]], int]


def no_scratch(buffers: Mapping[str, Any]) -> int:
    return 0


class KernelError(Exception):
    """A kernel refused its arguments; `code` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A named kernel and exactly the scalar args and buffer names it takes."""

    name: str
    fn: KernelFn
    args: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()
    scratch: ScratchFn = no_scratch

    def check(self, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> None:
        """KernelError `bad_args` unless these are exactly its args and buffers."""
        if set(args) != self.args:
            raise KernelError("bad_args", f"{self.name} takes args {sorted(self.args)}")
        if set(buffers) != self.buffers:
            raise KernelError("bad_args", f"{self.name} takes buffers {sorted(self.buffers)}")

    def __call__(
        self, xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]
    ) -> dict[str, Scalar]:
        self.check(args, buffers)
        return self.fn(xp, args, buffers)


FLOATS = ("float16", "float32", "float64")


def _number(args: Mapping[str, Scalar], name: str) -> float:
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise KernelError("bad_args", f"{name} must be a finite number")
    return float(value)


def _same(kernel: str, a: Any, b: Any) -> None:
    if a.dtype != b.dtype:
        raise KernelError("dtype_mismatch", f"{kernel}: {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise KernelError("shape_mismatch", f"{kernel}: {a.shape} and {b.shape}")


def _noop(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    return {}


def _fill(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    out = buffers["out"]
    value = _number(args, "value")
    if out.dtype.kind in "iu" and (not value.is_integer() or not _fits(xp, out.dtype, value)):
        raise KernelError("bad_args", f"fill: {value} is not a {out.dtype} value")
    out.fill(value)
    return {}


def _fits(xp: Any, dtype: Any, value: float) -> bool:
    info = xp.iinfo(dtype)
    return bool(info.min <= value <= info.max)


def _copy(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    src, dst = buffers["src"], buffers["dst"]
    _same("copy", src, dst)
    xp.copyto(dst, src)
    return {}


def _axpy(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    x, y = buffers["x"], buffers["y"]
    alpha = _number(args, "alpha")
    _same("axpy", x, y)
    if str(y.dtype) not in FLOATS:
        raise KernelError("dtype_mismatch", f"axpy needs a float dtype, not {y.dtype}")
    y += y.dtype.type(alpha) * x  # alpha * x is a temporary of x's size: `_axpy_scratch`
    return {}


def _axpy_scratch(buffers: Mapping[str, Any]) -> int:
    return int(buffers["x"].nbytes)


def _matmul(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    a, b, out = buffers["a"], buffers["b"], buffers["out"]
    if str(a.dtype) not in ("float32", "float16") or not a.dtype == b.dtype == out.dtype:
        raise KernelError(
            "dtype_mismatch", f"matmul needs float32 or float16 throughout, not {a.dtype}"
        )
    if not (a.ndim == b.ndim == out.ndim == 2):
        raise KernelError("shape_mismatch", "matmul takes 2-D a, b and out")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or out.shape != (m, n):
        raise KernelError("shape_mismatch", f"matmul: {a.shape} @ {b.shape} -> {out.shape}")
    xp.matmul(a, b, out=out)
    return {}


def _sum(xp: Any, args: Mapping[str, Scalar], buffers: Mapping[str, Any]) -> dict[str, Scalar]:
    x = buffers["x"]
    if x.dtype.kind in "iu":
        return {"value": int(x.sum(dtype=xp.int64))}
    return {"value": float(x.sum(dtype=xp.float64))}


BUILTIN_KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("noop", _noop),
        Kernel("fill", _fill, frozenset({"value"}), frozenset({"out"})),
        Kernel("copy", _copy, buffers=frozenset({"src", "dst"})),
        Kernel("axpy", _axpy, frozenset({"alpha"}), frozenset({"x", "y"}), _axpy_scratch),
        Kernel("matmul", _matmul, buffers=frozenset({"a", "b", "out"})),
        Kernel("sum", _sum, buffers=frozenset({"x"})),
    )
}


def load_kernels(group: str = ENTRY_POINT_GROUP) -> dict[str, Kernel]:
    """The built-ins plus every entry point of `group` that loads as a valid `Kernel`.

    A plugin that fails to import, is not a `Kernel`, has a bad name or would
    replace another kernel is logged and skipped: one broken plugin must not
    stop the lane.
    """
    kernels = dict(BUILTIN_KERNELS)
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            kernel = entry.load()
        except Exception as exc:
            log.warning("kernel plugin %s (%s) failed to load: %r", entry.name, entry.value, exc)
            continue
        if not isinstance(kernel, Kernel) or not re.fullmatch(KERNEL_NAME_PATTERN, kernel.name):
            log.warning("kernel plugin %s is not a valid Kernel; skipped", entry.name)
        elif kernel.name in kernels:
            log.warning("kernel plugin %s would replace %s; skipped", entry.name, kernel.name)
        else:
            kernels[kernel.name] = kernel
    return kernels
