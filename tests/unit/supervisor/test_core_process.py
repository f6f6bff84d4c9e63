"""Process invocations through the supervisor (real processes, real clock, short):
the environment a child sees, and that every ending leaves no process of its group
behind and releases everything."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from capabilities import LaneOp, TokenRefused
from machine.health import Signal
from machine.lanes import Isolation, Requirement
from supervisor.process import ConfinementFailed, ProcessStuck
from supervisor.wire import InvocationState
from tests.supervisor_fixtures import (
    SIM_GPU,
    TREE,
    GiB,
    Rig,
    kill_leftovers,
    only_lane,
    open_rig,
    open_unstarted,
    process,
    session_members,
    tree_pid,
)

S = InvocationState
ENV_PROBE = (
    "sh",
    "-c",
    # Tokens come from a file, one line per lane; never from the environment.
    'printf "%s|%s|%s|%s|%s" "${CUDA_VISIBLE_DEVICES-unset}" "$LITEGRAPH_LANE_IDS" '
    '"$LITEGRAPH_NODE_URL" "$(paste -sd, "$LITEGRAPH_CAPABILITY_TOKEN_FILE")" '
    '"${LITEGRAPH_CAPABILITY_TOKEN-unset}"',
)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path, kill_grace=0.5) as rig:
        yield rig


def run_process_raises(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """The supervisor's every `run_process` call raises `error` (and runs nothing)."""

    async def raising(*args: object, **kwargs: object) -> int:
        raise error

    monkeypatch.setattr("supervisor.runner.run_process", raising)


async def submit_gpu_true(rig: Rig, invocation_id: str) -> tuple[str, str]:
    """Submits `true` on a GPU (1 GiB); returns its (lane id, token)."""
    request = process(invocation_id, "true", requirement=Requirement.GPU, gpus=1, vram_bytes=GiB)
    return only_lane(await rig.sup.submit(request))


# -- environment --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requirement", "isolation", "gpus", "vram", "visible"),
    [
        (Requirement.CPU, Isolation.SHARED, 0, 0, ""),
        (Requirement.CPU, Isolation.SANDBOX, 0, 0, ""),
        (Requirement.GPU, Isolation.SANDBOX, 1, GiB, ""),
        (Requirement.GPU, Isolation.SHARED, 1, GiB, SIM_GPU),
        (Requirement.GPU, Isolation.DEDICATED, 1, 0, SIM_GPU),
        (Requirement.GPU, Isolation.PARTITIONED, 1, 0, "MIG-"),
    ],
)
async def test_the_child_sees_its_token_lanes_url_and_only_its_devices(
    rig: Rig,
    requirement: Requirement,
    isolation: Isolation,
    gpus: int,
    vram: int,
    visible: str,
) -> None:
    request = process(
        "env",
        *ENV_PROBE,
        requirement=requirement,
        isolation=isolation,
        gpus=gpus,
        vram_bytes=vram,
    )
    response = await rig.sup.submit(request)
    assert await rig.wait_terminal("env") is S.succeeded
    devices, lanes, url, token, env_token = rig.sup.get("env").stdout_tail.split("|")
    assert lanes == ",".join(g.lane_id for g in response.lanes)
    assert token == ",".join(response.tokens[g.lane_id] for g in response.lanes)
    assert env_token == "unset"
    # A sandbox guest reaches the node through its Unix socket, never the host network.
    assert url == ("" if isolation is Isolation.SANDBOX else "http://127.0.0.1:7777")
    if visible == "MIG-":
        lane = rig.machine.ledger.lane(response.lanes[0].lane_id)
        assert lane is not None and lane.visible_uuid is not None
        assert devices == lane.visible_uuid and devices.startswith("MIG-")
    else:
        assert devices == visible  # "" hides every GPU; never unset, never "all"
    rig.assert_released("env", response.tokens)


# -- endings ------------------------------------------------------------------------------


async def test_a_nonzero_exit_fails_and_releases(rig: Rig) -> None:
    response = await rig.sup.submit(process("nz", "sh", "-c", "echo oops >&2; exit 3"))
    assert await rig.wait_terminal("nz") is S.failed
    status = rig.sup.get("nz")
    assert (status.exit_code, status.reason, status.stderr_tail) == (3, "nonzero_exit", "oops\n")
    rig.assert_released("nz", response.tokens)


async def test_a_grandchild_left_after_a_normal_exit_is_killed(rig: Rig) -> None:
    response = await rig.sup.submit(process("bg", "sh", "-c", 'echo "$$"; sleep 60 &'))
    assert await rig.wait_terminal("bg") is S.succeeded
    sid = int(rig.sup.get("bg").stdout_tail)
    try:
        assert session_members(sid) == []
        rig.assert_released("bg", response.tokens)
    finally:
        kill_leftovers(sid)


async def test_cancel_kills_the_child_and_grandchild(rig: Rig) -> None:
    response = await rig.sup.submit(process("pc", *TREE))
    sid = await tree_pid(rig, "pc")
    try:
        status = await rig.sup.cancel("pc")
        assert (status.state, status.reason) == (S.cancelled, "cancel_requested")
        assert session_members(sid) == []
        rig.assert_released("pc", response.tokens)
    finally:
        kill_leftovers(sid)


