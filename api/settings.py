"""The HTTP edge's own settings, filled in by the application from its Config."""

from __future__ import annotations

import dataclasses

__all__ = ["HttpSettings"]


@dataclasses.dataclass(frozen=True)
class HttpSettings:
    listen: str  # host:port
    read_timeout: float  # seconds to read a request's head
    body_timeout: float  # seconds to read a request's body
    keep_alive: float  # seconds an idle connection stays open
    metrics_auth: bool  # /metrics needs the scheduler or admin secret
