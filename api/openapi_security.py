"""The two credentials of the OpenAPI document: the operator secret and capability tokens."""

from __future__ import annotations

from typing import Any

__all__ = ["CAPABILITY", "OPERATOR", "security_schemes"]

# The `security` of an operation: which of security_schemes() it takes.
OPERATOR: list[dict[str, list[str]]] = [{"operator": []}]
CAPABILITY: list[dict[str, list[str]]] = [{"capability": []}]


def security_schemes() -> dict[str, Any]:
    return {
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
    }
