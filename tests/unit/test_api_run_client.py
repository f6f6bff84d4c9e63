"""The `run` client learns that its invocation ended from one wait, not by polling."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
import trio

import api.run_client
from api.run_client import follow_command
from supervisor.wire import InvocationRequest, ProcessWork


def _status(invocation_id: str, state: str, stdout: str = "") -> dict[str, Any]:
    return {
        "id": invocation_id,
        "state": state,
        "requirement": "cpu",
        "isolation": "shared",
        "lanes": [],
        "exit_code": 0 if state == "succeeded" else None,
        "submitted_at": "2026-01-01T00:00:00Z",
        "stdout_tail": stdout,
        "stdout_bytes": len(stdout),
    }


async def test_run_returns_at_the_end_the_wait_reports_without_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    waits = [0]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/invocations":
            body = json.loads(request.content)
            return httpx.Response(
                202, json={"id": body["id"], "state": "queued", "lanes": [], "tokens": {}}
            )
        if request.url.path == "/v1/invocations:wait":
            asked = json.loads(request.content)
            assert 0 < asked["timeout_s"] <= 60
            waits[0] += 1
            if waits[0] == 1:  # still running when the first wait ran out
                return httpx.Response(
                    200, json={"ended": [], "pending": asked["ids"], "unknown": []}
                )
            ended = _status(asked["ids"][0], "succeeded", "hi\n")
            return httpx.Response(200, json={"ended": [ended], "pending": [], "unknown": []})
        invocation_id = request.url.path.rsplit("/", 1)[-1]
        return httpx.Response(200, json=_status(invocation_id, "running", "hi\n"))

    real_client = httpx.AsyncClient

    def client(**kw: Any) -> httpx.AsyncClient:
        return real_client(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(api.run_client.httpx, "AsyncClient", client)
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(5):  # a client that only polls never sees it end here
        request = InvocationRequest(id="run-1", work=ProcessWork(argv=["true"]))
        code = await follow_command("http://node", "s", request, out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == "hi\n"  # printed once, though two reads carried it
    gets = [s for s in seen if s.startswith("GET")]
    assert seen.count("POST /v1/invocations:wait") == 2 and len(gets) == 1
