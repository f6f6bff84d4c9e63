"""`ls` pages through the daemon's list with its cursor until --limit is shown."""

from __future__ import annotations

import io
import json
import pathlib
from typing import Any

import httpx
import pytest

import node.client_commands
from node.client import Target
from node.client_commands import cmd_ls


def _status(invocation_id: str) -> dict[str, Any]:
    return {
        "id": invocation_id,
        "state": "succeeded",
        "requirement": "cpu",
        "isolation": "shared",
        "lanes": [],
        "submitted_at": "2026-01-01T00:00:00.000Z",
    }


@pytest.mark.parametrize(("limit", "pages"), [(5, 3), (3, 2), (10, 4)])
def test_ls_follows_the_cursor_until_the_limit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, limit: int, pages: int
) -> None:
    ids = [f"inv-{n}" for n in range(7)]  # newest first, as the daemon lists them
    asked: list[dict[str, list[str]]] = []

    def answer(method: str, url: str, **kw: Any) -> httpx.Response:
        query = httpx.QueryParams(kw["params"])
        asked.append({k: query.get_list(k) for k in query})
        start = int(query.get("cursor") or 0)
        size = int(query["limit"])
        more = start + size < len(ids)
        body = {
            "invocations": [_status(i) for i in ids[start : start + size]],
            "next_cursor": str(start + size) if more else None,
        }
        return httpx.Response(200, json=body)

    monkeypatch.setattr(httpx, "request", answer)
    monkeypatch.setattr(node.client_commands, "MAX_LIST_LIMIT", 2)
    monkeypatch.setattr(Target, "secret", lambda self, role=None: "s")
    out = io.StringIO()
    options = {"state": "succeeded,failed", "limit": limit, "json": True}
    assert cmd_ls(Target(url="http://node", auth_file=tmp_path), options, [], out) == 0
    shown = json.loads(out.getvalue())
    assert [inv["id"] for inv in shown["invocations"]] == ids[:limit]
    assert len(asked) == pages
    assert all(a["state"] == ["succeeded", "failed"] for a in asked)
    assert all(int(a["limit"][0]) <= 2 for a in asked)
    assert (shown["next_cursor"] is None) == (limit >= len(ids))
