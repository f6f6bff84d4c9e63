"""An invocation id runs at most once, across restarts too: the journal remembers how
ended invocations ended (bounded in count and time), and a resubmission answers that."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from node.machine.journal import RETAIN_ENDED_SECONDS, EndedRecord, Journal
from supervisor.admission import AdmissionRefused
from supervisor.core import UnknownInvocation
from supervisor.remembered import request_digest
from supervisor.wire import InvocationRequest, InvocationState
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
    tmp_path: Path, request: InvocationRequest, *, ended_at: float, outcome: bytes
) -> None:
    """What an earlier daemon on this state dir journaled when `request` ended."""
    journal, _ = Journal.open(tmp_path / "state")
    journal.record_ended(
        EndedRecord(
            invocation_id=request.id,
            request_digest=request_digest(request),
            ended_at=ended_at,
            outcome=outcome,
        )
    )
    journal.close()


async def test_an_id_ended_before_the_window_runs_again(tmp_path: Path) -> None:
    request = builtin("old", "echo", text="hi")
    _journal_ended(
        tmp_path, request, ended_at=time.time() - RETAIN_ENDED_SECONDS - 1, outcome=b"{}"
    )
    async with open_rig(tmp_path) as rig:
        with pytest.raises(UnknownInvocation):
            rig.sup.get("old")
        assert (await rig.sup.submit(request)).state is S.queued
        assert await rig.wait_terminal("old") is S.succeeded


async def test_an_unreadable_recorded_outcome_still_keeps_the_id(tmp_path: Path) -> None:
    request = builtin("odd", "echo", text="hi")
    _journal_ended(tmp_path, request, ended_at=time.time(), outcome=b"not json")
    async with open_rig(tmp_path) as rig:
        answer = await rig.sup.submit(request)
        assert answer.state is S.failed and rig.invocation_events("odd") == []
        assert rig.sup.get("odd").reason == "recorded_outcome_unreadable"
