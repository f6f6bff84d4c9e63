"""Lane work: the wire types a token holder sends, and the executors that run it.

A reply never holds a device handle or pointer: buffers are opaque ids scoped
to the invocation that reserved them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Protocol

import msgspec
import trio

from capabilities import LaneOp
from node.machine.lanes import Lane

__all__ = [
    "Execute",
    "KernelError",
    "LaneExecutor",
    "LaneWorkReply",
    "LaneWorkRequest",
    "MemoryRelease",
    "MemoryReserve",
    "SimulatedExecutor",
    "TokenReply",
]

BUFFER_ID_PATTERN = r"^buf_[0-9a-f]{32}$"
_Bytes = Annotated[int, msgspec.Meta(ge=1, le=2**50)]


class MemoryReserve(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="memory_reserve",
    tag_field="op",
):
    bytes: _Bytes


class MemoryRelease(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="memory_release",
    tag_field="op",
):
    buffer_id: Annotated[str, msgspec.Meta(pattern=BUFFER_ID_PATTERN)]


class Execute(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="execute",
    tag_field="op",
):
    kernel: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
    args: dict[str, Any] = msgspec.field(default_factory=dict)


LaneWorkRequest = MemoryReserve | MemoryRelease | Execute


def lane_op(work: LaneWorkRequest) -> LaneOp:
    """The token operation a request needs."""
    if isinstance(work, MemoryReserve):
        return LaneOp.MEMORY_RESERVE
    if isinstance(work, MemoryRelease):
        return LaneOp.MEMORY_RELEASE
    return LaneOp.EXECUTE


class LaneWorkReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: str
    lane_id: str
    invocation_id: str
    buffer_id: str | None = None
    bytes_held: int  # VRAM this invocation holds on this lane after the op
    result: dict[str, Any] | None = None


class TokenReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A fresh capability token for the same lane, invocation and scope."""

    lane_id: str
    token: str
    expires_at: str  # RFC 3339


class KernelError(Exception):
    """Lane work that could not run; `code` is a snake_case reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LaneExecutor(Protocol):
    async def execute(self, lane: Lane, kernel: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one kernel on the lane; KernelError when it cannot."""
        ...


MAX_SIM_SECONDS = 60.0
SIM_FLOPS = 50e12  # a modelled device rate, so durations scale with the work asked for


def _number(args: Mapping[str, Any], name: str, default: float, top: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= top:
        raise KernelError("bad_kernel_args", f"{name} must be a number in [0, {top}]")
    return float(value)


class SimulatedExecutor:
    """Models kernel duration; a lane that is not usable (sim faults reach it through
    health) fails the work with `lane_unhealthy`, before or while it runs."""

    KERNELS = ("noop", "sleep", "matmul")

    def __init__(self, lane_usable: Callable[[str], bool]) -> None:
        self._usable = lane_usable

    async def execute(self, lane: Lane, kernel: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if kernel == "noop":
            seconds, result = 0.0, {}
        elif kernel == "sleep":
            seconds = _number(args, "seconds", 0.0, MAX_SIM_SECONDS)
            result = {"seconds": seconds}
        elif kernel == "matmul":
            n = _number(args, "n", 1024, 65536)
            seconds = min(MAX_SIM_SECONDS, 2 * n**3 / SIM_FLOPS)
            result = {"flops": 2 * int(n) ** 3, "modelled_seconds": seconds}
        else:
            raise KernelError("unknown_kernel", f"no kernel {kernel!r} (known: {self.KERNELS})")
        if not self._usable(lane.lane_id):
            raise KernelError("lane_unhealthy", "the lane is not healthy")
        await trio.sleep(seconds)
        if not self._usable(lane.lane_id):
            raise KernelError("lane_unhealthy", "the lane failed while the work ran")
        return result
