"""Lane work: the wire types a token holder sends, how it is refused, and what the
lane owner asks its host.

A reply never holds a device handle or pointer: buffers are opaque ids scoped
to the invocation that reserved them. The work itself runs in the lane's host
process (`lanehost`, through `supervisor.lane_host.LaneHost`), which the
owner reaches through the `LaneDevice` protocol below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Protocol

import msgspec

from capabilities import LaneOp
from lanehost.protocol import ITEMSIZE, MAX_ARGS, MAX_DATA_BYTES, MAX_DIM, MAX_DIMS, Dtype, Scalar
from machine.cgroups import InvocationCgroup

__all__ = [
    "BUFFER_ID_PATTERN",
    "MAX_TRANSFER_BYTES",
    "Download",
    "Execute",
    "KernelError",
    "LaneBusy",
    "LaneDevice",
    "LaneJob",
    "LaneWorkError",
    "LaneWorkReply",
    "LaneWorkRequest",
    "MemoryRelease",
    "MemoryReserve",
    "TokenReply",
    "Upload",
    "itemsize",
]

BUFFER_ID_PATTERN = r"^buf_[0-9a-f]{32}$"
MAX_TRANSFER_BYTES = MAX_DATA_BYTES  # one upload's body or one download's length: 64 MiB
_Dim = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]
_BufferId = Annotated[str, msgspec.Meta(pattern=BUFFER_ID_PATTERN)]
_Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


class MemoryReserve(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="memory_reserve",
    tag_field="op",
):
    """A zeroed buffer of prod(shape) elements of dtype, in the lane's memory."""

    dtype: Dtype
    shape: Annotated[list[_Dim], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


class MemoryRelease(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="memory_release",
    tag_field="op",
):
    buffer_id: _BufferId


class Execute(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="execute",
    tag_field="op",
):
    """A trusted kernel of the lane host's registry; `buffers` maps the kernel's
    buffer names to buffer ids the same invocation holds on this lane."""

    kernel: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
    args: Annotated[dict[_Name, Scalar], msgspec.Meta(max_length=MAX_ARGS)] = msgspec.field(
        default_factory=dict
    )
    buffers: Annotated[dict[_Name, _BufferId], msgspec.Meta(max_length=MAX_ARGS)] = msgspec.field(
        default_factory=dict
    )
    # The kernel's own deadline in seconds, at most the node's --max-kernel-seconds
    # (and that when absent): past it the invocation's lane session ends, and the
    # invocation with `kernel_timeout`.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


LaneWorkRequest = MemoryReserve | MemoryRelease | Execute


class Upload(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes written into a buffer at an offset (a route's body, never JSON)."""

    buffer_id: str
    offset: int
    data: bytes


class Download(msgspec.Struct, frozen=True, kw_only=True):
    buffer_id: str
    offset: int
    length: int


LaneJob = LaneWorkRequest | Upload | Download


def lane_op(work: LaneJob) -> LaneOp:
    """The token operation a request needs."""
    if isinstance(work, MemoryReserve):
        return LaneOp.MEMORY_RESERVE
    if isinstance(work, MemoryRelease):
        return LaneOp.MEMORY_RELEASE
    if isinstance(work, Upload):
        return LaneOp.MEMORY_WRITE
    if isinstance(work, Download):
        return LaneOp.MEMORY_READ
    return LaneOp.EXECUTE


class LaneWorkReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: str
    lane_id: str
    invocation_id: str
    buffer_id: str | None = None
    bytes_held: int  # lane memory this invocation holds on this lane after the op
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


class LaneWorkError(Exception):
    """Lane work refused or failed; `status` is the honest HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class LaneBusy(LaneWorkError):
    def __init__(self, lane_id: str) -> None:
        super().__init__(429, "lane_busy", f"lane {lane_id} has too much work queued")


class LaneDevice(Protocol):
    """What a lane owner needs of its host: `LaneHost`, or a double in tests.
    Refusals raise `LaneHostError`; a host that cannot be trusted raises
    `LaneHostFailed`."""

    async def start(self, *, cgroup: InvocationCgroup | None = None) -> object:
        """Start the host; in `cgroup` (an invocation's) when given, charged there."""
        ...

    async def aclose(self) -> None: ...

    async def wait_exited(self) -> None:
        """Return once the host's process has ended, whoever ended it."""

    async def stats(self, *, seconds: float | None = None) -> object:
        """The host's cheapest request: its answer says it is still there."""
        ...

    async def alloc(self, buffer_id: str, dtype: str, shape: Sequence[int]) -> int: ...

    async def free(self, buffer_id: str) -> int: ...

    async def free_all(self, buffer_ids: Sequence[str]) -> int: ...

    async def write(self, buffer_id: str, offset: int, data: bytes) -> int: ...

    async def read(self, buffer_id: str, offset: int, length: int) -> bytes: ...

    async def run(
        self,
        kernel: str,
        args: Mapping[str, Scalar],
        buffers: Mapping[str, str],
        *,
        seconds: float | None = None,
    ) -> dict[str, Scalar]:
        """Run the kernel; `seconds`: its deadline (None: the host's own)."""
        ...
