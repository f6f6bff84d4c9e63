"""Trio supervision of invocations and lane owners."""

from supervisor.admission import AdmissionRefused
from supervisor.core import Supervisor, UnknownInvocation
from supervisor.lane_owner import LaneWorkError
from supervisor.wire import (
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    NodeEvent,
    SubmitResponse,
)

__all__ = [
    "AdmissionRefused",
    "InvocationRequest",
    "InvocationState",
    "InvocationStatus",
    "LaneWorkError",
    "NodeEvent",
    "SubmitResponse",
    "Supervisor",
    "UnknownInvocation",
]
