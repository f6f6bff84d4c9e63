"""An invocation id runs at most once, across restarts too: the journal remembers how
ended invocations ended (bounded in count and time), and a resubmission answers that."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from machine.journal import LISTED_ENDED, WINDOW_S, EndedRecord, Journal
from machine.lanes import Isolation, Requirement
from supervisor.admission import AdmissionRefused
from supervisor.core import UnknownInvocation
from supervisor.listing import ListQuery
from supervisor.remembered import request_digest
from supervisor.wire import InvocationRequest, InvocationState, InvocationStatus
from tests.supervisor_fixtures import builtin, open_rig

S = InvocationState


async def test_an_ended_id_resubmitted_after_a_restart_answers_its_recorded_outcome(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path) as rig:
        first = await rig.sup.submit(builtin("once", "echo", text="hi", n={"b": 1, "a": 2}))
        assert await rig.wait_terminal("once") is S.succeeded
        before = rig.sup.get("once")
        await rig.sup.submit(builtin("broken", "fail"))
        assert await rig.wait_terminal("broken") is S.failed
        broken = rig.sup.get("broken")
    async with open_rig(tmp_path) as rig:  # a restart on the same state dir
        # The same body (a dict's key order does not matter): the recorded outcome.
        again = await rig.sup.submit(builtin("once", "echo", text="hi", n={"a": 2, "b": 1}))
        assert (again.id, again.state, again.lanes) == ("once", S.succeeded, first.lanes)
        assert again.tokens == {}  # the first run's tokens died with the old key
        status = rig.sup.get("once")
        assert status.state is S.succeeded and status.exit_code == 0
        assert (status.submitted_at, status.ended_at) == (before.submitted_at, before.ended_at)
        assert status.stdout_bytes == before.stdout_bytes  # counted; the text is not kept
        assert (await rig.sup.submit(builtin("broken", "fail"))).state is S.failed
        assert rig.sup.get("broken").reason == broken.reason is not None
        # Nothing ran again and nothing is held.
        assert rig.invocation_events("once") == [] and rig.invocation_events("broken") == []
        rig.assert_baseline()
        # Another body under a remembered id is a conflict, as before the restart.
        with pytest.raises(AdmissionRefused) as refused:
            await rig.sup.submit(builtin("once", "echo", text="bye"))
        assert (refused.value.status, refused.value.reason) == (409, "id_conflict")
        rig.assert_baseline()


def _journal_ended(
    tmp_path: Path,
    request: InvocationRequest,
    *,
    ended_at: float,
    outcome: bytes,
    node_seconds_since: float = 0.0,
) -> None:
    """What an earlier daemon on this state dir journaled when `request` ended, and
    `node_seconds_since`: how long it then ran on."""
    now = [0.0]
    journal, _ = Journal.open(tmp_path / "state", clock=lambda: now[0])
    journal.record_ended(
        EndedRecord(
            invocation_id=request.id,
            request_digest=request_digest(request),
            ended_at=ended_at,
            outcome=outcome,
        )
    )
    journal.compact()  # into the index, at that node time
    now[0] += node_seconds_since
    journal.close()


async def test_an_id_ended_before_the_window_of_node_time_runs_again(tmp_path: Path) -> None:
    request = builtin("old", "echo", text="hi")
    _journal_ended(
        tmp_path, request, ended_at=time.time(), outcome=b"{}", node_seconds_since=WINDOW_S + 1
    )
    async with open_rig(tmp_path) as rig:
        with pytest.raises(UnknownInvocation):
            rig.sup.get("old")
        assert (await rig.sup.submit(request)).state is S.queued
        assert await rig.wait_terminal("old") is S.succeeded


async def test_a_wall_clock_step_past_the_window_forgets_no_id(tmp_path: Path) -> None:
    """The node was down, or the clock stepped 25 h forward: node time did not move."""
    request = builtin("stepped", "echo", text="hi")
    _journal_ended(
        tmp_path,
        request,
        ended_at=time.time() - 25 * 3600,
        outcome=b"{}",
        node_seconds_since=WINDOW_S - 60,
    )
    async with open_rig(tmp_path) as rig:
        answer = await rig.sup.submit(request)
        assert answer.state is S.failed and rig.invocation_events("stepped") == []
        with pytest.raises(AdmissionRefused) as refused:
            await rig.sup.submit(builtin("stepped", "echo", text="other"))
        assert refused.value.reason == "id_conflict"


async def test_an_unreadable_recorded_outcome_still_keeps_the_id(tmp_path: Path) -> None:
    request = builtin("odd", "echo", text="hi")
    _journal_ended(tmp_path, request, ended_at=time.time(), outcome=b"not json")
    async with open_rig(tmp_path) as rig:
        answer = await rig.sup.submit(request)
        assert answer.state is S.failed and rig.invocation_events("odd") == []
        assert rig.sup.get("odd").reason == "recorded_outcome_unreadable"


EVERYTHING = ListQuery(limit=10**6)


async def test_ended_invocations_are_listed_after_a_restart_as_they_ended(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.sup.submit(builtin("fine", "echo", text="hi"))
        assert await rig.wait_terminal("fine") is S.succeeded
        await rig.sup.submit(builtin("broken", "fail"))
        assert await rig.wait_terminal("broken") is S.failed
        await rig.sup.submit(builtin("stopped", "sleep", seconds=60))
        assert (await rig.sup.cancel("stopped")).state is S.cancelled
        before = {s.id: s for s in rig.sup.list_page(EVERYTHING).invocations}
    async with open_rig(tmp_path) as rig:  # a restart on the same state dir
        listed = rig.sup.list_page(EVERYTHING).invocations
        assert [s.id for s in listed] == ["stopped", "broken", "fine"]  # newest first
        for status in listed:
            old = before[status.id]
            # The outcome and its times as they were; the output text is not kept.
            assert status == msgspec.structs.replace(old, stdout_tail="", stderr_tail="")
            assert rig.sup.get(status.id) == status
        assert (listed[1].reason, listed[2].exit_code) == (before["broken"].reason, 0)
        assert listed[0].reason == "cancel_requested"
        failed = rig.sup.list_page(ListQuery(states=frozenset({S.failed}))).invocations
        assert [s.id for s in failed] == ["broken"]
        # A new run's invocations come first; the old ones still follow, once each.
        await rig.sup.submit(builtin("new", "echo", text="hi"))
        assert await rig.wait_terminal("new") is S.succeeded
        ids = [s.id for s in rig.sup.list_page(EVERYTHING).invocations]
        assert ids == ["new", "stopped", "broken", "fine"]


def _remembered(tmp_path: Path, records: list[EndedRecord]) -> None:
    journal, _ = Journal.open(tmp_path / "state", durable=False)
    journal.append_batch(records)
    journal.close()


def _ended(n: int, ended_at: float, outcome: bytes | None = None) -> EndedRecord:
    at = f"2026-01-01T00:{n // 60 % 60:02d}:{n % 60:02d}.{n // 3600:03d}Z"
    status = InvocationStatus(
        id=f"old-{n}",
        state=S.succeeded,
        requirement=Requirement.CPU,
        isolation=Isolation.SHARED,
        lanes=[],
        exit_code=0,
        submitted_at=at,
        ended_at=at,
    )
    return EndedRecord(
        invocation_id=f"old-{n}",
        request_digest="0" * 64,
        ended_at=ended_at,
        outcome=msgspec.json.encode(status) if outcome is None else outcome,
    )


async def test_the_history_listed_over_restarts_is_bounded_in_count_and_age(
    tmp_path: Path,
) -> None:
    now = time.time()
    stale = _ended(0, now - WINDOW_S - 60)
    _remembered(tmp_path, [stale, *(_ended(n, now) for n in range(1, LISTED_ENDED + 6))])
    async with open_rig(tmp_path) as rig:
        listed = rig.sup.list_page(EVERYTHING).invocations
        # The newest 4,096 that ended in the last 24 h: the 5 oldest and the stale one go.
        assert len(listed) == LISTED_ENDED
        assert {s.id for s in listed} == {f"old-{n}" for n in range(6, LISTED_ENDED + 6)}
        # Not listed, still remembered: its id is taken for the whole window.
        assert rig.sup.get("old-5").state is S.succeeded


async def test_an_unreadable_recorded_outcome_is_listed_not_dropped(tmp_path: Path) -> None:
    _remembered(tmp_path, [_ended(1, time.time(), outcome=b"not json")])
    async with open_rig(tmp_path) as rig:
        listed = rig.sup.list_page(EVERYTHING).invocations
        assert [(s.id, s.state, s.reason) for s in listed] == [
            ("old-1", S.failed, "recorded_outcome_unreadable")
        ]