async def test_the_deadline_kills_the_tree(rig: Rig) -> None:
    response = await rig.sup.submit(process("pt", *TREE, timeout_s=1.0))
    sid = await tree_pid(rig, "pt")
    try:
        assert await rig.wait_terminal("pt") is S.timed_out
        assert rig.sup.get("pt").reason == "deadline_exceeded"
        assert session_members(sid) == []
        rig.assert_released("pt", response.tokens)
    finally:
        kill_leftovers(sid)


async def test_a_device_fault_kills_the_gpu_tree(rig: Rig) -> None:
    request = process("pg", *TREE, requirement=Requirement.GPU, gpus=1, vram_bytes=GiB)
    response = await rig.sup.submit(request)
    sid = await tree_pid(rig, "pg")
    try:
        rig.machine.health.apply(SIM_GPU, Signal.FATAL_XID, "xid_79", at=trio.current_time())
        assert await rig.wait_terminal("pg") is S.cancelled
        assert rig.sup.get("pg").reason == "lane_unhealthy"
        assert session_members(sid) == []
        rig.machine.health.apply(SIM_GPU, Signal.RESET, at=trio.current_time())
        for _ in range(rig.machine.health.recovery_probes):
            rig.machine.health.apply(SIM_GPU, Signal.GOOD, at=trio.current_time())
        rig.assert_released("pg", response.tokens)
    finally:
        kill_leftovers(sid)


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace(rig: Rig) -> None:
    script = "trap '' TERM; echo \"$$\"; sleep 60 & while :; do sleep 1; done"
    response = await rig.sup.submit(process("stubborn", "sh", "-c", script))
    sid = await tree_pid(rig, "stubborn")
    try:
        start = trio.current_time()
        await rig.sup.cancel("stubborn")
        assert 0.4 <= trio.current_time() - start < 5
        assert session_members(sid) == []
        rig.assert_released("stubborn", response.tokens)
    finally:
        kill_leftovers(sid)


async def test_shutdown_kills_every_tree(rig: Rig) -> None:
    first = await rig.sup.submit(process("s1", *TREE))
    second = await rig.sup.submit(process("s2", *TREE))
    sids = [await tree_pid(rig, "s1"), await tree_pid(rig, "s2")]
    try:
        await rig.sup.shutdown(0.1)
        for name, response, sid in (("s1", first, sids[0]), ("s2", second, sids[1])):
            assert (rig.sup.get(name).state, rig.sup.get(name).reason) == (S.cancelled, "shutdown")
            assert session_members(sid) == []
            rig.assert_released(name, response.tokens)
    finally:
        for sid in sids:
            kill_leftovers(sid)


async def test_outer_cancellation_kills_the_tree_and_releases(tmp_path: Path) -> None:
    async with open_unstarted(tmp_path, max_running=4, kill_grace=0.5) as (machine, sup, tokens):
        sid = 0
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(sup.run)
                    await sup.submit(process("outer", *TREE))
                    with trio.fail_after(10):
                        while not sup.get("outer").stdout_tail.strip():  # noqa: ASYNC110
                            await trio.sleep(0.01)
                    sid = int(sup.get("outer").stdout_tail)
                    scope.cancel()
            assert (sup.get("outer").state, sup.get("outer").reason) == (S.cancelled, "shutdown")
            assert session_members(sid) == []
            assert len(machine.ledger) == 0
            assert machine.journal.reservations() == {}
            assert machine.journal.processes() == {}  # the process end is journaled too
            assert tokens.live_tokens == 0
        finally:
            if sid:
                kill_leftovers(sid)


async def test_a_process_that_survives_sigkill_keeps_its_resources_and_faults_its_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_process_raises(monkeypatch, ProcessStuck(4242))  # what it says when SIGKILL failed
    async with open_rig(tmp_path) as rig:
        lane_id, token = await submit_gpu_true(rig, "d")
        assert await rig.wait_terminal("d") is InvocationState.failed
        assert (rig.sup.get("d").reason or "").startswith("process_stuck")
        # Still held (the device may still be in use) and its lane out of allocatable.
        assert rig.machine.ledger.get("d") is not None
        assert not rig.machine.ledger.available(lane_id)
        with pytest.raises(TokenRefused):
            rig.sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)


async def test_a_guest_whose_cgroup_cannot_be_made_fails_typed_and_releases_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_process_raises(monkeypatch, ConfinementFailed("no cgroup for d: taken"))
    async with open_rig(tmp_path) as rig:
        lane_id, token = await submit_gpu_true(rig, "d")
        assert await rig.wait_terminal("d") is InvocationState.failed
        assert rig.sup.get("d").reason == "confinement_failed: no cgroup for d: taken"
        # Nothing ran, so nothing is held: the lane stays allocatable.
        assert rig.machine.ledger.get("d") is None
        assert rig.machine.ledger.available(lane_id)
        with pytest.raises(TokenRefused):
            rig.sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
