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


def test_ls_shows_command_state_duration_and_lanes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane = {"lane_id": "lane_0123456789abcdef", "kind": "gpu", "vram_bytes": 0}
    process = {
        **_status("train-7"),
        "state": "running",
        "command": {"kind": "process", "argv": ["python", "train.py", "a b\nc"], "argc": 3},
        "lanes": [lane],
        "duration_s": 125.5,
    }
    cut = {
        **_status("long-args"),
        "command": {"kind": "process", "argv": ["x" * 100], "argc": 30, "argv_cut": True},
        "duration_s": 0.25,
    }
    builtin = {**_status("nap"), "command": {"kind": "builtin", "name": "sleep"}}
    body = {"invocations": [process, cut, builtin], "next_cursor": None}
    monkeypatch.setattr(httpx, "request", lambda *a, **kw: httpx.Response(200, json=body))
    monkeypatch.setattr(Target, "secret", lambda self, role=None: "s")
    out = io.StringIO()
    options = {"state": "", "limit": 10, "json": False}
    assert cmd_ls(Target(url="http://node", auth_file=tmp_path), options, [], out) == 0
    header, *rows = out.getvalue().splitlines()
    assert header.split() == [
        "ID", "STATE", "REASON", "EXIT", "DURATION", "LANES", "SUBMITTED", "COMMAND"
    ]  # fmt: skip
    words = rows[0].split()
    assert words[:6] == ["train-7", "running", "-", "-", "2m05s", "gpu:lane_0123456789abcdef"]
    # The argv as a shell reads it, on one line (a newline escaped).
    assert rows[0].endswith("python train.py 'a b\\nc'")
    assert rows[1].split()[4:6] == ["0.25s", "-"]
    assert rows[1].endswith("…") and len(rows[1].split()[-1]) == 60  # cut to the column
    assert rows[2].split()[4] == "-" and rows[2].endswith("builtin:sleep")
