"""Small wire types of the HTTP API itself (probes, drain, token introspection, whoami)."""

from __future__ import annotations

import msgspec

__all__ = [
    "DrainReply",
    "HealthReply",
    "IntrospectionRequest",
    "NodeStatus",
    "ReadyReply",
    "WhoamiReply",
]


class HealthReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    status: str


class ReadyReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    status: str
    notes: dict[str, str] = msgspec.field(default_factory=dict)


class DrainReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lane_id: str
    drained: bool


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """GET /v1/node and the answer to a whole-node drain or resume: readiness (as
    /readyz judges it), whether an operator drained the node, and this run's
    invocations by state (the live ones and the newest ended ones kept in memory)."""

    node_id: str
    ready: bool
    readiness_reasons: dict[str, str]
    drained: bool
    invocations: dict[str, int]


class IntrospectionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """RFC 7662: the token to look at; `token_type_hint` is accepted and ignored
    (this node has one kind of token)."""

    token: str
    token_type_hint: str | None = None


class WhoamiReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The role the presented operator secret holds (the status page shows admin
    controls only to an admin; the routes check the role themselves)."""

    role: str
