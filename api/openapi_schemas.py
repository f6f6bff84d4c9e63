"""The component schemas of the OpenAPI document, generated from the msgspec wire types."""

from __future__ import annotations

from typing import Any

import msgspec

from api.errors import ErrorEnvelope
from api.openapi_responses import REF
from api.wire import DrainReply, HealthReply, IntrospectionRequest, NodeStatus, ReadyReply
from capabilities import Introspection, KeySet
from machine.snapshot import NodeSnapshot
from supervisor.lane_work import LaneWorkReply, LaneWorkRequest, TokenReply
from supervisor.wire import (
    BatchReply,
    BatchRequest,
    InvocationList,
    InvocationRequest,
    InvocationStatus,
    NodeEvent,
    SubmitResponse,
    WaitReply,
    WaitRequest,
)

__all__ = ["wire_schemas"]

# Short name (as the paths use it) -> wire type.
_WIRE_TYPES: dict[str, Any] = {
    "error": ErrorEnvelope,
    "health": HealthReply,
    "ready": ReadyReply,
    "snapshot": NodeSnapshot,
    "request": InvocationRequest,
    "submit": SubmitResponse,
    "status": InvocationStatus,
    "list": InvocationList,
    "work": LaneWorkRequest,
    "work_reply": LaneWorkReply,
    "drain": DrainReply,
    "event": NodeEvent,
    "token": TokenReply,
    "keys": KeySet,
    "introspect": IntrospectionRequest,
    "introspection": Introspection,
    "batch": BatchRequest,
    "batch_reply": BatchReply,
    "wait": WaitRequest,
    "wait_reply": WaitReply,
    "node": NodeStatus,
}


def wire_schemas() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(short name -> the `$ref` schema of its type, the component schemas they name)."""
    schemas, components = msgspec.json.schema_components(
        tuple(_WIRE_TYPES.values()), ref_template=REF
    )
    return dict(zip(_WIRE_TYPES, schemas, strict=True)), components
