"""GET /docs: the OpenAPI document as a page to read, from files shipped with the node.

The page is Swagger UI (api/static/docs/, vendored unchanged, its licence
beside it) reading /openapi.json. Nothing comes from elsewhere: the page's
Content-Security-Policy allows scripts, styles, fetches and fonts from this
origin only (images also as data: URLs, which the stylesheet's icons are), so
it works offline and a tampered document cannot pull anything in. It holds no
secret and sends no request with one ("Try it out" is off).
"""

from __future__ import annotations

import importlib.resources

from quart import Response
from quart_trio import QuartTrio

from api.errors import ApiError
from api.openapi import DOCS_ASSETS

__all__ = ["DOCS_CSP", "register_docs_routes"]

DOCS_CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
_HEADERS = {
    "Content-Security-Policy": DOCS_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_FILES = importlib.resources.files("api").joinpath("static/docs")


def register_docs_routes(app: QuartTrio) -> None:
    # Read once: about 2 MB, and a missing file stops start-up rather than a request.
    page = _FILES.joinpath("index.html").read_bytes()
    assets = {name: _FILES.joinpath(name).read_bytes() for name in DOCS_ASSETS}

    @app.get("/docs")
    async def api_docs() -> Response:
        return Response(page, content_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/docs/<asset>")
    async def api_docs_asset(asset: str) -> Response:
        body = assets.get(asset)
        if body is None:
            raise ApiError(404, "not_found", "no such file of the reference page")
        return Response(body, content_type=DOCS_ASSETS[asset], headers=_HEADERS)
