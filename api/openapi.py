"""The OpenAPI 3.1 document, built from the msgspec wire types (never written by hand).

Each endpoint lists every status it can answer with; every error body is the
one ErrorEnvelope. Every operation has a one-line summary and a tag
(`OPERATIONS`, by operationId), which the reference page at /docs shows.
`litegraph-node contracts --check` covers this document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from api.errors import ErrorEnvelope
from api.openapi_status import status_openapi
from api.wire import DrainReply, HealthReply, IntrospectionRequest, NodeStatus, ReadyReply
from capabilities import Introspection, KeySet
from machine.snapshot import NodeSnapshot
from supervisor.lane_work import (
    BUFFER_ID_PATTERN,
    MAX_TRANSFER_BYTES,
    LaneWorkReply,
    LaneWorkRequest,
    TokenReply,
)
from supervisor.listing import CURSOR_PATTERN, DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
from supervisor.wire import (
    BatchReply,
    BatchRequest,
    InvocationList,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    NodeEvent,
    SubmitResponse,
    WaitReply,
    WaitRequest,
)

__all__ = ["DOCS_ASSETS", "OPERATIONS", "TAGS", "openapi_document"]

_REF = "#/components/schemas/{name}"
_DESCRIPTIONS = {
    200: "OK",
    202: "Accepted",
    400: "Malformed request or identifier",
    401: "Missing or invalid credential",
    403: "Credential valid but not allowed",
    404: "No such resource",
    409: "Conflicts with current state",
    413: "Body too large",
    416: "Offset or length outside the buffer",
    415: "Body is not JSON",
    422: "Request well-formed but invalid",
    429: "Too much load; retry after Retry-After seconds",
    503: "Not ready, shutting down or lane unavailable",
}
# The groups of the reference page, in its order.
TAGS = {
    "invocations": "Run work on this node: submit, list, read, wait for and cancel invocations.",
    "lanes": "Work on a lane and its buffers with a capability token; drain and resume lanes.",
    "tokens": "Capability tokens: refresh one, the keys that verify them, introspection.",
    "node": "The node's health, readiness, state, events, metrics and status page.",
    "docs": "This document and the reference page rendered from it.",
}
# operationId -> (tag, summary). A new operation needs an entry (tests/unit/api/test_openapi.py).
OPERATIONS = {
    "healthz": ("node", "Liveness: the process answers"),
    "readyz": ("node", "Readiness, with the reasons while not ready"),
    "metrics": ("node", "Prometheus metrics"),
    "status_page": ("node", "The status page (loopback only)"),
    "get_snapshot": ("node", "Devices, lanes, capacity and health now"),
    "whoami": ("node", "The role of the secret presented"),
    "get_node": ("node", "Readiness, drain and invocation counts of the node"),
    "drain_node": ("node", "Drain the whole node: no new work anywhere (admin)"),
    "resume_node": ("node", "Resume a drained node (admin)"),
    "device_history": ("node", "Recent readings of each device"),
    "events": ("node", "Stream state changes as server-sent events"),
    "openapi": ("docs", "This OpenAPI document"),
    "api_docs": ("docs", "The API reference page, rendered from this document"),
    "api_docs_asset": ("docs", "A file of the API reference page"),
    "submit_invocation": ("invocations", "Submit an invocation"),
    "list_invocations": ("invocations", "List invocations, newest first, a page at a time"),
    "submit_invocation_batch": ("invocations", "Submit up to 256 invocations at once"),
    "wait_invocations": ("invocations", "Wait until invocations have ended"),
    "get_invocation": ("invocations", "Read an invocation's status and output"),
    "cancel_invocation": ("invocations", "Cancel an invocation"),
    "invocation_logs": ("invocations", "Read or follow an invocation's output as kept on disk"),
    "lane_work": ("lanes", "Reserve or release lane memory, or run a kernel"),
    "buffer_upload": ("lanes", "Write bytes into a buffer"),
    "buffer_download": ("lanes", "Read bytes from a buffer"),
    "drain_lane": ("lanes", "Drain a lane: no new work on it (admin)"),
    "resume_lane": ("lanes", "Resume a drained lane (admin)"),
    "refresh_token": ("tokens", "Trade a capability token for a fresh one"),
    "get_keys": ("tokens", "The keys that verify this node's tokens"),
    "introspect_token": ("tokens", "Is this token active now? (RFC 7662)"),
}
# The files of the reference page beside its index.html, and how each is served.
DOCS_ASSETS = {
    "init.js": "text/javascript; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "LICENSE": "text/plain; charset=utf-8",
    "NOTICE": "text/plain; charset=utf-8",
    "swagger-ui-bundle.js.LICENSE.txt": "text/plain; charset=utf-8",
}
_OPERATOR: list[dict[str, list[str]]] = [{"operator": []}]
_TOKEN: list[dict[str, list[str]]] = [{"capability": []}]


def _content(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {media: {"schema": schema}}


def _responses(ok: int, body: dict[str, Any] | None, errors: tuple[int, ...]) -> dict[str, Any]:
    error = _content({"$ref": _REF.format(name="ErrorEnvelope")})
    out: dict[str, Any] = {str(ok): {"description": _DESCRIPTIONS[ok]}}
    if body is not None:
        out[str(ok)]["content"] = body
    for status in errors:
        out[str(status)] = {"description": _DESCRIPTIONS[status], "content": error}
        if status == 429:
            out[str(status)]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


def _summarize(paths: dict[str, Any]) -> None:
    """Give each operation its summary and tag from OPERATIONS (an operation written
    with its own keeps them; one with neither fails tests/unit/api/test_openapi.py)."""
    for item in paths.values():
        for method, operation in item.items():
            if method == "parameters" or operation["operationId"] not in OPERATIONS:
                continue
            tag, summary = OPERATIONS[operation["operationId"]]
            operation.setdefault("summary", summary)
            operation.setdefault("tags", [tag])


def _list_parameters() -> list[dict[str, Any]]:
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


def openapi_document() -> dict[str, Any]:
    types: list[Any] = [
        ErrorEnvelope,
        HealthReply,
        ReadyReply,
        NodeSnapshot,
        InvocationRequest,
        SubmitResponse,
        InvocationStatus,
        InvocationList,
        LaneWorkRequest,
        LaneWorkReply,
        DrainReply,
        NodeEvent,
        TokenReply,
        KeySet,
        IntrospectionRequest,
        Introspection,
        BatchRequest,
        BatchReply,
        WaitRequest,
        WaitReply,
        NodeStatus,
    ]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref = dict(
        zip(
            (
                "error",
                "health",
                "ready",
                "snapshot",
                "request",
                "submit",
                "status",
                "list",
                "work",
                "work_reply",
                "drain",
                "event",
                "token",
                "keys",
                "introspect",
                "introspection",
                "batch",
                "batch_reply",
                "wait",
                "wait_reply",
                "node",
            ),
            schemas,
            strict=True,
        )
    )
    json_of = {k: _content(v) for k, v in ref.items()}
    inv_id = {
        "name": "invocation_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
    }
    lane_id = {
        "name": "lane_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": r"^lane_[0-9a-f]{16}$"},
    }
    auth = (401, 403, 503)
    paths: dict[str, Any] = {
        "/healthz": {
            "get": {"operationId": "healthz", "responses": _responses(200, json_of["health"], ())}
        },
        "/readyz": {
            "get": {"operationId": "readyz", "responses": _responses(200, json_of["ready"], (503,))}
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "responses": _responses(
                    200, _content({"type": "string"}, "text/plain"), (401, 403, 503)
                ),
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "responses": _responses(200, _content({"type": "object"}), ()),
            }
        },
        "/docs": {
            "get": {
                "operationId": "api_docs",
                "description": (
                    "This document as a page to read, rendered by the Swagger UI shipped"
                    " with the node: it loads nothing from elsewhere (its"
                    " Content-Security-Policy forbids it) and needs no credential."
                ),
                "responses": _responses(200, _content({"type": "string"}, "text/html"), ()),
            }
        },
        "/docs/{asset}": {
            "parameters": [
                {
                    "name": "asset",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "enum": sorted(DOCS_ASSETS)},
                }
            ],
            "get": {
                "operationId": "api_docs_asset",
                "responses": _responses(
                    200,
                    {
                        media: {"schema": {"type": "string"}}
                        for media in ("text/javascript", "text/css", "text/plain")
                    },
                    (404,),
                ),
            },
        },
        "/v1/snapshot": {
            "get": {
                "operationId": "get_snapshot",
                "security": _OPERATOR,
                "responses": _responses(200, json_of["snapshot"], auth),
            }
        },
        "/v1/events": {
            "get": {
                "operationId": "events",
                "security": _OPERATOR,
                "description": (
                    "Server-sent events; each data line of an invocation, health, lane or"
                    " admission event is a NodeEvent, with id `<run>-<sequence>`. Send"
                    " `Last-Event-ID` to resume after an id; when that is no longer kept"
                    " the stream starts with a `resync` event (re-read /v1/snapshot). A"
                    " `dropped` event ends a stream that fell behind. A `: heartbeat`"
                    " comment comes every few seconds."
                ),
                "parameters": [
                    {
                        "name": "ids",
                        "in": "query",
                        "required": False,
                        "description": (
                            "Up to 256 invocation ids, comma-separated: only their"
                            " invocation and admission events (400 invalid_ids otherwise)."
                        ),
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "Last-Event-ID",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string"},
                    },
                ],
                "responses": _responses(
                    200, _content(ref["event"], "text/event-stream"), (400, *auth, 429)
                ),
            }
        },
        "/v1/invocations": {
            "post": {
                "operationId": "submit_invocation",
                "security": _OPERATOR,
                "requestBody": {"required": True, "content": json_of["request"]},
                "responses": _responses(
                    202, json_of["submit"], (400, *auth, 409, 413, 415, 422, 429)
                ),
            },
            "get": {
                "operationId": "list_invocations",
                "security": _OPERATOR,
                "description": (
                    "Invocations this node answers `GET /v1/invocations/{id}` for, newest"
                    " first (by submission time, then id). Pass `next_cursor` back as"
                    " `cursor` for the next page: a page starts right after the last item"
                    " of the one before, so paging never repeats nor skips an invocation,"
                    " however many are submitted meanwhile. A bad `state`, `limit` or"
                    " `cursor` (or an unknown parameter) is 400 with a typed code."
                ),
                "parameters": _list_parameters(),
                "responses": _responses(200, json_of["list"], (400, *auth)),
            },
        },
        "/v1/invocations:batch": {
            "post": {
                "operationId": "submit_invocation_batch",
                "security": _OPERATOR,
                "description": (
                    "Submit up to 256 invocations (and at most the 64 KiB body) in one"
                    " request. Each item is admitted as a single submission would be"
                    " (idempotency, queue bound, validation) and gets its own result, in"
                    " the order sent: status 202 with `accepted` (tokens included), or the"
                    " status and error a single submission would have got, with"
                    " `retry_after_s` for 429/503. A body that does not decode changes"
                    " nothing."
                ),
                "requestBody": {"required": True, "content": json_of["batch"]},
                "responses": _responses(200, json_of["batch_reply"], (400, *auth, 413, 415, 422)),
            },
        },
        "/v1/invocations:wait": {
            "post": {
                "operationId": "wait_invocations",
                "security": _OPERATOR,
                "description": (
                    "Wait until every listed invocation has ended (with `any`, the first),"
                    " at most `timeout_s` (60 s) seconds; answers the statuses of those"
                    " that ended, the ids still queued or running, and the unknown ids."
                ),
                "requestBody": {"required": True, "content": json_of["wait"]},
                "responses": _responses(200, json_of["wait_reply"], (400, *auth, 413, 415, 422)),
            },
        },
        "/v1/invocations/{invocation_id}": {
            "parameters": [inv_id],
            "get": {
                "operationId": "get_invocation",
                "security": _OPERATOR,
                "responses": _responses(200, json_of["status"], (400, *auth, 404)),
            },
            "delete": {
                "operationId": "cancel_invocation",
                "security": _OPERATOR,
                "responses": _responses(200, json_of["status"], (400, *auth, 404)),
            },
        },
        "/v1/lanes/{lane_id}/work": {
            "parameters": [lane_id],
            "post": {
                "operationId": "lane_work",
                "security": _TOKEN,
                "requestBody": {"required": True, "content": json_of["work"]},
                "responses": _responses(
                    200, json_of["work_reply"], (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
                ),
            },
        },
    }
    octets = _content(
        {"type": "string", "contentMediaType": "application/octet-stream"},
        "application/octet-stream",
    )
    buffer_id = {
        "name": "buffer_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": BUFFER_ID_PATTERN},
    }

    def _query(name: str, top: int, required: bool) -> dict[str, Any]:
        schema = {"type": "integer", "minimum": 0, "maximum": top}
        return {"name": name, "in": "query", "required": required, "schema": schema}

    paths["/v1/lanes/{lane_id}/buffers/{buffer_id}"] = {
        "parameters": [lane_id, buffer_id],
        "put": {
            "operationId": "buffer_upload",
            "security": _TOKEN,
            "description": (
                "Write the body's bytes into a buffer the token's invocation holds, at"
                f" `offset`; at most {MAX_TRANSFER_BYTES} bytes (413 beyond)."
            ),
            "parameters": [_query("offset", 2**62, False)],
            "requestBody": {"required": True, "content": octets},
            "responses": _responses(
                200, json_of["work_reply"], (400, 401, 403, 404, 409, 413, 415, 416, 429, 503)
            ),
        },
        "get": {
            "operationId": "buffer_download",
            "security": _TOKEN,
            "description": (
                "Read `length` bytes from `offset` of a buffer the token's invocation holds;"
                f" at most {MAX_TRANSFER_BYTES} (400 beyond)."
            ),
            "parameters": [
                _query("offset", 2**62, False),
                _query("length", MAX_TRANSFER_BYTES, True),
            ],
            "responses": _responses(200, octets, (400, 401, 403, 404, 409, 416, 429, 503)),
        },
    }
    paths["/v1/invocations/{invocation_id}/logs"] = {
        "parameters": [inv_id],
        "get": {
            "operationId": "invocation_logs",
            "security": _OPERATOR,
            "description": (
                "The bytes of one stream of the invocation's output as kept on disk, from"
                " `offset`. Without `follow` the body ends at what is written so far; with"
                " `follow=1` it stays open and carries each byte as it is written, and ends"
                " once the invocation's output is complete and every byte was sent. Kept"
                " after the end (and across restarts) for `--logs-retention` seconds, within"
                " `--logs-max-bytes` per invocation and `--logs-total-bytes` in all; the"
                " status's `logs_cut` says why bytes are missing. 404 `logs_unavailable`:"
                " the invocation is known but its logs are not kept."
            ),
            "parameters": [
                {
                    "name": "stream",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "enum": ["stdout", "stderr"]},
                },
                _query("offset", 2**62, False),
                {
                    "name": "follow",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "enum": [0, 1]},
                },
            ],
            "responses": _responses(200, octets, (400, *auth, 404, 429)),
        },
    }
    paths["/v1/lanes/{lane_id}/token"] = {
        "parameters": [lane_id],
        "post": {
            "operationId": "refresh_token",
            "security": _TOKEN,
            "description": (
                "Trade a valid token of a live invocation for a fresh one, once the token "
                "has used half its life (429 refresh_too_early with Retry-After before)."
            ),
            "responses": _responses(200, json_of["token"], (400, 401, 403, 409, 429, 503)),
        },
    }
    paths["/v1/keys"] = {
        "get": {
            "operationId": "get_keys",
            "description": (
                "The node's verification keys as PASERK k4.public with their k4.pid (the"
                " token footer's kid), the signing key first, at most 16, and the implicit"
                " assertion every token is signed with. No credential: public keys only."
                " Keys retired (every key from before a restart) are never listed. A"
                " signature shows only who signed a token and its window; ask"
                " /v1/tokens/introspect whether it is still current."
            ),
            "responses": _responses(200, json_of["keys"], (503,)),
        },
    }
    paths["/v1/tokens/introspect"] = {
        "post": {
            "operationId": "introspect_token",
            "security": _OPERATOR,
            "description": (
                'RFC 7662 token introspection: `{"active": false}` for any token the node'
                " would refuse now (malformed, unknown key, bad signature, expired,"
                " superseded by a refresh, its invocation ended), with no reason; else"
                " `active` and the token's claims (times in Unix seconds, `scope` the lane"
                " operations, space separated). Body at most 8 KiB: JSON, or the"
                " `application/x-www-form-urlencoded` of RFC 7662 (`token=...`, each"
                " parameter once, the same fields as the JSON)."
            ),
            "requestBody": {"required": True, "content": json_of["introspect"]},
            "responses": _responses(200, json_of["introspection"], (400, *auth, 413, 415, 422)),
        },
    }
    for action in ("drain", "resume"):
        paths[f"/v1/lanes/{{lane_id}}/{action}"] = {
            "parameters": [lane_id],
            "post": {
                "operationId": f"{action}_lane",
                "security": _OPERATOR,
                "responses": _responses(200, json_of["drain"], (400, *auth, 404)),
            },
        }
    status_paths, status_components = status_openapi(_REF, _responses, _OPERATOR)
    paths.update(status_paths)
    components.update(status_components)
    paths["/v1/node"] = {
        "get": {
            "operationId": "get_node",
            "security": _OPERATOR,
            "responses": _responses(200, json_of["node"], auth),
        }
    }
    for action in ("drain", "resume"):
        paths[f"/v1/node/{action}"] = {
            "post": {
                "operationId": f"{action}_node",
                "security": _OPERATOR,
                "description": (
                    "Admin only, idempotent. A drained node refuses new submissions with"
                    " 503 `node_draining`, running work goes on, /readyz is 503 and the"
                    " snapshot says `drained`. Kept in memory: a restart admits again."
                ),
                "responses": _responses(200, json_of["node"], auth),
            }
        }
    _summarize(paths)
    return {
        "openapi": "3.1.0",
        # OpenAPI's own dialect (JSON Schema 2020-12 plus `discriminator`, which the
        # tagged unions use), also the default every renderer supports.
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "info": {
            "title": "litegraph-node",
            "version": "1",
            "description": (
                "A per-machine compute daemon: the scheduler submits invocations with an"
                " operator secret; work reaches its lanes with the capability tokens it"
                " was given. Every error is an `ErrorEnvelope` with a stable `code`."
            ),
        },
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "operator": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "scheduler or admin secret from the auth file",
                },
                "capability": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "PASETO v4.public",
                },
            },
        },
    }
