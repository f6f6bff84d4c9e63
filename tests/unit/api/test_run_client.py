"""The `run` client streams the guest's output byte for byte and learns that its
invocation ended from one wait, not by polling."""

from __future__ import annotations

import io
import json
import os
import signal
from typing import Any

import httpx
import pytest
import trio

import api.run_client
from api.run_client import follow_command
from supervisor.wire import InvocationRequest, ProcessWork


def _status(invocation_id: str, state: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": invocation_id,
        "state": state,
        "requirement": "cpu",
        "isolation": "shared",
        "lanes": [],
        "exit_code": 0 if state == "succeeded" else None,
        "submitted_at": "2026-01-01T00:00:00Z",
        **fields,
    }


def _node(
    seen: list[str], logs: dict[str, list[bytes]], state: str = "succeeded", **ended: Any
) -> Any:
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
            done = _status(asked["ids"][0], state, **ended)
            return httpx.Response(200, json={"ended": [done], "pending": [], "unknown": []})
        if request.url.path.endswith("/logs"):
            stream = request.url.params["stream"]
            assert request.url.params["follow"] == "1"
            offset = int(request.url.params["offset"])
            return httpx.Response(200, content=b"".join(logs[stream])[offset:])
        invocation_id = request.url.path.rsplit("/", 1)[-1]
        return httpx.Response(200, json=_status(invocation_id, "running"))

    return handler


