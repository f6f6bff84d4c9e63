"""What a token holder sends a lane is checked whole before the owner frames it for
the host: a value that does not fit the wire is 422 `bad_args` for that caller, and
neither the host nor any other invocation on the lane notices. One invocation holds
at most its own share of a lane's buffers, so it cannot lock another tenant out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from capabilities import TokenRefusal, TokenRefused
from lanehost.protocol import MAX_ARGS, MAX_BUFFERS, MAX_DATA_BYTES
from supervisor.lane_host import lane_host_factory
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import Download, Execute, MemoryRelease, MemoryReserve, Upload
from supervisor.wire import InvocationRequest, InvocationState
from tests.supervisor_fixtures import GiB, Rig, builtin, gpu_builtin, only_lane, open_rig

S = InvocationState
MiB = 2**20
BEYOND_64_BITS = 1180591620717411303424  # 2**70, the value of the report
PER_INVOCATION = 64  # the default bound on one invocation's buffers on one lane
BUF = "buf_" + "0" * 32  # a well-formed id nobody holds
MINE = "buf_" + "f" * 32  # stands for the caller's own buffer, in the cases below


def gpu_work(invocation_id: str, vram: int = 4 * GiB) -> InvocationRequest:
    return gpu_builtin(invocation_id, vram_bytes=vram, seconds=1000)


async def send(rig: Rig, lane_id: str, token: str, work: Any) -> object:
    if isinstance(work, Download):
        return await rig.sup.lane_download(lane_id, token, work)
    return await rig.sup.lane_work(lane_id, token, work)


async def holder_with_data(rig: Rig) -> tuple[str, str, str]:
    """GPU work "holder" with a 16-byte buffer holding known bytes: (lane, token, buffer)."""
    lane_id, token = only_lane(await rig.sup.submit(gpu_work("holder")))
    reply = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[16]))
    assert reply.buffer_id is not None
    await rig.sup.lane_work(lane_id, token, Upload(buffer_id=reply.buffer_id, offset=0, data=DATA))
    return lane_id, token, reply.buffer_id


DATA = bytes(range(16))


def asked(rig: Rig, lane_id: str) -> int:
    """The requests the lane's in-process hosts have answered, heartbeats aside."""
    return rig.in_process_hosts.asked(lane_id)


# -- values that do not fit the wire ------------------------------------------------------


async def test_an_integer_past_64_bits_is_bad_args_and_the_lane_and_its_tenants_carry_on(
    tmp_path: Path,
) -> None:
    """The report: with real lane hosts, an execute whose arg is 2**70 made msgpack raise
    while the owner framed it, the owner crashed, every buffer holder on the lane was
    cancelled `lane_host_failed`, and six of these faulted the lane."""
    async with open_rig(tmp_path, lane_hosts=lane_host_factory(backend="numpy")) as rig:
        lane_id, holder, buf = await holder_with_data(rig)
        _, hostile = only_lane(await rig.sup.submit(gpu_work("hostile")))
        _, cpu = only_lane(await rig.sup.submit(builtin("cpu", "sleep", seconds=1000)))
        owner, cpu_owner = rig.sup.owners[lane_id], rig.sup.owners[rig.cpu_lane]
        for lane, token in [(lane_id, hostile)] * 6 + [(rig.cpu_lane, cpu)] * 6:
            for args in ({"x": BEYOND_64_BITS}, {"x": -(2**63) - 1}, {"x": 2**63}):
                with pytest.raises(LaneWorkError) as refused:
                    await rig.sup.lane_work(lane, token, Execute(kernel="noop", args=args))
                assert (refused.value.status, refused.value.code) == (422, "bad_args")
                assert "args.x" in str(refused.value)
        for lane_owner in (owner, cpu_owner):
            assert lane_owner.host_starts == 1 and not lane_owner.restarts
            assert not lane_owner.faulted and lane_owner.host_status == "ready"
        assert all(rig.sup.get(i).state is S.running for i in ("holder", "hostile", "cpu"))
        mine = await rig.sup.lane_download(
            lane_id, holder, Download(buffer_id=buf, offset=0, length=16)
        )
        assert mine == DATA and owner.held_by("holder") == 16
        assert "host_restarted" not in rig.lane_events(lane_id)
        # The hostile invocation's own well-formed work is served as before.
        assert (await rig.sup.lane_work(lane_id, hostile, Execute(kernel="noop"))).result == {}


