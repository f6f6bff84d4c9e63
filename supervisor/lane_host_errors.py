"""How a request to a lane host fails: refused (nothing changed, the host stays in
service) or the host lost (it has been killed). `supervisor.lane_host` raises
both; a lane owner tells them apart."""

from __future__ import annotations

from typing import Literal

__all__ = ["FailureReason", "LaneHostError", "LaneHostFailed"]

FailureReason = Literal[
    "start_failed",
    "version",
    "crashed",
    "protocol",
    "timeout",
    "closed",
    # The host was given a CUDA device and cannot run CUDA kernels on it (it refused
    # its hello, or answered with host memory): the lane never computes on the CPU.
    "cuda_unavailable",
    # A sticky device error ended the request and the host (its context is dead).
    "device_failed",
]


class LaneHostFailed(Exception):
    """The host is gone or cannot be trusted any more, and has been killed."""

    def __init__(self, lane_id: str, reason: FailureReason, message: str) -> None:
        super().__init__(f"lane host {lane_id}: {reason}: {message}")
        self.lane_id = lane_id
        self.reason: FailureReason = reason
        self.message = message


class LaneHostError(Exception):
    """The host refused one request with a protocol error code; nothing changed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
