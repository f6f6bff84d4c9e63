"""Trio supervision of invocations and lane owners."""

from __future__ import annotations

from typing import TYPE_CHECKING

from machine.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from supervisor.admission import AdmissionRefused
    from supervisor.core import (
        Supervisor,
        UnknownInvocation,
    )
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

# Imported on first use, so a command that needs one module of the package does not
# pay for all of them (the CLI starts in a fraction of the time).
_WHERE = {
    "AdmissionRefused": "supervisor.admission",
    "Supervisor": "supervisor.core",
    "UnknownInvocation": "supervisor.core",
    "LaneWorkError": "supervisor.lane_owner",
    "InvocationRequest": "supervisor.wire",
    "InvocationState": "supervisor.wire",
    "InvocationStatus": "supervisor.wire",
    "NodeEvent": "supervisor.wire",
    "SubmitResponse": "supervisor.wire",
}

__getattr__ = lazy_exports(__name__, _WHERE)