UNFIT: list[tuple[str, Any]] = [
    ("nan", Execute(kernel="noop", args={"x": math.nan})),
    ("inf", Execute(kernel="noop", args={"x": math.inf})),
    ("-inf", Execute(kernel="noop", args={"x": -math.inf})),
    ("2**63", Execute(kernel="noop", args={"x": 2**63})),
    ("-2**63-1", Execute(kernel="noop", args={"x": -(2**63) - 1})),
    ("2**64", Execute(kernel="noop", args={"x": 2**64})),
    ("a string", Execute(kernel="noop", args={"x": "1"})),
    ("None", Execute(kernel="noop", args={"x": None})),
    ("a list", Execute(kernel="noop", args={"x": [1, 2]})),
    ("a nested dict", Execute(kernel="noop", args={"x": {"y": {"z": 1}}})),
    ("bytes", Execute(kernel="noop", args={"x": b"1"})),
    ("args not a dict", Execute(kernel="noop", args=[1, 2])),  # type: ignore[arg-type]
    ("an arg name not snake_case", Execute(kernel="noop", args={"X": 1})),
    ("an arg name too long", Execute(kernel="noop", args={"x" * 33: 1})),
    ("an arg name not a string", Execute(kernel="noop", args={1: 1})),  # type: ignore[dict-item]
    ("too many args", Execute(kernel="noop", args={f"a{i}": i for i in range(MAX_ARGS + 1)})),
    ("a kernel name not snake_case", Execute(kernel="No-op")),
    ("a kernel name too long", Execute(kernel="k" * 65)),
    ("a kernel name not a string", Execute(kernel=7)),  # type: ignore[arg-type]
    ("a buffer id of another form", Execute(kernel="fill", buffers={"out": "x" * 65})),
    ("a buffer id not a string", Execute(kernel="fill", buffers={"out": 5})),  # type: ignore[dict-item]
    ("too many buffers", Execute(kernel="noop", buffers={f"b{i}": BUF for i in range(33)})),
    ("a dimension of 0", MemoryReserve(dtype="uint8", shape=[0])),
    ("a dimension past 2**40", MemoryReserve(dtype="uint8", shape=[2**40 + 1])),
    ("a dimension past 64 bits", MemoryReserve(dtype="uint8", shape=[BEYOND_64_BITS])),
    ("a bool dimension", MemoryReserve(dtype="uint8", shape=[True])),
    ("a float dimension", MemoryReserve(dtype="uint8", shape=[1.5])),  # type: ignore[list-item]
    ("no dimensions", MemoryReserve(dtype="uint8", shape=[])),
    ("nine dimensions", MemoryReserve(dtype="uint8", shape=[1] * 9)),
    ("an unknown dtype", MemoryReserve(dtype="complex128", shape=[1])),  # type: ignore[arg-type]
    ("a release of a malformed id", MemoryRelease(buffer_id="buf_../../x")),
    ("an upload at a negative offset", Upload(buffer_id=MINE, offset=-1, data=b"x")),
    ("an upload past 2**62", Upload(buffer_id=MINE, offset=2**62 + 1, data=b"x")),
    ("an upload past 64 bits", Upload(buffer_id=MINE, offset=BEYOND_64_BITS, data=b"x")),
    ("an upload of a str", Upload(buffer_id=MINE, offset=0, data="x")),  # type: ignore[arg-type]
    ("a download at a negative offset", Download(buffer_id=MINE, offset=-1, length=1)),
    ("a download past 64 bits", Download(buffer_id=MINE, offset=BEYOND_64_BITS, length=1)),
    ("a download too long", Download(buffer_id=MINE, offset=0, length=MAX_DATA_BYTES + 1)),
    ("a download of negative length", Download(buffer_id=MINE, offset=0, length=-1)),
]


@pytest.mark.parametrize(("name", "work"), UNFIT, ids=[name for name, _ in UNFIT])
async def test_work_that_does_not_fit_the_wire_is_bad_args_and_reaches_no_host(
    tmp_path: Path, mock_clock: trio.testing.MockClock, name: str, work: Any
) -> None:
    """Work built in Python, past the edge's JSON schema: the owner checks it all the
    same, and the host is never asked (its request count does not move)."""
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, holder, buf = await holder_with_data(rig)
        _, token = only_lane(await rig.sup.submit(gpu_work("caller")))
        owner = rig.sup.owners[lane_id]
        own = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[16]))
        if getattr(work, "buffer_id", None) == MINE:  # the caller's own: only the value is off
            work = msgspec.structs.replace(work, buffer_id=own.buffer_id)
        before = asked(rig, lane_id)
        with pytest.raises(LaneWorkError) as refused:
            await send(rig, lane_id, token, work)
        assert (refused.value.status, refused.value.code) == (422, "bad_args"), name
        assert asked(rig, lane_id) == before, "the host was asked"
        assert owner.host_starts == 1 and not owner.restarts
        assert (owner.held_by("caller"), owner.held_by("holder"), owner.used_bytes) == (16, 16, 32)
        assert hosts.used(lane_id) == 32
        mine = await rig.sup.lane_download(
            lane_id, holder, Download(buffer_id=buf, offset=0, length=16)
        )
        assert mine == DATA


