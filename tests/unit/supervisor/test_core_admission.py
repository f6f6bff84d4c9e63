"""Admission: typed refusals that change nothing, idempotent resubmission, id checks,
drained lanes, and the events every state change publishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from machine.lanes import Isolation, Requirement
from supervisor.admission import AdmissionRefused
from supervisor.guests import GuestPolicy
from supervisor.wire import (
    EventKind,
    GuestNetwork,
    InvocationRequest,
    InvocationState,
    ProcessWork,
)
from tests.supervisor_fixtures import GiB, Rig, builtin, gpu_builtin, open_rig

S = InvocationState


class Unchanged:
    """Everything an admission could touch, captured to prove a refusal touched nothing."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.capacity = rig.machine.ledger.capacity()
        self.reservations = rig.machine.ledger.reservations()
        self.records = rig.machine.journal.record_count
        self.live_tokens = rig.tokens.live_tokens
        self.ids = [s.id for s in rig.sup.list()]

    def check(self) -> None:
        rig = self.rig
        assert rig.machine.ledger.capacity() == self.capacity
        assert rig.machine.ledger.reservations() == self.reservations
        assert rig.machine.journal.record_count == self.records
        assert rig.tokens.live_tokens == self.live_tokens
        assert [s.id for s in rig.sup.list()] == self.ids


async def refused(rig: Rig, request: InvocationRequest) -> AdmissionRefused:
    before = Unchanged(rig)
    with pytest.raises(AdmissionRefused) as info:
        await rig.sup.submit(request)
    before.check()
    return info.value


# -- load --------------------------------------------------------------------------------


async def test_a_flood_beyond_max_queued_is_refused_with_429_and_changes_nothing(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, max_queued=3, max_running=1) as rig:
        for n in range(4):  # one runs, three wait
            await rig.sup.submit(builtin(f"ok{n}", "sleep", seconds=10))
        await trio.testing.wait_all_tasks_blocked()
        counts = rig.sup.counts()
        assert (counts[S.running], counts[S.queued]) == (1, 3)
        for n in range(20):
            refusal = await refused(rig, builtin(f"flood{n}", "sleep", seconds=1))
            assert (refusal.status, refusal.reason) == (429, "queue_full")
            assert refusal.retry_after is not None and refusal.retry_after > 0
        await trio.testing.wait_all_tasks_blocked()
        rejected = [e for e in rig.seen if e.kind is EventKind.admission]
        assert len(rejected) == 20
        assert all(e.to_state == "rejected" for e in rejected)
        assert rejected[0].reasons == ["flood0: queue_full"]
        # Room again once one finishes: admission works, and nothing leaked.
        mock_clock.jump(10)
        await rig.wait_terminal("ok0")
        await rig.sup.submit(builtin("after", "echo"))
        for n in range(4):
            await rig.sup.cancel(f"ok{n}")
        await rig.wait_terminal("after")
        rig.assert_baseline()


