"""The daemon in-process: port 0, probes, the error envelope, and a stop on request."""

from __future__ import annotations

import os
import pathlib
import stat

import httpx
import msgspec
import pytest
import trio

from api.errors import ErrorEnvelope
from node.daemon import Daemon, StartupError
from supervisor.wire import InvocationState, InvocationStatus
from tests.api_fixtures import (
    bearer,
    builtin_request,
    daemon_config,
    running_daemon,
    wait_for_state,
)


async def test_probes_and_envelope_then_stop(tmp_path: pathlib.Path) -> None:
    daemon = Daemon(daemon_config(tmp_path, devices="none"), handle_signals=False)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(daemon.run)
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            health = await client.get("/healthz")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            missing = await client.get("/no/such/path")
            assert missing.status_code == 404
            envelope = msgspec.json.decode(missing.content, type=ErrorEnvelope)
            assert envelope.error.code == "not_found"
        daemon.stop.set()
    # The nursery closed: the server and every component stopped.
    assert daemon.stop.is_set()


async def test_work_a_stop_cancelled_is_still_answered_for_just_after_it_ended(
    tmp_path: pathlib.Path,
) -> None:
    """A `run` that was between two requests when its invocation ended asks again on a
    new connection; the node, stopping, still says how it ended."""
    async with running_daemon(tmp_path, devices="none") as node:
        headers = bearer(node.admin)
        async with httpx.AsyncClient(base_url=node.url, timeout=5, headers=headers) as client:
            body = builtin_request("held", args={"seconds": 60})
            assert (await client.post("/v1/invocations", json=body)).is_success
            await wait_for_state(client, node.admin, "held", frozenset({InvocationState.running}))
        supervisor = node.daemon.supervisor
        assert supervisor is not None
        ended = supervisor.until_ended("held")
        assert ended is not None
        node.daemon.stop.set()
        await ended.wait()
        async with httpx.AsyncClient(base_url=node.url, timeout=5, headers=headers) as late:
            reply = await late.get("/v1/invocations/held")
            refused = await late.post("/v1/invocations", json=builtin_request("late"))
    assert reply.status_code == 200, reply.text
    status = msgspec.json.decode(reply.content, type=InvocationStatus)
    assert (status.state, status.reason) == (InvocationState.cancelled, "shutdown")
    # Answering is all it still does: nothing new is taken.
    assert refused.status_code == 503, refused.text


def _unsafe_state_dir(tmp_path: pathlib.Path, case: str) -> tuple[pathlib.Path, str]:
    """A state folder the daemon must refuse, and the words that must say why."""
    state = tmp_path / "state"
    if case == "open_mode":
        state.mkdir(mode=0o700)
        state.chmod(0o777)
        return state, "has mode 0777"
    if case == "group_readable":
        state.mkdir(mode=0o700)
        state.chmod(0o750)
        return state, "has mode 0750"
    if case == "symlink":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        state.symlink_to(real)
        return state, "is a symlink"
    if case == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder away")
        state.mkdir(mode=0o700)
        os.chown(state, 65534, 65534)
        return state, "is owned by uid 65534"
    if case == "not_a_folder":
        state.write_text("")
        return state, "is not a folder"
    raise AssertionError(case)


def _names_under(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "case", ["open_mode", "group_readable", "symlink", "other_owner", "not_a_folder"]
)
async def test_an_unsafe_state_dir_refuses_to_start_before_anything_is_created(
    tmp_path: pathlib.Path, case: str
) -> None:
    state, why = _unsafe_state_dir(tmp_path, case)
    before = _names_under(tmp_path)
    daemon = Daemon(daemon_config(tmp_path, devices="none"), handle_signals=False)
    with pytest.raises(StartupError) as info, trio.fail_after(20):
        await daemon.run()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"state folder {state} {why}"), message
    # Nothing was bound, and nothing was written into the folder or where it points.
    assert daemon.url == ""
    assert _names_under(tmp_path) == before


async def test_a_missing_state_dir_is_created_0700_whatever_the_umask(
    tmp_path: pathlib.Path,
) -> None:
    old = os.umask(0)
    try:
        daemon = Daemon(daemon_config(tmp_path, devices="none"), handle_signals=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            daemon.stop.set()
    finally:
        os.umask(old)
    state = tmp_path / "state"
    assert stat.S_IMODE(state.lstat().st_mode) == 0o700
    assert (state / "auth.json").exists()