def _patch(monkeypatch: pytest.MonkeyPatch, handler: Any) -> None:
    real_client = httpx.AsyncClient

    def client(**kw: Any) -> httpx.AsyncClient:
        return real_client(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(api.run_client.httpx, "AsyncClient", client)


async def test_run_copies_both_streams_and_returns_at_the_end_the_wait_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    big = b"".join(b"%d\n" % n for n in range(1, 200001))
    _patch(monkeypatch, _node(seen, {"stdout": [big], "stderr": [b"warn\n"]}))
    out, err = io.BytesIO(), io.BytesIO()
    with trio.fail_after(5):  # a client that only polls never sees it end here
        request = InvocationRequest(id="run-1", work=ProcessWork(argv=["true"]))
        code = await follow_command("http://node", "s", request, out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == big  # every byte, not a tail
    assert b"warn\n" in err.getvalue()
    assert err.getvalue().rstrip().endswith(b": succeeded")  # said after the last byte
    assert seen.count("POST /v1/invocations:wait") == 2


async def test_run_says_when_the_node_cut_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    handler = _node(seen, {"stdout": [b"abc"], "stderr": []}, logs_cut="write_failed: disk full")
    _patch(monkeypatch, handler)
    out, err = io.BytesIO(), io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-2", work=ProcessWork(argv=["true"]))
        code = await follow_command("http://node", "s", request, out=out, err=err)
    assert code == 0 and out.getvalue() == b"abc"
    assert b"output cut short on the node: write_failed: disk full" in err.getvalue()


class _ClosedPipe(io.BytesIO):
    def write(self, data: Any) -> int:
        raise BrokenPipeError(32, "Broken pipe")


async def test_run_whose_reader_left_cancels_the_invocation_and_exits_141(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    _patch(monkeypatch, _node(seen, {"stdout": [b"1\n2\n"], "stderr": []}))
    err = io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-3", work=ProcessWork(argv=["seq", "9"]))
        code = await follow_command("http://node", "s", request, out=_ClosedPipe(), err=err)
    assert code == 141  # as a shell reports SIGPIPE
    assert any(s.startswith("DELETE /v1/invocations/run-") for s in seen)


@pytest.mark.parametrize(
    ("code", "hinted"), [("invalid_cwd", True), ("invalid_request", False)], ids=str
)
async def test_a_refused_cwd_tells_how_to_send_none(
    monkeypatch: pytest.MonkeyPatch, code: str, hinted: bool
) -> None:
    """`run` sends its current folder by default, which a `serve` without
    --guest-cwd-roots refuses: the refusal says how to run anyway."""
    seen: list[str] = []
    message = "cwd: /srv/x: this node allows no cwd"

    def refusing(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        body = {"error": {"code": code, "message": message, "details": {"field": "cwd"}}}
        return httpx.Response(422, json=body)

    _patch(monkeypatch, refusing)
    err = io.BytesIO()
    request = InvocationRequest(id="run-4", work=ProcessWork(argv=["true"], cwd="/srv/x"))
    with trio.fail_after(5):
        exit_code = await follow_command("http://node", "s", request, out=io.BytesIO(), err=err)
    assert exit_code == 1 and seen == ["POST /v1/invocations"]
    lines = err.getvalue().decode().splitlines()
    assert lines[0] == f"litegraph-node run: refused (422) {code}: {message}"
    assert (lines[1:] == [api.run_client.CWD_HINT]) is hinted, lines
    if hinted:
        assert "--cwd none sends none" in lines[1] and "--guest-cwd-roots" in lines[1]


def _going_away(seen: list[str], cuts: int | None) -> Any:
    """A node that takes the submission, then fails `cuts` requests in a row (every
    one when None: it is gone) before it answers as `_node` does."""
    answer = _node(seen, {"stdout": [b"out\n"], "stderr": []})
    failed = [0]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/invocations" and (cuts is None or failed[0] < cuts):
            failed[0] += 1
            seen.append(f"cut {request.method} {request.url.path}")
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return answer(request)  # type: ignore[no-any-return]

    return handler


async def test_requests_cut_for_a_moment_are_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api.run_client, "RESUME_SECONDS", 0)
    seen: list[str] = []
    _patch(monkeypatch, _going_away(seen, cuts=api.run_client.RESUMES))
    out, err = io.BytesIO(), io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-5", work=ProcessWork(argv=["true"]))
        code = await follow_command("http://node", "s", request, out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == b"out\n" and b"went away" not in err.getvalue()
    assert any(s.startswith("cut ") for s in seen)


async def test_a_node_gone_for_good_is_one_line_and_exit_status_69(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(api.run_client, "RESUME_SECONDS", 0)
    seen: list[str] = []
    _patch(monkeypatch, _going_away(seen, cuts=None))
    err = io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-6", work=ProcessWork(argv=["sleep", "60"]))
        code = await follow_command("http://node", "s", request, out=io.BytesIO(), err=err)
    assert code == api.run_client.NODE_GONE_EXIT == 69
    assert err.getvalue().decode().splitlines() == [
        "run-6: submitted",
        "litegraph-node run: the node at http://node went away before run-6 ended;"
        " how it ended is unknown",
    ]


async def test_an_invocation_the_nodes_shutdown_cancelled_is_said_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    handler = _node(seen, {"stdout": [], "stderr": []}, state="cancelled", reason="shutdown")
    _patch(monkeypatch, handler)
    err = io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-7", work=ProcessWork(argv=["sleep", "60"]))
        code = await follow_command("http://node", "s", request, out=io.BytesIO(), err=err)
    assert code == 130
    assert err.getvalue().decode().splitlines()[-1] == "run-7: cancelled (shutdown)"


async def test_an_ending_the_node_told_before_its_logs_were_cut_is_said_not_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node stops: it answers the wait (cancelled, shutdown), then the log streams
    are cut for good. `run` says how it ended, and that output was lost, never that how
    it ended is unknown."""
    monkeypatch.setattr(api.run_client, "RESUME_SECONDS", 0)
    answered = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/invocations":
            body = json.loads(request.content)
            return httpx.Response(
                202, json={"id": body["id"], "state": "queued", "lanes": [], "tokens": {}}
            )
        if request.url.path == "/v1/invocations:wait":
            done = _status("run-8", "cancelled", reason="shutdown")
            answered.set()
            return httpx.Response(200, json={"ended": [done], "pending": [], "unknown": []})
        if request.url.path.endswith("/logs"):
            await answered.wait()
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(200, json=_status("run-8", "cancelled", reason="shutdown"))

    _patch(monkeypatch, handler)
    err = io.BytesIO()
    with trio.fail_after(5):
        request = InvocationRequest(id="run-8", work=ProcessWork(argv=["sleep", "60"]))
        code = await follow_command("http://node", "s", request, out=io.BytesIO(), err=err)
    said = err.getvalue().decode().splitlines()
    assert code == 130, said
    assert said[-1] == "run-8: cancelled (shutdown)"
    assert any(line.startswith("run-8: the rest of its output was lost") for line in said)
    assert not any("unknown" in line for line in said)


def _cancel_answered(delete: Any) -> Any:
    """A node whose invocation runs until cancelled; `delete` answers the DELETE."""
    inner = _node([], {"stdout": [b"1\n"], "stderr": []})

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            answer: httpx.Response = await delete(request)
            return answer
        if request.url.path == "/v1/invocations:wait":
            await trio.sleep_forever()
        reply: httpx.Response = inner(request)
        return reply

    return handler


async def _left_reader(monkeypatch: pytest.MonkeyPatch, delete: Any) -> list[str]:
    """`run` whose reader left: the lines it said after asking the node to cancel."""
    _patch(monkeypatch, _cancel_answered(delete))
    err = io.BytesIO()
    request = InvocationRequest(id="run-9", work=ProcessWork(argv=["sleep", "60"]))
    code = await follow_command("http://node", "s", request, out=_ClosedPipe(), err=err)
    assert code == 141
    return err.getvalue().decode().split()[3:]  # after "run-9: submitted" and "run-9:"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ({"state": "cancelled", "reason": "cancel_requested"}, ["cancelled", "(cancel_requested)"]),
        ({"state": "succeeded"}, ["succeeded"]),  # it had ended before the cancel
    ],
)
async def test_a_cancel_says_the_state_the_node_answered(
    monkeypatch: pytest.MonkeyPatch, answer: dict[str, str], said: list[str]
) -> None:
    async def answered(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status("run-9", **answer))

    with trio.fail_after(5):
        assert await _left_reader(monkeypatch, answered) == said


async def test_a_refused_cancel_says_why_not_that_it_was_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refused(request: httpx.Request) -> httpx.Response:
        error = {"error": {"code": "cancel_timeout", "message": "it is being killed"}}
        return httpx.Response(503, json=error)

    with trio.fail_after(5):
        said = " ".join(await _left_reader(monkeypatch, refused))
    assert said.startswith("not cancelled: (503)") and "cancel_timeout" in said, said


async def test_a_cancel_the_node_never_answers_says_so_after_its_bound(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async def silent(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    start = trio.current_time()
    said = " ".join(await _left_reader(monkeypatch, silent))
    assert trio.current_time() - start == pytest.approx(api.run_client.REQUEST_SECONDS, abs=1)
    assert said == "not cancelled: the node at http://node did not answer in 15 s"
    assert "went away" not in said


async def test_a_cancel_answer_that_cannot_be_read_is_not_taken_for_a_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def garbled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>proxy</html>")

    with trio.fail_after(5):
        said = " ".join(await _left_reader(monkeypatch, garbled))
    assert said == "not cancelled: the node's answer could not be read"


async def _interrupted(
    monkeypatch: pytest.MonkeyPatch, delete: Any, interrupts: int
) -> tuple[int, list[str]]:
    """`run` given `interrupts` Ctrl-Cs (real SIGINTs), the next once the node has the
    DELETE: its exit status and what it said after "submitted"."""
    deleting = trio.Event()

    async def seen(request: httpx.Request) -> httpx.Response:
        deleting.set()
        answer: httpx.Response = await delete(request)
        return answer

    _patch(monkeypatch, _cancel_answered(seen))
    err = io.BytesIO()

    async def interrupt() -> None:
        while b"submitted" not in err.getvalue():  # noqa: ASYNC110 - its receiver is open then
            await trio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        if interrupts > 1:
            await deleting.wait()
            os.kill(os.getpid(), signal.SIGINT)

    code = await _run_while(interrupt, err)
    return code, err.getvalue().decode().splitlines()[1:]


async def _run_while(meanwhile: Any, err: io.BytesIO) -> int:
    """`run -- sleep 60` (id run-9) to its end, `meanwhile` beside it; its status."""
    request = InvocationRequest(id="run-9", work=ProcessWork(argv=["sleep", "60"]))
    code: list[int] = []

    async def run() -> None:
        code.append(await follow_command("http://node", "s", request, out=io.BytesIO(), err=err))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await meanwhile()
    return code[0]


async def test_ctrl_c_cancels_the_invocation_and_says_what_the_node_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def answered(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status("run-9", "cancelled", reason="cancel_requested"))

    code, said = await _interrupted(monkeypatch, answered, 1)
    assert (code, said[-1]) == (130, "run-9: cancelled (cancel_requested)"), said


async def test_a_second_ctrl_c_during_the_cancel_stops_waiting_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def silent(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    code, said = await _interrupted(monkeypatch, silent, 2)
    assert (code, said[-1]) == (130, f"run-9: {api.run_client.SECOND_INTERRUPT}"), said


async def test_ctrl_c_while_the_submission_is_on_its_way_cancels_what_the_node_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    posting, interrupted, deleted = trio.Event(), trio.Event(), []
    inner = _cancel_answered(None)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posting.set()
            await interrupted.wait()  # the node takes it while Ctrl-C comes
        if request.method == "DELETE":
            deleted.append(request.url.path)
            return httpx.Response(
                200, json=_status("run-9", "cancelled", reason="cancel_requested")
            )
        reply: httpx.Response = await inner(request)
        return reply

    _patch(monkeypatch, handler)
    err = io.BytesIO()

    async def interrupt() -> None:
        await posting.wait()  # follow_command's receiver is open by then
        os.kill(os.getpid(), signal.SIGINT)
        await trio.sleep(0.05)  # delivered to the receiver
        interrupted.set()

    code = await _run_while(interrupt, err)
    said = err.getvalue().decode().splitlines()
    assert (code, deleted) == (130, ["/v1/invocations/run-9"]), said
    assert said[-1] == "run-9: cancelled (cancel_requested)"
