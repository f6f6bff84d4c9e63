"""An id that ended is remembered for the idempotency window, whatever the rate.

The node once remembered the newest 4,096 endings: after 4,200 other invocations
ended (1.1 s at the load test's rate) the same id and body ran a second time.
Now endings are kept on disk for the window, and when the window cannot hold
another id, new work is refused (503 `idempotency_full`) rather than an id
forgotten.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from machine.journal import EndedRecord
from supervisor.admission import AdmissionRefused
from supervisor.core import UnknownInvocation
from supervisor.wire import InvocationState as S
from supervisor.wire import InvocationStatus
from tests.supervisor_fixtures import Rig, builtin, open_rig

OTHERS = 5000


async def _others_end(rig: Rig, count: int) -> None:
    """`count` other invocations end, as their endings reach the journal."""
    outcome = msgspec.json.encode(
        InvocationStatus(
            id="other",
            state=S.succeeded,
            requirement=builtin("x").requirement,
            isolation=builtin("x").isolation,
            lanes=[],
            submitted_at="2026-01-01T00:00:00Z",
        )
    )
    records = [
        EndedRecord(
            invocation_id=f"other-{n}",
            request_digest="0" * 64,
            ended_at=time.time(),
            outcome=outcome,
        )
        for n in range(count)
    ]
    for start in range(0, count, 200):
        await rig.machine.group_commit.commit(*records[start : start + 200])


async def _ran_once(rig: Rig, invocation_id: str) -> None:
    await rig.sup.submit(builtin(invocation_id, "echo", text="hi"))
    assert await rig.wait_terminal(invocation_id) is S.succeeded


async def test_an_id_is_remembered_after_5000_others_ended_and_after_a_restart(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path, retain_ended=2) as rig:
        await _ran_once(rig, "once")
        for n in range(3):  # out of the supervisor's memory of recent endings
            await _ran_once(rig, f"recent-{n}")
        await _others_end(rig, OTHERS)
        again = await rig.sup.submit(builtin("once", "echo", text="hi"))
        assert again.state is S.succeeded and rig.invocation_events("once").count(S.running) == 1
        with pytest.raises(AdmissionRefused) as refused:
            await rig.sup.submit(builtin("once", "echo", text="other"))
        assert refused.value.reason == "id_conflict"
    async with open_rig(tmp_path, retain_ended=2) as rig:
        assert (await rig.sup.submit(builtin("once", "echo", text="hi"))).state is S.succeeded
        assert rig.invocation_events("once") == []  # answered from the record, not run
        assert rig.machine.journal.ended("other-0") is not None


async def test_a_full_window_refuses_new_work_and_forgets_no_id(tmp_path: Path) -> None:
    async with open_rig(tmp_path, machine_kw={"idempotency_max_ids": 3}) as rig:
        await _ran_once(rig, "a")
        await _ran_once(rig, "b")
        await rig.sup.submit(builtin("live", "sleep", seconds=60))  # its id will need room
        with pytest.raises(AdmissionRefused) as refused:
            await rig.sup.submit(builtin("c", "echo", text="hi"))
        assert (refused.value.status, refused.value.reason) == (503, "idempotency_full")
        assert refused.value.retry_after is not None and refused.value.retry_after >= 1
        with pytest.raises(UnknownInvocation):
            rig.sup.get("c")
        # What ended is still answered; ending the live one fills the last place.
        assert (await rig.sup.submit(builtin("a", "echo", text="hi"))).state is S.succeeded
        await rig.sup.cancel("live")
        assert await rig.wait_terminal("live") is S.cancelled
        with pytest.raises(AdmissionRefused):
            await rig.sup.submit(builtin("c", "echo", text="hi"))
        assert rig.machine.ledger.capacity() == rig.baseline  # nothing held by a refusal
        assert all(rig.machine.journal.ended(i) is not None for i in ("a", "b", "live"))
