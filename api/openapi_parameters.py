"""The parameters the OpenAPI paths share: path identifiers, byte offsets and lengths,
and the paging of the invocation list."""

from __future__ import annotations

from typing import Any

from supervisor.listing import (
    CURSOR_PATTERN,
    DEFAULT_LIST_LIMIT,
    MAX_LABEL_FILTERS,
    MAX_LIST_LIMIT,
)
from supervisor.wire import LABEL_KEY_PATTERN, MAX_LABEL_VALUE, InvocationState

__all__ = [
    "INVOCATION_ID_PATTERN",
    "LANE_ID_PATTERN",
    "list_parameters",
    "path_parameter",
    "query_integer",
]

INVOCATION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
LANE_ID_PATTERN = r"^lane_[0-9a-f]{16}$"


# Functions, not constants: each document gets its own dicts, whatever a caller
# does to the last one.
def path_parameter(name: str, pattern: str) -> dict[str, Any]:
    """A required path segment that must match `pattern`."""
    schema = {"type": "string", "pattern": pattern}
    return {"name": name, "in": "path", "required": True, "schema": schema}


def query_integer(name: str, top: int, required: bool) -> dict[str, Any]:
    """A query parameter from 0 to `top`: an offset or a length in bytes."""
    schema = {"type": "integer", "minimum": 0, "maximum": top}
    return {"name": name, "in": "query", "required": required, "schema": schema}


def list_parameters() -> list[dict[str, Any]]:
    states = [s.value for s in InvocationState]
    return [
        {
            "name": "state",
            "in": "query",
            "required": False,
            "description": "Only invocations in these states; repeat it for several.",
            "style": "form",
            "explode": True,
            "schema": {"type": "array", "items": {"type": "string", "enum": states}},
        },
        {
            "name": "label",
            "in": "query",
            "required": False,
            "description": (
                "Only invocations whose `labels` hold this `key=value` (split at the first"
                f" `=`); repeat it (at most {MAX_LABEL_FILTERS} times) for several, all of"
                " which must hold. A bad one is 400 `invalid_label`."
            ),
            "style": "form",
            "explode": True,
            "schema": {
                "type": "array",
                "maxItems": MAX_LABEL_FILTERS,
                "items": {
                    "type": "string",
                    "pattern": LABEL_KEY_PATTERN.removesuffix("$") + f"=.{{0,{MAX_LABEL_VALUE}}}$",
                },
            },
        },
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "description": f"Most invocations on the page (default {DEFAULT_LIST_LIMIT}).",
            "schema": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_LIST_LIMIT,
                "default": DEFAULT_LIST_LIMIT,
            },
        },
        {
            "name": "cursor",
            "in": "query",
            "required": False,
            "description": "The `next_cursor` of the previous page, as it was (opaque).",
            "schema": {"type": "string", "pattern": CURSOR_PATTERN},
        },
    ]
