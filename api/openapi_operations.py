"""How the reference page (/docs) groups and names operations: the tags, and each
operation's tag and one-line summary by operationId."""

from __future__ import annotations

from typing import Any

__all__ = ["OPERATIONS", "TAGS", "summarize"]

# The groups of the reference page, in its order.
TAGS = {
    "invocations": "Run work on this node: submit, list, read, wait for and cancel invocations.",
    "lanes": "Work on a lane and its buffers with a capability token; drain and resume lanes.",
    "tokens": "Capability tokens: refresh one, the keys that verify them, introspection.",
    "node": "The node's health, readiness, state, events, metrics and status page.",
    "docs": "This document and the reference page rendered from it.",
}
# operationId -> (tag, summary). A new operation needs an entry (tests/unit/api/test_openapi.py).
OPERATIONS = {
    "healthz": ("node", "Liveness: the process answers"),
    "readyz": ("node", "Readiness, with the reasons while not ready"),
    "metrics": ("node", "Prometheus metrics"),
    "status_page": ("node", "The status page (loopback only)"),
    "get_snapshot": ("node", "Devices, lanes, capacity and health now"),
    "whoami": ("node", "The role of the secret presented"),
    "get_node": ("node", "Readiness, drain and invocation counts of the node"),
    "drain_node": ("node", "Drain the whole node: no new work anywhere (admin)"),
    "resume_node": ("node", "Resume a drained node (admin)"),
    "device_history": ("node", "Recent readings of each device"),
    "events": ("node", "Stream state changes as server-sent events"),
    "openapi": ("docs", "This OpenAPI document"),
    "api_docs": ("docs", "The API reference page, rendered from this document"),
    "api_docs_asset": ("docs", "A file of the API reference page"),
    "submit_invocation": ("invocations", "Submit an invocation"),
    "list_invocations": ("invocations", "List invocations, newest first, a page at a time"),
    "submit_invocation_batch": ("invocations", "Submit up to 256 invocations at once"),
    "wait_invocations": ("invocations", "Wait until invocations have ended"),
    "get_invocation": ("invocations", "Read an invocation's status and output"),
    "cancel_invocation": ("invocations", "Cancel an invocation"),
    "invocation_logs": ("invocations", "Read or follow an invocation's output as kept on disk"),
    "lane_work": ("lanes", "Reserve or release lane memory, or run a kernel"),
    "buffer_upload": ("lanes", "Write bytes into a buffer"),
    "buffer_download": ("lanes", "Read bytes from a buffer"),
    "drain_lane": ("lanes", "Drain a lane: no new work on it (admin)"),
    "resume_lane": ("lanes", "Resume a drained lane (admin)"),
    "refresh_token": ("tokens", "Trade a capability token for a fresh one"),
    "get_keys": ("tokens", "The keys that verify this node's tokens"),
    "introspect_token": ("tokens", "Is this token active now? (RFC 7662)"),
}


def summarize(paths: dict[str, Any]) -> None:
    """Give each operation its summary and tag from OPERATIONS (an operation written
    with its own keeps them; one with neither fails tests/unit/api/test_openapi.py)."""
    for item in paths.values():
        for method, operation in item.items():
            if method == "parameters" or operation["operationId"] not in OPERATIONS:
                continue
            tag, summary = OPERATIONS[operation["operationId"]]
            operation.setdefault("summary", summary)
            operation.setdefault("tags", [tag])
