"""The daemon in-process: port 0, probes, the error envelope, and a stop on request."""

from __future__ import annotations

import pathlib

import httpx
import msgspec
import trio

from api.errors import ErrorEnvelope
from node.daemon import Daemon
from tests.api_fixtures import daemon_config


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
