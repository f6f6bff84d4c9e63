"""Shared request plumbing: bodies decoded against wire types, roles, identifiers."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import msgspec
from quart import request

from api.auth import Role
from api.context import NodeContext
from api.errors import ApiError
from supervisor.core import Supervisor

__all__ = [
    "ADMIN",
    "ANY_OPERATOR",
    "check_identifier",
    "decode_body",
    "decode_json",
    "is_loopback",
    "ready_supervisor",
    "require_role",
]

ANY_OPERATOR = frozenset({Role.scheduler, Role.admin})
ADMIN = frozenset({Role.admin})


async def decode_body(wire_type: Any) -> Any:
    """Decode the request body as `wire_type` (a Struct or a union of them); the
    size was capped before reading (413). Callers annotate what they get."""
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "send application/json")
    return decode_json(await request.get_data(as_text=False), wire_type)


def decode_json(body: bytes | str, wire_type: Any) -> Any:
    """Decode JSON bytes as `wire_type`: 400 when malformed, 422 when invalid."""
    try:
        return msgspec.json.decode(body, type=wire_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "malformed_json", str(exc)) from None
    except RecursionError:
        raise ApiError(400, "malformed_json", "JSON nested too deeply") from None


def check_identifier(value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.fullmatch(value):
        raise ApiError(400, "invalid_identifier", f"not a valid {what}", {"field": what})
    return value


def require_role(ctx: NodeContext, allowed: frozenset[Role]) -> Role:
    if ctx.auth is None:
        raise ApiError(
            503, "not_ready", "the node is starting", {"reasons": ctx.readiness.reasons()}
        )
    return ctx.auth.require(request.headers.get("Authorization"), allowed)


def ready_supervisor(ctx: NodeContext) -> Supervisor:
    if ctx.supervisor is None:
        raise ApiError(
            503, "not_ready", "the node is starting", {"reasons": ctx.readiness.reasons()}
        )
    return ctx.supervisor


def is_loopback() -> bool:
    try:
        return ipaddress.ip_address(request.remote_addr or "").is_loopback
    except ValueError:
        return False
