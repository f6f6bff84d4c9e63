"""Telemetry is signed: a scheduler on loopback verifies each push with the node's
published keys and refuses unsigned, tampered, foreign-key, replayed and stale ones."""

from __future__ import annotations

import pathlib
import time

import httpx
import msgspec

from capabilities import KeyRing
from capabilities.push_signature import SIGNATURE_HEADER, PushRefusal, PushSigner
from node.machine.snapshot import NodeSnapshot
from tests.api_fixtures import running_daemon
from tests.scheduler_double import scheduler


def _refusal(reply: httpx.Response) -> str:
    assert reply.status_code == 401, reply.text
    refused: str = reply.json()["refused"]
    return refused


async def test_the_scheduler_accepts_the_nodes_signed_pushes_and_refuses_forgeries(
    tmp_path: pathlib.Path,
) -> None:
    async with scheduler() as sink:
        argv = ("--scheduler-url", sink.url, "--telemetry-interval", "0.1", "--node-id", "node-a")
        async with (
            running_daemon(tmp_path, *argv) as node,
            httpx.AsyncClient(timeout=5) as client,
        ):
            sink.register("node-a", node.url)
            await sink.wait_for(2, "node-a")
            assert sink.key_fetches == 1  # fetched once, then every push verifies offline
            signed = sink.from_node("node-a")[-1]
            assert msgspec.json.decode(signed.body, type=NodeSnapshot).node_id == "node-a"

            async def send(body: bytes, signature: str | None) -> str:
                headers = {"content-type": "application/json", "x-node-id": "node-a"}
                headers["x-forged"] = "1"  # told apart from the node's own pushes below
                if signature is not None:
                    headers[SIGNATURE_HEADER] = signature
                return _refusal(await client.post(sink.url, content=body, headers=headers))

            signature = signed.headers[SIGNATURE_HEADER]
            # The old push: an x-node-id header and nothing else.
            assert await send(signed.body, None) == PushRefusal.MISSING
            # The same push again.
            assert await send(signed.body, signature) == PushRefusal.REPLAYED
            # A body changed on the way, with the node's signature.
            tampered = signed.body.replace(b'"node-a"', b'"node-x"', 1)
            assert tampered != signed.body
            assert await send(tampered, signature) == PushRefusal.BODY_MISMATCH
            # An impostor signing with a key of its own under the node's id.
            impostor = PushSigner(KeyRing.open(tmp_path / "impostor"), "node-a", sink.url)
            fetches = sink.key_fetches
            assert await send(signed.body, impostor.sign(signed.body)) == PushRefusal.UNKNOWN_KEY
            assert sink.key_fetches == fetches + 1  # it looked again before refusing
            # The node's own key, but a signature made ten minutes ago.
            assert node.daemon.supervisor is not None
            keyring = node.daemon.supervisor.tokens.keyring
            old = PushSigner(keyring, "node-a", sink.url, clock=lambda: time.time() - 600)
            assert await send(signed.body, old.sign(signed.body)) == PushRefusal.STALE
            # A push signed for another scheduler.
            elsewhere = PushSigner(keyring, "node-a", "http://other.invalid/v1/telemetry")
            assert await send(signed.body, elsewhere.sign(signed.body)) == (
                PushRefusal.WRONG_AUDIENCE
            )
            # Through all that, the node's own pushes keep being accepted.
            seen = len(sink.from_node("node-a"))
            await sink.wait_for(seen + 2, "node-a")
            # The node's only refusals came before the scheduler knew its address.
            own = [reason for push, reason in sink.refused if "x-forged" not in push.headers]
            assert set(own) <= {PushRefusal.UNKNOWN_KEY}, own
