"""Lane work checked whole before the lane owner frames any of it for its host.

The edge decodes a request against `supervisor.lane_work`'s schema, but that schema
is not the wire's: JSON carries integers of any size, and work built in Python
(builtins, tests, later callers) skips the decoder altogether. So every job is
checked here, value by value, against what the host's decoder (`lanehost.protocol`)
and its kernels accept: integers in the signed 64-bit range, finite floats, no
nesting, names and ids of the protocol's patterns, at most `MAX_ARGS` of each,
offsets and lengths of the protocol's bounds. A job that does not fit is
`LaneWorkError(422, "bad_args")` for its caller alone, before anything is sent:
no host is asked, and no other invocation on the lane notices.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from lanehost.protocol import (
    DTYPES,
    KERNEL_NAME_PATTERN,
    MAX_ARGS,
    MAX_DATA_BYTES,
    MAX_DIM,
    MAX_DIMS,
    MAX_OFFSET,
)
from supervisor.lane_work import (
    BUFFER_ID_PATTERN,
    Download,
    Execute,
    LaneJob,
    LaneWorkError,
    MemoryRelease,
    MemoryReserve,
    Upload,
)

__all__ = ["INT_MAX", "INT_MIN", "check_job"]

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # the host's kernels take int64 values


def _whole(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.removeprefix("^").removesuffix("$"))  # for fullmatch


_KERNEL = _whole(KERNEL_NAME_PATTERN)
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # an arg's or a kernel buffer's name
_BUFFER_ID = _whole(BUFFER_ID_PATTERN)


def _refuse(where: str, what: str) -> LaneWorkError:
    return LaneWorkError(422, "bad_args", f"{where}: {what}")


def _integer(where: str, value: object, low: int, high: int) -> int:
    # bool is an int to Python, never to the wire's schema.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(where, f"must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise _refuse(where, f"must be from {low} to {high}")
    return value


def _pattern(where: str, value: object, pattern: re.Pattern[str]) -> None:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise _refuse(where, f"must match {pattern.pattern}")


def _buffer_id(where: str, value: object) -> None:
    _pattern(where, value, _BUFFER_ID)


def _scalar(where: str, value: object) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise _refuse(where, "an integer must fit in 64 signed bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refuse(where, "a number must be finite")
        return
    raise _refuse(where, f"must be a boolean or a number, not {type(value).__name__}")


def _named(where: str, values: object) -> Mapping[object, object]:
    if not isinstance(values, Mapping):
        raise _refuse(where, "must be an object")
    if len(values) > MAX_ARGS:
        raise _refuse(where, f"at most {MAX_ARGS} entries")
    for name in values:
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise _refuse(where, f"names must match {_NAME.pattern}")
    return values


def _execute(work: Execute) -> None:
    _pattern("kernel", work.kernel, _KERNEL)
    for name, value in _named("args", work.args).items():
        _scalar(f"args.{name}", value)
    for name, value in _named("buffers", work.buffers).items():
        _buffer_id(f"buffers.{name}", value)
    timeout = work.timeout_s
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise _refuse("timeout_s", "must be a number of seconds")
        if not (math.isfinite(timeout) and timeout > 0):
            raise _refuse("timeout_s", "must be a finite number of seconds above 0")


def _reserve(work: MemoryReserve) -> None:
    if not isinstance(work.dtype, str) or work.dtype not in DTYPES:
        raise _refuse("dtype", f"must be one of {', '.join(DTYPES)}")
    shape = work.shape
    if not isinstance(shape, list | tuple) or not 1 <= len(shape) <= MAX_DIMS:
        raise _refuse("shape", f"must list 1 to {MAX_DIMS} dimensions")
    for n, dim in enumerate(shape):
        _integer(f"shape[{n}]", dim, 1, MAX_DIM)


def check_job(work: LaneJob) -> None:
    """Refuse (422 `bad_args`) a job any of whose values the host's wire cannot carry
    exactly; otherwise return, and the job frames and decodes back unchanged."""
    if isinstance(work, Execute):
        _execute(work)
    elif isinstance(work, MemoryReserve):
        _reserve(work)
    elif isinstance(work, MemoryRelease):
        _buffer_id("buffer_id", work.buffer_id)
    elif isinstance(work, Upload):
        _buffer_id("buffer_id", work.buffer_id)
        _integer("offset", work.offset, 0, MAX_OFFSET)
        if not isinstance(work.data, bytes | bytearray | memoryview):
            raise _refuse("data", "must be bytes")
        if memoryview(work.data).nbytes > MAX_DATA_BYTES:
            raise _refuse("data", f"at most {MAX_DATA_BYTES} bytes")
    elif isinstance(work, Download):
        _buffer_id("buffer_id", work.buffer_id)
        _integer("offset", work.offset, 0, MAX_OFFSET)
        _integer("length", work.length, 0, MAX_DATA_BYTES)
    else:
        raise _refuse("op", f"no lane work of type {type(work).__name__}")
