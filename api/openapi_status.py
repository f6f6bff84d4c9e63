"""The OpenAPI paths of the status page and of the two routes only it needs."""

from __future__ import annotations

from typing import Any

import msgspec

from api.device_history import HISTORY_SAMPLES, DeviceHistoryReply
from api.wire import WhoamiReply

__all__ = ["status_openapi"]


def status_openapi(
    ref_template: str, responses: Any, operator: list[dict[str, list[str]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(paths, component schemas); `responses(ok, body, errors)` builds a responses object."""
    (whoami, history), components = msgspec.json.schema_components(
        (WhoamiReply, DeviceHistoryReply), ref_template=ref_template
    )
    auth = (401, 403, 503)
    paths = {
        "/": {
            "get": {
                "operationId": "status_page",
                "description": (
                    "The workstation status page, on loopback only. Self-contained: its"
                    " Content-Security-Policy allows only its own inline script and style"
                    " and requests to this node, and no framing."
                ),
                "responses": responses(200, {"text/html": {"schema": {"type": "string"}}}, (403,)),
            }
        },
        "/v1/whoami": {
            "get": {
                "operationId": "whoami",
                "security": operator,
                "description": "The role (`scheduler` or `admin`) of the secret presented.",
                "responses": responses(200, {"application/json": {"schema": whoami}}, auth),
            }
        },
        "/v1/devices/history": {
            "get": {
                "operationId": "device_history",
                "security": operator,
                "description": (
                    "Recent readings of each device, oldest first: one sample per health"
                    f" probe (every `interval_s` seconds), at most {HISTORY_SAMPLES} per"
                    " device, kept in memory only (empty after a restart). A field is null"
                    " when the probe did not read it."
                ),
                "responses": responses(200, {"application/json": {"schema": history}}, auth),
            }
        },
    }
    return paths, components
