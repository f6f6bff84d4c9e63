"""For verifiers outside the daemon: the public keys, and whether a token is active.

`GET /v1/keys` needs no credential: like a JWKS document it holds public keys
only, and a host must be able to fetch them before it holds anything.
`POST /v1/tokens/introspect` (RFC 7662) is for operators only, so a guest
holding one token cannot probe others. A token it would refuse is
`{"active": false}`, whatever the reason; the token itself is never logged.
"""

from __future__ import annotations

import urllib.parse
from typing import cast

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.http import ANY_OPERATOR, decode_json, ready_supervisor, require_role
from api.responses import json_response
from api.wire import IntrospectionRequest

__all__ = ["MAX_INTROSPECT_BODY", "register_key_routes"]

#: A token is at most 4 KiB; this leaves room for the JSON or form around it.
MAX_INTROSPECT_BODY = 8 * 1024
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
_FORM_FIELDS = 4  # token, token_type_hint and a little slack; more is refused


def _too_large() -> ApiError:
    return ApiError(
        413,
        "request_entity_too_large",
        f"an introspection request is at most {MAX_INTROSPECT_BODY} bytes",
        {"limit": MAX_INTROSPECT_BODY},
    )


def _from_form(body: bytes) -> IntrospectionRequest:
    try:
        pairs = urllib.parse.parse_qsl(
            body.decode("ascii"),
            keep_blank_values=True,
            strict_parsing=True,
            max_num_fields=_FORM_FIELDS,
        )
    except (UnicodeDecodeError, ValueError):
        raise ApiError(400, "malformed_form", "not application/x-www-form-urlencoded") from None
    fields = dict(pairs)
    if len(fields) != len(pairs):
        # RFC 6749 section 3.2: a parameter must not be sent twice.
        raise ApiError(400, "malformed_form", "a parameter is repeated")
    try:
        return msgspec.convert(fields, IntrospectionRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None


async def _introspection_request() -> IntrospectionRequest:
    length = request.content_length
    if length is not None and length > MAX_INTROSPECT_BODY:
        raise _too_large()
    mimetype = request.mimetype
    if mimetype not in (JSON, FORM):
        raise ApiError(415, "unsupported_media_type", f"send {JSON} or {FORM}")
    # The app's body cap bounds what is read; a chunked body has no length to check first.
    body = cast(bytes, await request.get_data(as_text=False))
    if len(body) > MAX_INTROSPECT_BODY:
        raise _too_large()
    if mimetype == FORM:
        return _from_form(body)
    asked: IntrospectionRequest = decode_json(body, IntrospectionRequest)
    return asked


def register_key_routes(app: QuartTrio, ctx: NodeContext) -> None:
    @app.get("/v1/keys")
    async def keys() -> Response:
        tokens = ready_supervisor(ctx).tokens
        # Verifiers re-read the set when they meet a kid they do not know.
        return json_response(tokens.key_set(), headers={"Cache-Control": "no-cache"})

    @app.post("/v1/tokens/introspect")
    async def introspect() -> Response:
        require_role(ctx, ANY_OPERATOR)
        tokens = ready_supervisor(ctx).tokens
        asked = await _introspection_request()
        return json_response(tokens.introspect(asked.token), headers={"Cache-Control": "no-store"})
