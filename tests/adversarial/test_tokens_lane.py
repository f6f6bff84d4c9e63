"""Hostile capability tokens at the lane edge: POST /v1/lanes/{lane}/work of a real daemon.

Each refusal is 401 (who the token is) or 403 (what it may do) with the typed
reason as the error code, and leaves the node exactly as it was: capacity,
invocations, live tokens, lane memory, ledger and journal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pyseto
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from capabilities import paseto
from capabilities.claims import from_unix
from tests.adversarial.fixtures import (
    GiB,
    bearer,
    claims_of,
    craft,
    error_code,
    fresh_kid,
    gpu_request,
    kid_footer,
    sleep_request,
    wait_for_state,
)
from tests.adversarial.shared_daemon import SharedDaemon, SharedNode, shared_daemon

# One daemon for the module, handed back to each test as it was found
# (`SharedDaemon.node`); one worker runs them all.
pytestmark = [pytest.mark.hostile("tokens"), pytest.mark.xdist_group("tokens_lane")]

NOOP = {"op": "execute", "kernel": "noop"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemon]:
    with shared_daemon(tmp_path_factory.mktemp("tokens-lane")) as shared:
        yield shared


def _gpu(invocation_id: str, vram: int = GiB, seconds: float = 60) -> dict[str, Any]:
    """A GPU sleeper whose lane sessions start in a fraction of a second: their hosts
    (an interpreter and NumPy) run under its CPU quota, which at `gpu_request`'s fifth
    of a CPU takes a second or more to start one."""
    body = gpu_request(invocation_id, vram, seconds)
    body["resources"]["cpu_millis"] = 2000
    return body


def _rfc3339(seconds: float) -> str:
    return from_unix(seconds).isoformat().replace("+00:00", "Z")


def _signing_key(node: SharedNode) -> Ed25519PrivateKey:
    sup = node.daemon.supervisor
    assert sup is not None
    return node.inside(lambda: sup.tokens.keyring.signing_key()[1])


def _node_id(node: SharedNode) -> str:
    sup = node.daemon.supervisor
    assert sup is not None
    return node.inside(lambda: sup.tokens.node_id)


async def _work(
    node: SharedNode, lane: str, token: str, body: dict[str, Any] = NOOP
) -> httpx.Response:
    return await node.client.post(f"/v1/lanes/{lane}/work", json=body, headers=bearer(token))


def _variants(node: SharedNode, token: str) -> dict[str, tuple[str, int, str]]:
    """name -> (hostile token, status, code), all derived from one genuine GPU token."""
    claims = claims_of(token)
    footer = paseto.parse(token).footer
    key = _signing_key(node)
    node_id = _node_id(node)
    rest = token[len(paseto.HEADER) :]
    body, _, footer_text = rest.partition(".")
    foreign, foreign_kid = fresh_kid()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    v2 = pyseto.encode(pyseto.Key.new(2, "public", pem), claims, footer=footer).decode()
    now = time.time()
    expired = dict(claims, iat=_rfc3339(now - 600), nbf=_rfc3339(now - 600), exp=_rfc3339(now - 60))
    future = dict(claims, iat=_rfc3339(now + 600), nbf=_rfc3339(now + 600), exp=_rfc3339(now + 900))
    tampered = bytearray(paseto.parse(token).payload)
    tampered[5] ^= 1
    signature = paseto.parse(token).signature
    doubled = (json.dumps(claims)[:-1] + ', "vram_bytes": 17179869184}').encode()
    tampered_token = (
        paseto.HEADER + paseto.b64url_encode(bytes(tampered) + signature) + "." + footer_text
    )
    return {
        "v4_local_header": ("v4.local." + rest, 401, "bad_header"),
        "v3_public_header": ("v3.public." + rest, 401, "bad_header"),
        "v2_public_genuine": (v2, 401, "bad_header"),
        "foreign_key_our_kid": (
            craft(foreign, claims, footer=footer, node_id=node_id),
            401,
            "bad_signature",
        ),
        "foreign_key_own_kid": (
            craft(foreign, claims, footer=kid_footer(foreign_kid), node_id=node_id),
            401,
            "unknown_key",
        ),
        "no_footer": (paseto.HEADER + body, 401, "unknown_key"),
        "tampered_payload": (tampered_token, 401, "bad_signature"),
        "tampered_last_char": (
            token[:-1] + ("A" if token[-1] != "A" else "B"),
            401,
            "bad_encoding",
        ),
        "padding": (paseto.HEADER + body + "==." + footer_text, 401, "bad_encoding"),
        "standard_alphabet": (
            paseto.HEADER + body.replace("-", "+").replace("_", "/") + "." + footer_text,
            401,
            "bad_encoding",
        ),
        "oversized": (token + "A" * (paseto.MAX_TOKEN_CHARS + 1 - len(token)), 401, "oversized"),
        "other_node_implicit": (
            craft(key, claims, footer=footer, node_id="some-other-node"),
            401,
            "bad_signature",
        ),
        "other_issuer": (
            craft(key, dict(claims, iss="some-other-node"), footer=footer, node_id=node_id),
            401,
            "wrong_issuer",
        ),
        "expired": (craft(key, expired, footer=footer, node_id=node_id), 401, "expired"),
        # Our own key over a live jti: only the claims issued under it are authority.
        "resigned_16_gib": (
            craft(key, dict(claims, vram_bytes=16 * GiB), footer=footer, node_id=node_id),
            401,
            "not_as_issued",
        ),
        "resigned_other_invocation": (
            craft(key, dict(claims, sub="someone-else"), footer=footer, node_id=node_id),
            401,
            "not_as_issued",
        ),
        "duplicate_key": (
            craft(key, doubled, footer=footer, node_id=node_id),
            401,
            "duplicate_claim",
        ),
        "not_yet_valid": (craft(key, future, footer=footer, node_id=node_id), 401, "not_yet_valid"),
    }


async def test_lane_hostile_tokens_refused_and_nothing_changes(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(_gpu("hostile-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        before = await node.state()
        tried = 0
        for name, (hostile, status, code) in _variants(node, token).items():
            if hostile == token:
                continue  # e.g. a token with no '-' or '_' has no standard-alphabet alias
            for body in (NOOP, {"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]}):
                reply = await _work(node, lane, hostile, body)
                assert (reply.status_code, error_code(reply)) == (status, code), (name, reply.text)
                tried += 1
        assert tried >= 34
        assert await node.state() == before
        # The genuine token still works: refusals poisoned nothing.
        assert (await _work(node, lane, token)).status_code == 200


async def test_lane_token_for_another_lane_refused_403(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(_gpu("audience-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        others = [other for other in await node.lanes("mig") if other != lane]
        before = await node.state()
        for other in [*others, *(await node.lanes("cpu"))]:
            for body in (NOOP, {"op": "memory_reserve", "dtype": "uint8", "shape": [1]}):
                reply = await _work(node, other, token, body)
                assert reply.status_code == 403 and error_code(reply) == "wrong_audience"
        assert await node.state() == before


async def test_lane_live_jti_resigned_for_another_lane_refused_401(daemon: SharedDaemon) -> None:
    """With the signing key, a live token re-signed for another lane once did work there."""
    async with daemon.node() as node:
        accepted = await node.submit(_gpu("resigned-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        key, footer = _signing_key(node), paseto.parse(token).footer
        before = await node.state()
        for other in [x for x in await node.lanes("mig") if x != lane] + await node.lanes("cpu"):
            resigned = craft(
                key, dict(claims_of(token), aud=other), footer=footer, node_id=_node_id(node)
            )
            for body in (NOOP, {"op": "memory_reserve", "dtype": "uint8", "shape": [1]}):
                reply = await _work(node, other, resigned, body)
                assert (reply.status_code, error_code(reply)) == (401, "not_as_issued"), reply.text
        assert await node.state() == before
        assert (await _work(node, lane, token)).status_code == 200


async def test_lane_cpu_token_asking_memory_reserve_refused(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(sleep_request("cpu-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        assert lane in await node.lanes("cpu")
        before = await node.state()
        reserve = await _work(
            node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [1]}
        )
        assert reserve.status_code == 403 and error_code(reserve) == "op_not_granted"
        release = await _work(
            node, lane, token, {"op": "memory_release", "buffer_id": "buf_" + "0" * 32}
        )
        assert release.status_code == 403 and error_code(release) == "op_not_granted"
        assert await node.state() == before


async def test_lane_vram_beyond_budget_refused_cumulatively(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(_gpu("vram", vram=GiB))
        lane, token = next(iter(accepted["tokens"].items()))
        half = await _work(
            node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [GiB // 2]}
        )
        assert half.status_code == 200
        before = await node.state()
        # Each ask fits alone; the sum would not: the budget covers what it would then hold.
        over = await _work(
            node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [GiB // 2 + 1]}
        )
        assert over.status_code == 403 and error_code(over) == "vram_over_budget"
        huge = await _work(
            node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [2**25, 2**25]}
        )
        assert huge.status_code == 403 and error_code(huge) == "vram_over_budget"
        assert await node.state() == before
        assert node.lane_bytes()[lane] == GiB // 2


async def test_lane_buffer_theft_on_a_shared_lane_is_404(daemon: SharedDaemon) -> None:
    """Two invocations pinned onto the one full GPU lane (the others drained)."""
    async with daemon.node() as node:
        gpu_lane = (await node.lanes("gpu"))[0]
        for lane in await node.lanes("mig"):
            assert (await node.client.post(f"/v1/lanes/{lane}/drain", headers=node.adm)).is_success
        owner = await node.submit(_gpu("owner", vram=GiB))
        thief = await node.submit(_gpu("thief", vram=GiB))
        assert list(owner["tokens"]) == list(thief["tokens"]) == [gpu_lane]
        reserve = await _work(
            node,
            gpu_lane,
            owner["tokens"][gpu_lane],
            {"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]},
        )
        buffer_id = reserve.json()["buffer_id"]
        before = await node.state()
        stolen = await _work(
            node,
            gpu_lane,
            thief["tokens"][gpu_lane],
            {"op": "memory_release", "buffer_id": buffer_id},
        )
        assert stolen.status_code == 404 and error_code(stolen) == "buffer_not_found"
        guessed = await _work(
            node,
            gpu_lane,
            thief["tokens"][gpu_lane],
            {"op": "memory_release", "buffer_id": "buf_" + "f" * 32},
        )
        assert guessed.status_code == 404 and error_code(guessed) == "buffer_not_found"
        assert await node.state() == before
        mine = await _work(
            node,
            gpu_lane,
            owner["tokens"][gpu_lane],
            {"op": "memory_release", "buffer_id": buffer_id},
        )
        assert mine.status_code == 200 and mine.json()["bytes_held"] == 0


async def test_lane_token_replayed_after_invocation_ended_refused(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        baseline = await node.state()
        accepted = await node.submit(_gpu("short", seconds=2))
        lane, token = next(iter(accepted["tokens"].items()))
        assert (
            await _work(
                node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]}
            )
        ).is_success
        assert (await wait_for_state(node, "short"))["state"] == "succeeded"
        for body in (NOOP, {"op": "memory_reserve", "dtype": "uint8", "shape": [1]}):
            replay = await _work(node, lane, token, body)
            assert replay.status_code == 401 and error_code(replay) == "revoked"
        after = await node.state()
        assert after.capacity == baseline.capacity
        assert after.live_tokens == baseline.live_tokens == 0
        assert after.lane_bytes == baseline.lane_bytes
        assert after.ledger == after.journal == frozenset()


async def test_lane_token_replayed_after_cancel_refused(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        baseline = await node.state()
        accepted = await node.submit(_gpu("cancelled"))
        lane, token = next(iter(accepted["tokens"].items()))
        assert (
            await _work(
                node, lane, token, {"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]}
            )
        ).is_success
        assert node.lane_bytes()[lane] == 2**20
        ended = await node.client.delete("/v1/invocations/cancelled", headers=node.op)
        assert ended.json()["state"] == "cancelled"
        replay = await _work(node, lane, token)
        assert replay.status_code == 401 and error_code(replay) == "revoked"
        after = await node.state()
        assert after.capacity == baseline.capacity and after.lane_bytes == baseline.lane_bytes
        assert after.live_tokens == 0


async def test_lane_operator_secret_is_not_a_capability(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(_gpu("secret-holder"))
        lane = next(iter(accepted["tokens"]))
        before = await node.state()
        for secret in (node.admin, node.scheduler, "v4.public.", "null", "v4.public.."):
            reply = await _work(node, lane, secret)
            assert reply.status_code == 401, reply.text
        for header in ("bearer x", "Basic YWRtaW46YWRtaW4=", "Bearer", "v4.public.x"):
            reply = await node.client.post(
                f"/v1/lanes/{lane}/work", json=NOOP, headers={"Authorization": header}
            )
            assert reply.status_code == 401, reply.text
        assert await node.state() == before
