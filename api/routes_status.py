"""The workstation status page and the two small routes only it needs.

The page is one self-contained file (`static/index.html`): no fetch leaves
the node, which its Content-Security-Policy enforces (`connect-src 'self'`,
the inline script and style allowed by hash only). It authenticates the way
every client does, with an operator secret in the `Authorization` header,
kept in the tab's sessionStorage; no cookie is ever set, so a cross-site
request cannot carry a credential (no CSRF), and `frame-ancestors 'none'`
keeps the admin buttons from being framed (no clickjacking).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import re

from quart import Response
from quart_trio import QuartTrio

from api.context import NodeContext
from api.errors import ApiError
from api.http import ANY_OPERATOR, is_loopback, require_role
from api.responses import json_response
from api.wire import WhoamiReply

__all__ = ["page_policy", "register_status_routes"]

_STATUS_PAGE = importlib.resources.files("api").joinpath("static/index.html")


def _hashes(page: str, tag: str) -> str:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests)


def page_policy(page: str) -> str:
    """The Content-Security-Policy of the page: its own inline blocks, the node, nothing else."""
    return "; ".join(
        (
            "default-src 'none'",
            f"script-src {_hashes(page, 'script')}",
            f"style-src {_hashes(page, 'style')}",
            "connect-src 'self'",
            "img-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


def register_status_routes(app: QuartTrio, ctx: NodeContext) -> None:
    page = _STATUS_PAGE.read_text(encoding="utf-8")
    headers = {
        "Content-Security-Policy": page_policy(page),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }

    @app.get("/")
    async def status_page() -> Response:
        if not is_loopback():
            raise ApiError(403, "loopback_only", "the status page is served on loopback only")
        return Response(page, content_type="text/html; charset=utf-8", headers=headers)

    @app.get("/v1/whoami")
    async def whoami() -> Response:
        role = require_role(ctx, ANY_OPERATOR)
        return json_response(WhoamiReply(role=role.value))

    @app.get("/v1/devices/history")
    async def device_history() -> Response:
        require_role(ctx, ANY_OPERATOR)
        if ctx.history is None:
            raise ApiError(503, "not_ready", "the node is starting")
        return json_response(ctx.history.reply())
