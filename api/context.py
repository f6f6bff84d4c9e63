"""What the HTTP handlers reach: filled in by the daemon as start-up proceeds."""

from __future__ import annotations

import dataclasses

from api.auth import Authenticator
from api.device_history import DeviceHistory
from api.metrics import NodeMetrics
from api.settings import HttpSettings
from api.snapshot_cache import SnapshotCache
from machine.readiness import Readiness
from supervisor.core import Supervisor
from supervisor.events import EventHub
from supervisor.wire import NodeEvent

__all__ = ["NodeContext"]


@dataclasses.dataclass
class NodeContext:
    http: HttpSettings
    readiness: Readiness
    metrics: NodeMetrics
    auth: Authenticator | None = None
    supervisor: Supervisor | None = None
    snapshots: SnapshotCache | None = None
    events: EventHub[NodeEvent] | None = None
    history: DeviceHistory | None = None
