"""JSON Schema 2020-12 files for every public wire type, generated from the types.

`litegraph-node contracts` writes them into api/contracts/; `--check` compares
the checked-in files with what the types produce now and names each drift.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import msgspec

import api
from api.device_history import DeviceHistoryReply
from api.errors import ErrorEnvelope
from api.openapi import openapi_document
from api.wire import DrainReply, IntrospectionRequest, NodeStatus, WhoamiReply
from capabilities import Claims, Introspection, KeySet
from lanehost.protocol import Reply as LaneHostReply
from lanehost.protocol import Request as LaneHostRequest
from machine.snapshot import NodeSnapshot
from node.config import Config
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

__all__ = [
    "CONTRACTS_DIR",
    "PUBLIC_TYPES",
    "check_contracts",
    "render_contracts",
    "write_contracts",
]

CONTRACTS_DIR = pathlib.Path(api.__file__).resolve().parent / "contracts"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://schemas.litegraph.dev/node/"

# File stem -> wire type. A type listed here is a promise to other components.
PUBLIC_TYPES: dict[str, Any] = {
    "error_envelope": ErrorEnvelope,
    "config": Config,
    "node_snapshot": NodeSnapshot,
    "invocation_request": InvocationRequest,
    "submit_response": SubmitResponse,
    "invocation_status": InvocationStatus,
    "invocation_list": InvocationList,
    "lane_work_request": LaneWorkRequest,
    "lane_work_reply": LaneWorkReply,
    "drain_reply": DrainReply,
    "node_status": NodeStatus,
    "node_event": NodeEvent,
    "capability_claims": Claims,
    "token_reply": TokenReply,
    "key_set": KeySet,
    "introspection_request": IntrospectionRequest,
    "introspection": Introspection,
    # The lane owner <-> lane host protocol (msgpack on the wire; docs/lane-host-protocol.md).
    "lane_host_request": LaneHostRequest,
    "lane_host_reply": LaneHostReply,
    "batch_request": BatchRequest,
    "batch_reply": BatchReply,
    "wait_request": WaitRequest,
    "wait_reply": WaitReply,
    "whoami_reply": WhoamiReply,
    "device_history": DeviceHistoryReply,
}
OPENAPI_FILE = "openapi.json"


def _schema_for(name: str, wire_type: Any) -> dict[str, Any]:
    schema = msgspec.json.schema(wire_type)
    return {"$schema": SCHEMA_DIALECT, "$id": f"{ID_BASE}{name}.schema.json", **schema}


def render_contracts() -> dict[str, str]:
    """File name -> file text, for every public wire type and the OpenAPI document."""
    files = {
        f"{name}.schema.json": json.dumps(_schema_for(name, t), indent=2, sort_keys=True) + "\n"
        for name, t in PUBLIC_TYPES.items()
    }
    files[OPENAPI_FILE] = json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"
    return files


def write_contracts(directory: pathlib.Path = CONTRACTS_DIR) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    wanted = render_contracts()
    for stale in directory.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
    for name, text in wanted.items():
        (directory / name).write_text(text, encoding="utf-8")
    return sorted(wanted)


def check_contracts(directory: pathlib.Path = CONTRACTS_DIR) -> list[str]:
    """Problems, one line each, naming the file; empty when nothing drifted."""
    wanted = render_contracts()
    problems = []
    for name, text in sorted(wanted.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing (run `litegraph-node contracts`)")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{path}: differs from the wire type (run `litegraph-node contracts`)")
    for path in sorted(directory.glob("*.json")):
        if path.name not in wanted:
            problems.append(f"{path}: no wire type produces this file")
    return problems
