"""Small wire types of the HTTP API itself (probes, drain)."""

from __future__ import annotations

import msgspec

__all__ = ["DrainReply", "HealthReply", "ReadyReply"]


class HealthReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    status: str


class ReadyReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    status: str
    notes: dict[str, str] = msgspec.field(default_factory=dict)


class DrainReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lane_id: str
    drained: bool
