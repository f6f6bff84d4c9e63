"""The OpenAPI paths of the status page and of the two routes only it needs."""

from __future__ import annotations

from typing import Any

import msgspec

from api.device_history import HISTORY_SAMPLES, DeviceHistoryReply
from api.openapi_responses import AUTH_ERRORS, REF, content, responses
from api.openapi_security import OPERATOR
from api.wire import WhoamiReply

__all__ = ["status_openapi"]


def status_openapi() -> tuple[dict[str, Any], dict[str, Any]]:
    """(paths, component schemas)."""
    (whoami, history), components = msgspec.json.schema_components(
        (WhoamiReply, DeviceHistoryReply), ref_template=REF
    )
    paths = {
        "/": {
            "get": {
                "operationId": "status_page",
                "description": (
                    "The workstation status page, on loopback only. Self-contained: its"
                    " Content-Security-Policy allows only its own inline script and style"
                    " and requests to this node, and no framing."
                ),
                "responses": responses(200, content({"type": "string"}, "text/html"), (403,)),
            }
        },
        "/v1/whoami": {
            "get": {
                "operationId": "whoami",
                "security": OPERATOR,
                "description": "The role (`scheduler` or `admin`) of the secret presented.",
                "responses": responses(200, content(whoami), AUTH_ERRORS),
            }
        },
        "/v1/devices/history": {
            "get": {
                "operationId": "device_history",
                "security": OPERATOR,
                "description": (
                    "Recent readings of each device, oldest first: one sample per health"
                    f" probe (every `interval_s` seconds), at most {HISTORY_SAMPLES} per"
                    " device, kept in memory only (empty after a restart). A field is null"
                    " when the probe did not read it."
                ),
                "responses": responses(200, content(history), AUTH_ERRORS),
            }
        },
    }
    return paths, components
