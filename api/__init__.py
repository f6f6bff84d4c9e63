"""The HTTP adapter: Quart-trio app, Hypercorn serving, contracts and OpenAPI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from machine.lazy_exports import lazy_exports

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

__getattr__ = lazy_exports(__name__, _WHERE)
