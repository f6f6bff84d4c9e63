"""A claim's own socket: served where its pods see it, bound and made 0666 where they
cannot reach (a symlink they plant is replaced, never followed), serving lane work
alone and saying so on every request, and gone when closed."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from quart import request
from quart_trio import QuartTrio

import api.unix_server
from api.hold_sockets import HoldSockets
from api.peer import PEER_SCOPE_KEY
from api.settings import HttpSettings

HTTP = HttpSettings(
    listen="127.0.0.1:0", read_timeout=5, body_timeout=5, keep_alive=5, metrics_auth=False
)


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    base = pathlib.Path(tempfile.mkdtemp(prefix="lg-hs-", dir="/tmp"))  # short socket paths
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _app(seen: list[Any]) -> QuartTrio:
    app = QuartTrio(__name__)

    @app.get("/v1/lanes/<lane>/buffers/<buffer>")
    async def lane(lane: str, buffer: str) -> str:
        seen.append(request.scope[PEER_SCOPE_KEY])
        return "lane work"

    @app.get("/v1/snapshot")
    @app.get("/v1/lanes/<lane>/drain")
    @app.get("/v1/lanes/<lane>/something-new")
    async def elsewhere(lane: str = "") -> str:
        return "the node's own"  # served on the node's sockets, never on a claim's

    return app


async def _get(path: pathlib.Path, target: str) -> httpx.Response:
    transport = httpx.AsyncHTTPTransport(uds=str(path))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return await client.get(target)


async def test_a_planted_symlink_is_replaced_and_its_target_never_touched(
    short_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, staging = short_dir / "claims" / "c1", short_dir / ".sockets"
    folder.mkdir(parents=True)
    victim = short_dir / "host-secret"
    victim.write_text("secret")
    victim.chmod(0o600)
    (folder / "node.sock").symlink_to(victim)  # what a pod in the folder may do
    chmodded: list[str] = []
    chmod = os.chmod

    def recorded(path: Any, mode: int, **kw: Any) -> None:
        chmodded.append(os.fspath(path))
        chmod(path, mode, **kw)

    monkeypatch.setattr(api.unix_server.os, "chmod", recorded)
    seen: list[Any] = []
    async with trio.open_nursery() as nursery:
        sockets = HoldSockets(_app(seen), HTTP, nursery, staging)
        sockets.open("claim:c1", folder / "node.sock")
        assert stat.S_ISSOCK((folder / "node.sock").lstat().st_mode)
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "secret"
        assert chmodded and all(pathlib.Path(p).parent == staging for p in chmodded)
        assert stat.S_IMODE(staging.stat().st_mode) == 0o700
        assert (await _get(folder / "node.sock", "/v1/lanes/l1/buffers/b1")).text == "lane work"
        assert seen[-1].bound == "claim:c1"
        for elsewhere in ("/v1/snapshot", "/v1/lanes/l1/drain", "/v1/lanes/l1/something-new"):
            assert (await _get(folder / "node.sock", elsewhere)).status_code == 404, elsewhere
        sockets.open("claim:c1", folder / "node.sock")  # a repeated Prepare: the same one
        sockets.close("claim:c1")
        assert not (folder / "node.sock").exists() and list(staging.iterdir()) == []
        with pytest.raises(httpx.ConnectError):
            await _get(folder / "node.sock", "/v1/lanes/l1/buffers/b1")
        nursery.cancel_scope.cancel()


async def test_a_socket_that_cannot_take_its_place_is_refused_and_leaves_nothing(
    short_dir: pathlib.Path,
) -> None:
    folder, staging = short_dir / "claims" / "c1", short_dir / ".sockets"
    (folder / "node.sock").mkdir(parents=True)  # a pod made a folder of its name
    async with trio.open_nursery() as nursery:
        sockets = HoldSockets(_app([]), HTTP, nursery, staging)
        with pytest.raises(OSError):
            sockets.open("claim:c1", folder / "node.sock")
        assert list(staging.iterdir()) == [] and (folder / "node.sock").is_dir()
        sockets.close("claim:c1")  # nothing was served: nothing to close
        nursery.cancel_scope.cancel()