async def test_values_at_the_edges_of_the_wire_are_served(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("edges")))
        # Each fits the wire and reaches the host, whose noop refuses any arg.
        edges: list[Any] = [-(2**63), 2**63 - 1, -0.0, 1.7976931348623157e308, 5e-324, True]
        for value in edges:
            before = asked(rig, lane_id)
            with pytest.raises(LaneWorkError) as kernel:
                await rig.sup.lane_work(lane_id, token, Execute(kernel="noop", args={"x": value}))
            assert "noop takes args" in str(kernel.value) and asked(rig, lane_id) > before
        names = {"a" * 32: 0, **{f"a{i}": i for i in range(MAX_ARGS - 1)}}  # 32 args fit
        with pytest.raises(LaneWorkError) as kernel:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop", args=names))
        assert "noop takes args" in str(kernel.value)
        reply = await rig.sup.lane_work(
            lane_id, token, MemoryReserve(dtype="int64", shape=[1, 1, 1, 1, 1, 1, 1, 2])
        )
        assert reply.buffer_id is not None
        out = reply.buffer_id
        fill = Execute(kernel="fill", args={"value": -(2**63)}, buffers={"out": out})
        assert (await rig.sup.lane_work(lane_id, token, fill)).result == {}
        got = await rig.sup.lane_download(
            lane_id, token, Download(buffer_id=out, offset=0, length=16)
        )
        assert got == (-(2**63)).to_bytes(8, "little", signed=True) * 2
        await rig.sup.lane_work(lane_id, token, Upload(buffer_id=out, offset=16, data=b""))
        assert (
            await rig.sup.lane_download(
                lane_id, token, Download(buffer_id=out, offset=16, length=0)
            )
            == b""
        )


# -- one invocation's share of a lane's buffers ------------------------------------------


async def reserve_until_refused(rig: Rig, lane_id: str, token: str) -> tuple[int, LaneWorkError]:
    """One-byte buffers until the lane refuses one: how many it gave, and the refusal."""
    for given in range(MAX_BUFFERS + 1):
        try:
            await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[1]))
        except LaneWorkError as refused:
            return given, refused
    raise AssertionError("the lane never refused a buffer")


async def test_one_invocation_stops_at_its_own_buffer_bound_and_another_still_allocates(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The report: 4,096 one-byte buffers (4 KiB of a 1 MiB grant) by one token, and
    another tenant on the same lane got 429 `too_many_buffers`."""
    async with open_rig(tmp_path) as rig:
        lane_id, flooder = only_lane(await rig.sup.submit(gpu_work("flood", vram=MiB)))
        lane_b, tenant = only_lane(await rig.sup.submit(gpu_work("tenant", vram=MiB)))
        assert lane_b == lane_id  # shared work packs onto one GPU
        owner = rig.sup.owners[lane_id]
        given, refused = await reserve_until_refused(rig, lane_id, flooder)
        # The other tenant is not refused: its own bound is untouched.
        await rig.sup.lane_work(lane_id, tenant, MemoryReserve(dtype="uint8", shape=[1]))
        assert given == PER_INVOCATION
        assert (refused.status, refused.code) == (429, "too_many_buffers")
        assert "this invocation" in str(refused)
        assert owner.held_by("flood") == PER_INVOCATION
        # Bytes stay bounded by the token's vram_bytes, whatever the count.
        with pytest.raises(TokenRefused) as over:
            await rig.sup.lane_work(lane_id, tenant, MemoryReserve(dtype="uint8", shape=[MiB]))
        assert over.value.reason is TokenRefusal.VRAM_OVER_BUDGET
        for _ in range(PER_INVOCATION - 1):
            await rig.sup.lane_work(lane_id, tenant, MemoryReserve(dtype="uint8", shape=[1]))
        assert owner.held_by("tenant") == PER_INVOCATION
        # A released buffer gives its place back to the same invocation.
        first = owner._buffers.of("flood")[0]
        await rig.sup.lane_work(lane_id, flooder, MemoryRelease(buffer_id=first))
        await rig.sup.lane_work(lane_id, flooder, MemoryReserve(dtype="uint8", shape=[1]))
        assert owner.host_starts == 1 and rig.sup.get("flood").state is S.running
        await rig.sup.cancel("flood")
        assert owner.held_by("flood") == 0 and owner.held_by("tenant") == PER_INVOCATION
        assert rig.in_process_hosts.used(lane_id) == PER_INVOCATION


async def test_the_per_invocation_bound_is_the_supervisors_to_set_and_the_lane_bound_holds(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, lane_buffers_per_invocation=1024) as rig:
        invocations = [only_lane(await rig.sup.submit(gpu_work(f"i{n}"))) for n in range(5)]
        lane_id = invocations[0][0]
        assert all(lane == lane_id for lane, _ in invocations)
        for lane, token in invocations[:4]:  # 4 x 1,024: the lane's 4,096
            given, refused = await reserve_until_refused(rig, lane, token)
            assert given == 1024 and "this invocation" in str(refused)
        _, late = invocations[4]
        with pytest.raises(LaneWorkError) as full:
            await rig.sup.lane_work(lane_id, late, MemoryReserve(dtype="uint8", shape=[1]))
        assert (full.value.status, full.value.code) == (429, "too_many_buffers")
        assert "the lane holds" in str(full.value)
        assert len(rig.sup.owners[lane_id]._buffers) == MAX_BUFFERS


@pytest.mark.parametrize("bound", [0, -1, MAX_BUFFERS + 1])
async def test_a_per_invocation_bound_outside_the_lanes_is_refused(
    tmp_path: Path, bound: int
) -> None:
    with pytest.raises(ValueError, match="buffers per invocation"):
        async with open_rig(tmp_path, lane_buffers_per_invocation=bound):
            pass
