"""The OpenAPI 3.1 document, built from the msgspec wire types (never written by hand).

Each endpoint lists every status it can answer with; every error body is the
one ErrorEnvelope. Every operation has a one-line summary and a tag
(`OPERATIONS`, by operationId), which the reference page at /docs shows.
`litegraph-node contracts --check` covers this document.

This module puts the document together; its parts are built beside it:
api/openapi_paths.py (the routes; the status page's in api/openapi_status.py),
api/openapi_schemas.py (the component schemas), api/openapi_operations.py (tags
and summaries), api/openapi_responses.py, api/openapi_parameters.py and
api/openapi_security.py.
"""

from __future__ import annotations

from typing import Any

from api.openapi_operations import OPERATIONS, TAGS, summarize
from api.openapi_paths import DOCS_ASSETS, openapi_paths
from api.openapi_schemas import wire_schemas
from api.openapi_security import security_schemes

__all__ = ["DOCS_ASSETS", "OPERATIONS", "TAGS", "openapi_document"]


def openapi_document() -> dict[str, Any]:
    ref, components = wire_schemas()
    paths, path_components = openapi_paths(ref)
    components.update(path_components)
    summarize(paths)
    return {
        "openapi": "3.1.0",
        # OpenAPI's own dialect (JSON Schema 2020-12 plus `discriminator`, which the
        # tagged unions use), also the default every renderer supports.
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "info": {
            "title": "litegraph-node",
            "version": "1",
            "description": (
                "A per-machine compute daemon: the scheduler submits invocations with an"
                " operator secret; work reaches its lanes with the capability tokens it"
                " was given. Every error is an `ErrorEnvelope` with a stable `code`."
            ),
        },
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()],
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": security_schemes()},
    }
