"""Every HTTP route is in the OpenAPI document, and every operation there has a
summary and tags: the API reference page (/docs) is built from them."""

from __future__ import annotations

import re

from api.app import create_app
from api.context import NodeContext
from api.metrics import NodeMetrics
from api.openapi import openapi_document
from api.settings import HttpSettings
from machine.readiness import Readiness

METHODS = {"get", "put", "post", "delete", "patch"}
HOW = "give it a `summary` and `tags` in api/openapi_operations.py (an entry in OPERATIONS there)"


def _operations() -> list[tuple[str, str, dict[str, object]]]:
    return [
        (method, path, operation)
        for path, item in openapi_document()["paths"].items()
        for method, operation in item.items()
        if method in METHODS
    ]


def test_every_operation_has_a_summary_and_declared_tags() -> None:
    document = openapi_document()
    declared = {tag["name"] for tag in document["tags"]}
    assert all(tag.get("description") for tag in document["tags"])
    problems = []
    for method, path, operation in _operations():
        summary, tags = operation.get("summary"), operation.get("tags")
        if not isinstance(summary, str) or not summary.strip() or len(summary) > 80:
            problems.append(f"{method.upper()} {path}: no summary (one line, at most 80)")
        if not isinstance(tags, list) or not tags or not set(tags) <= declared:
            problems.append(f"{method.upper()} {path}: tags {tags!r}, not from {sorted(declared)}")
    assert not problems, f"{HOW}:\n" + "\n".join(problems)
    summaries = [operation["summary"] for _m, _p, operation in _operations()]
    assert len(summaries) == len(set(summaries)), "two operations share a summary"


def _routes() -> set[tuple[str, str]]:
    """Every (method, OpenAPI path) the application answers."""
    settings = HttpSettings(
        listen="127.0.0.1:0", read_timeout=5, body_timeout=5, keep_alive=5, metrics_auth=False
    )
    app = create_app(NodeContext(http=settings, readiness=Readiness(()), metrics=NodeMetrics()))
    routes = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        routes |= {(m.lower(), path) for m in rule.methods or () if m.lower() in METHODS}
    return routes


def test_every_route_is_in_the_openapi_document_and_nothing_else_is() -> None:
    documented = {(method, path) for method, path, _op in _operations()}
    missing = sorted(_routes() - documented)
    assert not missing, (
        f"routes not in the OpenAPI document: {missing}; add each to api/openapi_paths.py and {HOW}"
    )
    assert not documented - _routes(), "documented operations that no route answers"
