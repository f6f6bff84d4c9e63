"""Telemetry is signed: a scheduler on loopback verifies each push with the node's
published keys and refuses unsigned, tampered, foreign-key, replayed and stale ones;
a configured bearer credential goes with every push."""

from __future__ import annotations

import pathlib
import time

import httpx
import msgspec
import pytest
import trio

from capabilities import KeyRing
from capabilities.push_signature import SIGNATURE_HEADER, PushRefusal, PushSigner
from machine.snapshot import NodeSnapshot
from node.daemon import Daemon, StartupError
from tests.api_fixtures import daemon_config, running_daemon
from tests.scheduler_double import BAD_BEARER, scheduler


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


def _bearer_file(path: pathlib.Path, text: str, mode: int = 0o600) -> pathlib.Path:
    path.write_text(text)
    path.chmod(mode)
    return path


async def test_a_configured_bearer_credential_goes_with_every_push(
    tmp_path: pathlib.Path,
) -> None:
    credential = "push-" + "x" * 40
    bearer = _bearer_file(tmp_path / "telemetry.bearer", f"{credential}\n")
    async with scheduler(bearer=credential) as sink:
        argv = ("--scheduler-url", sink.url, "--telemetry-interval", "0.1", "--node-id", "node-b")
        async with (
            running_daemon(tmp_path, *argv, "--telemetry-bearer-file", str(bearer)) as node,
            httpx.AsyncClient(timeout=5) as client,
        ):
            sink.register("node-b", node.url)
            await sink.wait_for(2, "node-b")
            assert {p.headers["authorization"] for p in sink.from_node("node-b")} == {
                f"Bearer {credential}"
            }
            # The node's valid signature without the credential is not enough.
            signed = sink.from_node("node-b")[-1]
            headers = {k: v for k, v in signed.headers.items() if k != "authorization"}
            headers.pop("content-length")
            reply = await client.post(sink.url, content=signed.body, headers=headers)
            assert _refusal(reply) == BAD_BEARER


@pytest.mark.parametrize(
    ("text", "mode", "why"),
    [
        ("push-credential", 0o644, "mode 0644"),
        ("two words", 0o600, "not a bearer credential"),
        ("", 0o600, "not a bearer credential"),
    ],
)
async def test_an_unsafe_or_unusable_bearer_file_stops_start_up(
    tmp_path: pathlib.Path, text: str, mode: int, why: str
) -> None:
    bearer = _bearer_file(tmp_path / "telemetry.bearer", text, mode)
    argv = ("--scheduler-url", "http://127.0.0.1:9/", "--telemetry-bearer-file", str(bearer))
    daemon = Daemon(daemon_config(tmp_path, *argv), handle_signals=False)
    with pytest.raises(StartupError) as refused, trio.fail_after(20):
        await daemon.run()
    assert str(bearer) in str(refused.value) and why in str(refused.value)
    assert text not in str(refused.value) or not text
