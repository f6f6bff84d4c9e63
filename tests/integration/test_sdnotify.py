"""systemd Type=notify: the daemon says READY=1 once it is ready and STOPPING=1 on shutdown."""

from __future__ import annotations

import pathlib
import socket

import httpx
import pytest
import trio

from node.daemon import Daemon
from node.sdnotify import notify
from tests.api_fixtures import daemon_config


def test_notify_without_systemd_sends_nothing() -> None:
    assert notify("READY=1", environ={}) is False


def test_notify_to_a_dead_socket_does_not_raise(tmp_path: pathlib.Path) -> None:
    assert notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


async def test_ready_only_when_ready_then_stopping(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        listener.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        daemon = Daemon(daemon_config(tmp_path), handle_signals=False)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(daemon.run)
            assert listener.recv(64) == b"READY=1"
            async with httpx.AsyncClient(base_url=url, timeout=5) as client:
                assert (await client.get("/readyz")).status_code == 200
            daemon.stop.set()
        assert listener.recv(64) == b"STOPPING=1"
