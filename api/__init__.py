"""The HTTP adapter: Quart-trio app, Hypercorn serving, contracts and OpenAPI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.app import create_app
    from api.errors import (
        ApiError,
        ErrorEnvelope,
    )

__all__ = [
    "ApiError",
    "ErrorEnvelope",
    "create_app",
]

# Imported on first use, so a command that needs one module of the package does not
# pay for all of them (the CLI starts in a fraction of the time).
_WHERE = {
    "create_app": "api.app",
    "ApiError": "api.errors",
    "ErrorEnvelope": "api.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
