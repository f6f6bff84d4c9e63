"""Tokens signed with the node's own key that its live entries never issued.

Whoever holds the signing key can sign any claims. A live `jti` once made such a
token authority even when it named another invocation, another lane, 16 GiB of
VRAM or a wider scope than its entry was issued with; and a claim given twice
was read last-wins. Both are refused now, with their typed reasons, changing nothing.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from capabilities import LaneOp, TokenRefusal, TokenRefused, paseto
from capabilities.claims import decode_claims, from_unix
from capabilities.publication import INACTIVE
from tests.adversarial.fixtures import craft, kid_footer
from tests.adversarial.token_authority import ALL_OPS, LANE, NODE, OTHER_LANE, Authority

pytestmark = pytest.mark.hostile("tokens")

GiB = 2**30


@pytest.fixture
def node(tmp_path: pathlib.Path) -> Authority:
    return Authority(tmp_path)


def _claims(token: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(paseto.parse(token).payload)
    return data


def _resign(node: Authority, claims: dict[str, Any] | bytes) -> str:
    return craft(node.secret(), claims, footer=kid_footer(node.keyring.active_kid), node_id=NODE)


def _later_exp(claims: dict[str, Any]) -> None:
    """Ten more minutes, still within the one-hour cap."""
    exp = decode_claims(json.dumps(claims).encode()).exp.timestamp() + 600
    claims["exp"] = from_unix(exp).isoformat().replace("+00:00", "Z")


# (edit of a live token's claims, the lane it is presented on, the VRAM it asks for)
RESIGNED: dict[str, tuple[Callable[[dict[str, Any]], object], str, int]] = {
    "other_lane": (lambda c: c.update(aud=OTHER_LANE), OTHER_LANE, 0),
    "other_invocation": (lambda c: c.update(sub="inv-2"), LANE, 0),
    "16_gib": (lambda c: c.update(vram_bytes=16 * GiB), LANE, 16 * GiB),
    "wider_ops": (lambda c: c.update(ops=[op.value for op in ALL_OPS]), LANE, 0),
    "other_isolation": (lambda c: c.update(isolation="dedicated"), LANE, 0),
    "later_exp": (_later_exp, LANE, 0),
}


@pytest.mark.parametrize("case", list(RESIGNED))
def test_token_live_jti_resigned_with_other_claims_refused(node: Authority, case: str) -> None:
    edit, lane, vram = RESIGNED[case]
    minted = node.mint(ops=(LaneOp.EXECUTE, LaneOp.MEMORY_RESERVE), vram=GiB)
    node.mint(invocation_id="inv-2", lane_id=OTHER_LANE)  # the other lane and invocation exist
    claims = _claims(minted.token)
    edit(claims)
    resigned = _resign(node, claims)
    op = LaneOp.MEMORY_RESERVE if vram else LaneOp.EXECUTE
    node.refuse(resigned, TokenRefusal.NOT_AS_ISSUED, lane_id=lane, op=op, vram_bytes=vram)
    assert node.service.introspect(resigned) == INACTIVE
    # The genuine token is still its entry's and still works.
    node.validator.validate(minted.token, lane_id=LANE, op=LaneOp.EXECUTE)


def test_token_resigned_claims_cannot_be_refreshed(node: Authority) -> None:
    minted = node.mint(vram=GiB)
    claims = _claims(minted.token)
    claims["vram_bytes"] = 16 * GiB
    forged = decode_claims(json.dumps(claims).encode())
    node.clock.now = minted.claims.exp.timestamp() - 1  # past halfway: a refresh is due
    with pytest.raises(TokenRefused) as refused:
        node.service.refresh(forged, deadline=None)
    assert refused.value.reason is TokenRefusal.NOT_AS_ISSUED
    assert node.service.live.current("inv-1", LANE) == minted.claims.jti


def test_token_of_an_ended_invocation_resigned_is_still_revoked(node: Authority) -> None:
    minted = node.mint()
    node.service.revoke_invocation("inv-1")
    claims = _claims(minted.token)
    claims["vram_bytes"] = 16 * GiB
    node.refuse(_resign(node, claims), TokenRefusal.REVOKED)


def _doubled(text: str, key: str, value: object) -> bytes:
    return (text[:-1] + f", {json.dumps(key)}: {json.dumps(value)}}}").encode()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("aud", OTHER_LANE),
        ("aud", LANE),  # the same value twice is refused as well
        ("sub", "inv-2"),
        ("vram_bytes", 16 * GiB),
        ("ops", [op.value for op in ALL_OPS]),
        ("jti", "0" * 32),
        ("iss", NODE),
    ],
    ids=["aud_other", "aud_same", "sub", "vram", "ops", "jti", "iss"],
)
def test_token_duplicate_claim_keys_refused(node: Authority, key: str, value: object) -> None:
    """msgspec, like most JSON decoders, keeps the last of a duplicate key and other
    verifiers the first: a signed payload that says two things is refused."""
    minted = node.mint()
    token = _resign(node, _doubled(json.dumps(_claims(minted.token)), key, value))
    for lane in (LANE, OTHER_LANE):
        node.refuse(token, TokenRefusal.DUPLICATE_CLAIM, lane_id=lane)
    assert node.service.introspect(token) == INACTIVE


def test_token_duplicate_kid_in_the_footer_refused(node: Authority) -> None:
    minted = node.mint()
    kid = node.keyring.active_kid
    footer = f'{{"kid":"{kid}","kid":"{kid}"}}'.encode()
    token = craft(node.secret(), _claims(minted.token), footer=footer, node_id=NODE)
    node.refuse(token, TokenRefusal.BAD_ENCODING)
