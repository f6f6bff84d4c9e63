"""The HTTP adapter: Quart-trio app, Hypercorn serving, contracts and OpenAPI."""

from api.app import create_app
from api.errors import ApiError, ErrorEnvelope

__all__ = ["ApiError", "ErrorEnvelope", "create_app"]