async def test_concurrent_submissions_never_exceed_the_bounds(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    results: list[str] = []
    async with open_rig(tmp_path, max_queued=5, max_running=2) as rig:

        async def submit(n: int) -> None:
            try:
                await rig.sup.submit(builtin(f"c{n}", "sleep", seconds=10))
                results.append("ok")
            except AdmissionRefused as exc:
                results.append(exc.reason)

        async with trio.open_nursery() as nursery:
            for n in range(30):
                nursery.start_soon(submit, n)
        await trio.testing.wait_all_tasks_blocked()
        # Invocations still being admitted count as waiting: the bound is never crossed.
        admitted = results.count("ok")
        assert 5 <= admitted <= 7
        assert results.count("queue_full") == 30 - admitted
        assert len(rig.machine.ledger) == admitted
        counts = rig.sup.counts()
        assert counts[S.running] == 2
        assert counts[S.queued] <= 5


# -- idempotency and ids -------------------------------------------------------------------


async def test_resubmitting_the_same_request_returns_the_same_invocation(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        request = builtin("same", "echo", text="once")
        first = await rig.sup.submit(request)
        again = await rig.sup.submit(request)
        assert (again.id, again.tokens, again.lanes) == (first.id, first.tokens, first.lanes)
        await rig.wait_terminal("same")
        ended = await rig.sup.submit(request)  # after the end: still the same record
        assert (ended.id, ended.tokens, ended.state) == ("same", first.tokens, S.succeeded)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.invocation_events("same") == [S.queued, S.running, S.succeeded]
        assert rig.sup.get("same").stdout_tail == "once"  # ran once
        assert len([s for s in rig.sup.list() if s.id == "same"]) == 1
        rig.assert_released("same", first.tokens)


async def test_concurrent_duplicate_submissions_share_one_admission(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        request = builtin("dup", "sleep", seconds=1)
        answers = []

        async def submit() -> None:
            answers.append(await rig.sup.submit(request))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(submit)
        assert len(answers) == 5
        assert all(a.tokens == answers[0].tokens and a.id == "dup" for a in answers)
        assert len(rig.machine.ledger) == 1
        assert rig.tokens.live_tokens == 1


async def test_reusing_an_id_for_a_different_request_is_a_conflict(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.sup.submit(builtin("taken", "sleep", seconds=10))
        refusal = await refused(rig, builtin("taken", "sleep", seconds=11))
        assert (refusal.status, refusal.reason) == (409, "id_conflict")
        await rig.sup.cancel("taken")
        refusal = await refused(rig, builtin("taken", "echo"))
        assert (refusal.status, refusal.reason) == (409, "id_conflict")


@pytest.mark.parametrize(
    "bad_id",
    [
        "../etc/passwd",
        "a/b",
        "..",
        ".hidden",
        "-flag",
        "a\x00b",
        "a\nb",
        "tab\tid",
        "caf\u00e9",
        "x" * 129,
        "x" * 300,
        "",
        "sp ace",
    ],
)
def test_invalid_ids_never_decode(bad_id: str) -> None:
    body = json.dumps({"id": bad_id, "work": {"kind": "builtin", "name": "echo"}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=InvocationRequest)


def test_a_valid_id_decodes() -> None:
    body = json.dumps({"id": "A" + "b" * 127, "work": {"kind": "builtin", "name": "echo"}})
    assert msgspec.json.decode(body, type=InvocationRequest).id == "A" + "b" * 127


# -- requests that can never run ----------------------------------------------------------


def _process(**work: Any) -> InvocationRequest:
    return InvocationRequest(id="bad", work=ProcessWork(**work), requirement=Requirement.CPU)


@pytest.mark.parametrize(
    "request_",
    [
        _process(argv=["a\x00b"]),
        _process(argv=["sh"], env={"LD_PRELOAD": "/evil.so"}),
        _process(argv=["sh"], env={"CUDA_VISIBLE_DEVICES": "0"}),
        _process(argv=["sh"], env={"LITEGRAPH_CAPABILITY_TOKEN": "x"}),
        _process(argv=["sh"], env={"1BAD": "x"}),
        _process(argv=["sh"], env={"A": "v\x00"}),
        _process(argv=["sh"], cwd="relative/dir"),
        InvocationRequest(
            id="bad",
            work=ProcessWork(argv=["sh"], network=GuestNetwork.HOST),
            requirement=Requirement.CPU,
            isolation=Isolation.SANDBOX,
        ),
        builtin("bad", "nope"),
        builtin("bad", "sleep", seconds=-1),
        builtin("bad", "sleep", seconds="soon"),
        builtin("bad", "echo", requirement=Requirement.CPU, gpus=2),
    ],
    ids=lambda r: msgspec.json.encode(r.work).decode()[:60],
)
async def test_an_invalid_request_is_422_and_reserves_nothing(
    tmp_path: Path, mock_clock: trio.testing.MockClock, request_: InvocationRequest
) -> None:
    async with open_rig(tmp_path) as rig:
        refusal = await refused(rig, request_)
        assert (refusal.status, refusal.reason) == (422, "invalid_request")
        with pytest.raises(KeyError):
            rig.sup.get("bad")


@pytest.mark.parametrize(
    ("cwd", "reason"),
    [
        ("/", "/ would cover the whole sandbox"),
        ("/proc/self", "lies inside the sandbox's private /proc"),
        ("/tmp", "/tmp is the sandbox's private /tmp"),
        ("STATE/keys", "lies inside"),
        ("/no/such/folder", "cannot be opened"),
    ],
)
async def test_a_cwd_that_would_cover_the_sandbox_or_reach_the_state_is_422_invalid_cwd(
    tmp_path: Path, mock_clock: trio.testing.MockClock, cwd: str, reason: str
) -> None:
    async with open_rig(tmp_path) as rig:
        folder = cwd.replace("STATE", str(tmp_path / "state"))
        refusal = await refused(rig, _process(argv=["sh"], cwd=folder))
        assert (refusal.status, refusal.reason) == (422, "invalid_cwd")
        assert reason in str(refusal) and refusal.details == {"field": "cwd"}
        with pytest.raises(KeyError):
            rig.sup.get("bad")


async def test_a_request_for_the_host_network_is_refused_unless_the_operator_allows_it(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    host = _process(argv=["true"], network=GuestNetwork.HOST)
    async with open_rig(tmp_path / "serve") as rig:
        refusal = await refused(rig, host)
        assert (refusal.status, refusal.reason) == (422, "host_network_not_allowed")
        assert "--guest-host-network" in str(refusal)
        assert refusal.details == {"field": "work.network"}
        with pytest.raises(KeyError):
            rig.sup.get("bad")
    allowed = GuestPolicy(bwrap=None, uids=None, state_dir=tmp_path, host_network=True)
    async with open_rig(tmp_path / "allowed", guests=allowed) as rig:
        await rig.sup.submit(host)
        await rig.wait_state("bad", S.succeeded)
        assert rig.sup.get("bad").network is GuestNetwork.HOST


@pytest.mark.parametrize(
    ("request_", "status", "reason"),
    [
        (
            builtin("r", "echo", requirement=Requirement.GPU, gpus=1, vram_bytes=100 * GiB),
            409,
            "insufficient_vram",
        ),
        (builtin("r", "echo", requirement=Requirement.GPU, gpus=8), 409, "insufficient_gpus"),
        (builtin("r", "echo", cpu_millis=10**9), 409, "insufficient_cpu"),
        (builtin("r", "echo", memory_bytes=2**50), 409, "insufficient_memory"),
        (builtin("r", "echo", requirement=Requirement.CPU, vram_bytes=GiB), 422, "invalid_request"),
        (
            builtin("r", "echo", requirement=Requirement.CPU, isolation=Isolation.PARTITIONED),
            422,
            "isolation_unsupported",
        ),
    ],
)
async def test_a_reservation_refusal_mints_nothing_and_reserves_nothing(
    tmp_path: Path,
    mock_clock: trio.testing.MockClock,
    request_: InvocationRequest,
    status: int,
    reason: str,
) -> None:
    async with open_rig(tmp_path) as rig:
        refusal = await refused(rig, request_)
        assert (refusal.status, refusal.reason) == (status, reason)
        assert rig.tokens.live_tokens == 0
        await trio.testing.wait_all_tasks_blocked()
        assert [e.reasons for e in rig.seen if e.kind is EventKind.admission] == [[f"r: {reason}"]]
        # The id was not claimed: a corrected request with it is admitted.
        await rig.sup.submit(builtin("r", "echo"))
        await rig.wait_terminal("r")


async def test_a_refused_gpu_request_is_refused_again_the_same_way(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        big = builtin("big", "echo", requirement=Requirement.GPU, gpus=1, vram_bytes=25 * GiB)
        first = await refused(rig, big)
        second = await refused(rig, big)
        assert first.reason == second.reason == "insufficient_vram"
        assert first.details == second.details


# -- drained lanes ------------------------------------------------------------------------


async def test_a_drained_lane_refuses_new_work_but_running_work_finishes(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        dedicated = gpu_builtin("d", isolation=Isolation.DEDICATED, seconds=5)
        response = await rig.sup.submit(dedicated)
        await rig.wait_state("d", S.running)
        rig.machine.ledger.drain(rig.gpu_lane)
        later = gpu_builtin("later", "echo", isolation=Isolation.DEDICATED)
        refusal = await refused(rig, later)
        assert (refusal.status, refusal.reason) == (409, "lane_drained")
        mock_clock.jump(5)
        assert await rig.wait_terminal("d") is S.succeeded
        assert len(rig.machine.ledger) == 0
        rig.machine.ledger.resume(rig.gpu_lane)
        rig.assert_released("d", response.tokens)
        await rig.sup.submit(later)
        assert await rig.wait_terminal("later") is S.succeeded


# -- events ---------------------------------------------------------------------------------


async def test_every_state_change_is_published_in_order(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, max_running=1) as rig:
        await rig.sup.submit(builtin("a", "sleep", seconds=1))
        await rig.sup.submit(builtin("b", "fail"))
        await rig.sup.submit(builtin("c", "sleep", seconds=100, timeout_s=50))
        await rig.sup.submit(builtin("d", "sleep", seconds=100))
        await rig.sup.cancel("d")
        mock_clock.jump(1)
        await rig.wait_terminal("b")
        mock_clock.jump(50)
        await rig.wait_terminal("c")
        await trio.testing.wait_all_tasks_blocked()
        assert rig.invocation_events("a") == [S.queued, S.running, S.succeeded]
        assert rig.invocation_events("b") == [S.queued, S.running, S.failed]
        assert rig.invocation_events("c") == [S.queued, S.running, S.timed_out]
        assert rig.invocation_events("d") == [S.queued, S.cancelled]
        # Each terminal event already carries its reason.
        ends = {
            e.invocation.id: e.invocation.reason
            for e in rig.seen
            if e.invocation is not None and e.invocation.state in (S.cancelled, S.timed_out)
        }
        assert ends == {"c": "deadline_exceeded", "d": "cancel_requested"}


async def test_a_terminal_event_is_published_only_after_release(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        observed: list[int] = []
        publish = rig.events.publish

        def spy(event: Any) -> Any:
            inv = event.invocation
            if inv is not None and inv.state in (S.succeeded, S.cancelled):
                observed.append(len(rig.machine.ledger))
            return publish(event)

        rig.events.publish = spy  # type: ignore[method-assign]
        await rig.sup.submit(builtin("x", "echo"))
        await rig.wait_terminal("x")
        await rig.sup.submit(builtin("y", "sleep", seconds=10))
        await rig.sup.cancel("y")
        assert observed == [0, 0]


async def test_resubmission_is_judged_by_value_not_key_order(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        first = await rig.sup.submit(
            InvocationRequest(id="k", work=ProcessWork(argv=["true"], env={"A": "1", "B": "2"}))
        )
        again = await rig.sup.submit(
            InvocationRequest(id="k", work=ProcessWork(argv=["true"], env={"B": "2", "A": "1"}))
        )
        assert again.tokens == first.tokens


async def test_an_id_with_a_trailing_newline_is_refused_before_anything(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        # msgspec's pattern lets "$" match before a final newline; admission does not.
        request = msgspec.json.decode(
            b'{"id": "abc\\n", "work": {"kind": "builtin", "name": "echo"}}',
            type=InvocationRequest,
        )
        refusal = await refused(rig, request)
        assert (refusal.status, refusal.reason) == (422, "invalid_request")
