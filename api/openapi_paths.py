"""The paths of the OpenAPI document: every route with its parameters, request body
and the statuses it can answer with (the status page's own: api/openapi_status.py)."""

from __future__ import annotations

from typing import Any

from api.openapi_parameters import (
    INVOCATION_ID_PATTERN,
    LANE_ID_PATTERN,
    list_parameters,
    path_parameter,
    query_integer,
)
from api.openapi_responses import AUTH_ERRORS, content, responses
from api.openapi_security import CAPABILITY, OPERATOR
from api.openapi_status import status_openapi
from supervisor.lane_work import BUFFER_ID_PATTERN, MAX_TRANSFER_BYTES

__all__ = ["DOCS_ASSETS", "openapi_paths"]

# The files of the reference page beside its index.html, and how each is served.
DOCS_ASSETS = {
    "init.js": "text/javascript; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "LICENSE": "text/plain; charset=utf-8",
    "NOTICE": "text/plain; charset=utf-8",
    "swagger-ui-bundle.js.LICENSE.txt": "text/plain; charset=utf-8",
}


def openapi_paths(ref: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(paths, the component schemas they use beyond `ref`); `ref` is wire_schemas()'s,
    the `$ref` schema of each wire type by short name."""
    json_of = {k: content(v) for k, v in ref.items()}
    inv_id = path_parameter("invocation_id", INVOCATION_ID_PATTERN)
    lane_id = path_parameter("lane_id", LANE_ID_PATTERN)
    auth = AUTH_ERRORS
    paths: dict[str, Any] = {
        "/healthz": {
            "get": {"operationId": "healthz", "responses": responses(200, json_of["health"], ())}
        },
        "/readyz": {
            "get": {"operationId": "readyz", "responses": responses(200, json_of["ready"], (503,))}
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "responses": responses(200, content({"type": "string"}, "text/plain"), auth),
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "responses": responses(200, content({"type": "object"}), ()),
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
                "responses": responses(200, content({"type": "string"}, "text/html"), ()),
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
                "responses": responses(
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
                "security": OPERATOR,
                "responses": responses(200, json_of["snapshot"], auth),
            }
        },
        "/v1/events": {
            "get": {
                "operationId": "events",
                "security": OPERATOR,
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
                "responses": responses(
                    200, content(ref["event"], "text/event-stream"), (400, *auth, 429)
                ),
            }
        },
        "/v1/invocations": {
            "post": {
                "operationId": "submit_invocation",
                "security": OPERATOR,
                "requestBody": {"required": True, "content": json_of["request"]},
                "responses": responses(
                    202, json_of["submit"], (400, *auth, 409, 413, 415, 422, 429)
                ),
            },
            "get": {
                "operationId": "list_invocations",
                "security": OPERATOR,
                "description": (
                    "Invocations this node answers `GET /v1/invocations/{id}` for, newest"
                    " first (by submission time, then id). Pass `next_cursor` back as"
                    " `cursor` for the next page: a page starts right after the last item"
                    " of the one before, so paging never repeats nor skips an invocation,"
                    " however many are submitted meanwhile. `state` and `label` filter"
                    " (`label=team=ml`: its `labels` hold `team` = `ml`). A bad `state`,"
                    " `label`, `limit` or `cursor` (or an unknown parameter) is 400 with a"
                    " typed code."
                ),
                "parameters": list_parameters(),
                "responses": responses(200, json_of["list"], (400, *auth)),
            },
        },
        "/v1/invocations:batch": {
            "post": {
                "operationId": "submit_invocation_batch",
                "security": OPERATOR,
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
                "responses": responses(200, json_of["batch_reply"], (400, *auth, 413, 415, 422)),
            },
        },
        "/v1/invocations:wait": {
            "post": {
                "operationId": "wait_invocations",
                "security": OPERATOR,
                "description": (
                    "Wait until every listed invocation has ended (with `any`, the first),"
                    " at most `timeout_s` (60 s) seconds; answers the statuses of those"
                    " that ended, the ids still queued or running, and the unknown ids."
                ),
                "requestBody": {"required": True, "content": json_of["wait"]},
                "responses": responses(200, json_of["wait_reply"], (400, *auth, 413, 415, 422)),
            },
        },
        "/v1/invocations/{invocation_id}": {
            "parameters": [inv_id],
            "get": {
                "operationId": "get_invocation",
                "security": OPERATOR,
                "responses": responses(200, json_of["status"], (400, *auth, 404)),
            },
            "delete": {
                "operationId": "cancel_invocation",
                "security": OPERATOR,
                "responses": responses(200, json_of["status"], (400, *auth, 404)),
            },
        },
        "/v1/lanes/{lane_id}/work": {
            "parameters": [lane_id],
            "post": {
                "operationId": "lane_work",
                "security": CAPABILITY,
                "requestBody": {"required": True, "content": json_of["work"]},
                "responses": responses(
                    200, json_of["work_reply"], (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
                ),
            },
        },
    }
    octets = content(
        {"type": "string", "contentMediaType": "application/octet-stream"},
        "application/octet-stream",
    )
    buffer_id = path_parameter("buffer_id", BUFFER_ID_PATTERN)
    paths["/v1/lanes/{lane_id}/buffers/{buffer_id}"] = {
        "parameters": [lane_id, buffer_id],
        "put": {
            "operationId": "buffer_upload",
            "security": CAPABILITY,
            "description": (
                "Write the body's bytes into a buffer the token's invocation holds, at"
                f" `offset`; at most {MAX_TRANSFER_BYTES} bytes (413 beyond)."
            ),
            "parameters": [query_integer("offset", 2**62, False)],
            "requestBody": {"required": True, "content": octets},
            "responses": responses(
                200, json_of["work_reply"], (400, 401, 403, 404, 409, 413, 415, 416, 429, 503)
            ),
        },
        "get": {
            "operationId": "buffer_download",
            "security": CAPABILITY,
            "description": (
                "Read `length` bytes from `offset` of a buffer the token's invocation holds;"
                f" at most {MAX_TRANSFER_BYTES} (400 beyond)."
            ),
            "parameters": [
                query_integer("offset", 2**62, False),
                query_integer("length", MAX_TRANSFER_BYTES, True),
            ],
            "responses": responses(200, octets, (400, 401, 403, 404, 409, 416, 429, 503)),
        },
    }
    paths["/v1/invocations/{invocation_id}/logs"] = {
        "parameters": [inv_id],
        "get": {
            "operationId": "invocation_logs",
            "security": OPERATOR,
            "description": (
                "The bytes of one stream of the invocation's output as kept on disk, from"
                " `offset`. Without `follow` the body ends at what is written so far; with"
                " `follow=1` it stays open and carries each byte as it is written, and ends"
                " once the invocation's output is complete and every byte was sent. Kept"
                " after the end (and across restarts) for `--logs-retention` seconds, within"
                " `--logs-max-bytes` per invocation and `--logs-total-bytes` in all, and"
                " above `--state-min-free` of free disk; the status's `logs_cut` says why"
                " bytes are missing. 404 `logs_unavailable`:"
                " the invocation is known but its logs are not kept."
            ),
            "parameters": [
                {
                    "name": "stream",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "enum": ["stdout", "stderr"]},
                },
                query_integer("offset", 2**62, False),
                {
                    "name": "follow",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "enum": [0, 1]},
                },
            ],
            "responses": responses(200, octets, (400, *auth, 404, 429)),
        },
    }
    paths["/v1/lanes/{lane_id}/token"] = {
        "parameters": [lane_id],
        "post": {
            "operationId": "refresh_token",
            "security": CAPABILITY,
            "description": (
                "Trade a valid token of a live invocation for a fresh one, once the token "
                "has used half its life (429 refresh_too_early with Retry-After before)."
            ),
            "responses": responses(200, json_of["token"], (400, 401, 403, 409, 429, 503)),
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
            "responses": responses(200, json_of["keys"], (503,)),
        },
    }
    paths["/v1/tokens/introspect"] = {
        "post": {
            "operationId": "introspect_token",
            "security": OPERATOR,
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
            "responses": responses(200, json_of["introspection"], (400, *auth, 413, 415, 422)),
        },
    }
    for action in ("drain", "resume"):
        paths[f"/v1/lanes/{{lane_id}}/{action}"] = {
            "parameters": [lane_id],
            "post": {
                "operationId": f"{action}_lane",
                "security": OPERATOR,
                "responses": responses(200, json_of["drain"], (400, *auth, 404)),
            },
        }
    # The status page's paths go here, with the component schemas only they use.
    status_paths, status_components = status_openapi()
    paths.update(status_paths)
    paths["/v1/node"] = {
        "get": {
            "operationId": "get_node",
            "security": OPERATOR,
            "responses": responses(200, json_of["node"], auth),
        }
    }
    for action in ("drain", "resume"):
        paths[f"/v1/node/{action}"] = {
            "post": {
                "operationId": f"{action}_node",
                "security": OPERATOR,
                "description": (
                    "Admin only, idempotent. A drained node refuses new submissions with"
                    " 503 `node_draining`, running work goes on, /readyz is 503 and the"
                    " snapshot says `drained`. Kept in memory: a restart admits again."
                ),
                "responses": responses(200, json_of["node"], auth),
            }
        }
    return paths, status_components
