"""Properties of claims and of the validity window.

- claims survive encoding and decoding unchanged, and a minted token
  validates to exactly the claims it was minted with;
- at any instant a token is accepted exactly when
  nbf - leeway <= now < exp + leeway, and refused with not_yet_valid or
  expired otherwise;
- the lifetime never exceeds the TTL, one hour, or the deadline plus margin.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capabilities import (
    DEADLINE_MARGIN,
    MAX_TTL_SECONDS,
    Claims,
    Isolation,
    KeyRing,
    LaneOp,
    MintError,
    TokenRefusal,
    TokenRefused,
    TokenService,
)
from capabilities import claims as claims_module

T0 = 1_800_000_000

identifiers = st.text(min_size=1, max_size=256)
op_sets = st.frozensets(st.sampled_from(list(LaneOp)), min_size=1)
isolations = st.sampled_from(list(Isolation))
vram = st.integers(0, 2**63 - 1)


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def keyring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyRing]:
    yield KeyRing.open(tmp_path_factory.mktemp("keys"))


@st.composite
def claims(draw: st.DrawFn) -> Claims:
    iat = draw(st.integers(0, 2**33))
    nbf = iat + draw(st.integers(0, 60))
    exp = draw(st.integers(nbf + 1, iat + int(MAX_TTL_SECONDS)))
    return Claims(
        iss=draw(identifiers),
        sub=draw(identifiers),
        aud=draw(identifiers),
        iat=claims_module.from_unix(iat),
        nbf=claims_module.from_unix(nbf),
        exp=claims_module.from_unix(exp),
        jti=draw(st.binary(min_size=16, max_size=16)).hex(),
        ops=draw(st.frozensets(st.sampled_from(list(LaneOp)))),
        vram_bytes=draw(vram),
        isolation=draw(isolations),
    )


@given(value=claims())
def test_claims_round_trip(value: Claims) -> None:
    encoded = claims_module.encode(value)
    assert claims_module.decode_claims(encoded) == value
    assert claims_module.encode(claims_module.decode_claims(encoded)) == encoded


@given(value=claims(), offset=st.sampled_from(["+00:00", "+02:00", "-05:30"]))
def test_any_rfc3339_offset_means_the_same_instant(value: Claims, offset: str) -> None:
    hours, minutes = int(offset[1:3]), int(offset[4:6])
    delta = datetime.timedelta(hours=hours, minutes=minutes)
    zone = datetime.timezone(delta if offset[0] == "+" else -delta)
    shifted = msgspec.structs.replace(
        value, iat=value.iat.astimezone(zone), exp=value.exp.astimezone(zone)
    )
    decoded = claims_module.decode_claims(claims_module.encode(shifted))
    assert decoded.iat.timestamp() == value.iat.timestamp()
    assert decoded.exp.timestamp() == value.exp.timestamp()


@given(
    invocation=identifiers,
    lane=identifiers,
    ops=op_sets,
    vram_bytes=vram,
    isolation=isolations,
    node=identifiers,
)
def test_minted_tokens_validate_to_their_claims(
    keyring: KeyRing,
    invocation: str,
    lane: str,
    ops: frozenset[LaneOp],
    vram_bytes: int,
    isolation: Isolation,
    node: str,
) -> None:
    service = TokenService(node, keyring, ttl=300, clock=Clock())
    minted = service.mint(
        invocation_id=invocation,
        lane_id=lane,
        ops=ops,
        vram_bytes=vram_bytes,
        isolation=isolation,
        deadline=None,
    )
    validator = service.validator()
    for op in ops:
        assert validator.validate(minted.token, lane_id=lane, op=op, vram_bytes=vram_bytes) == (
            minted.claims
        )
    for op in set(LaneOp) - ops:
        with pytest.raises(TokenRefused) as refused:
            validator.validate(minted.token, lane_id=lane, op=op)
        assert refused.value.reason is TokenRefusal.OP_NOT_GRANTED


@given(
    leeway=st.integers(0, 30),
    ttl=st.integers(1, 7200),
    start=st.floats(0, 0.999),
    at=st.integers(-100, 7300) | st.integers(-40, 40).map(lambda d: d + 10_000),
    fraction=st.sampled_from([0.0, 0.001, 0.5, 0.999]),
)
def test_the_time_window_edges(
    keyring: KeyRing, leeway: int, ttl: int, start: float, at: int, fraction: float
) -> None:
    clock = Clock()
    clock.now = T0 + start
    service = TokenService("node-a", keyring, ttl=ttl, clock=clock, leeway=leeway)
    minted = service.mint(
        invocation_id="inv",
        lane_id="lane",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=None,
    )
    nbf = minted.claims.nbf.timestamp()
    exp = minted.claims.exp.timestamp()
    assert nbf == T0
    assert exp - nbf == min(ttl, MAX_TTL_SECONDS)
    # Probe around both edges as well as anywhere in between.
    for now in (T0 + at + fraction, nbf - leeway + at % 3 - 1, exp + leeway + at % 3 - 1):
        clock.now = now
        validator = service.validator(cache_size=0)
        if nbf - leeway <= now < exp + leeway:
            validator.validate(minted.token, lane_id="lane", op=LaneOp.EXECUTE)
        else:
            with pytest.raises(TokenRefused) as refused:
                validator.validate(minted.token, lane_id="lane", op=LaneOp.EXECUTE)
            expected = TokenRefusal.NOT_YET_VALID if now < nbf else TokenRefusal.EXPIRED
            assert refused.value.reason is expected


@given(ttl=st.integers(1, 7200), deadline_in=st.floats(-200, 8000))
def test_lifetime_never_passes_ttl_hour_or_deadline(
    keyring: KeyRing, ttl: int, deadline_in: float
) -> None:
    clock = Clock()
    service = TokenService("node-a", keyring, ttl=ttl, clock=clock)
    deadline = T0 + deadline_in
    try:
        minted = service.mint(
            invocation_id="inv",
            lane_id="lane",
            ops=[LaneOp.EXECUTE],
            vram_bytes=0,
            isolation=Isolation.SHARED,
            deadline=deadline,
        )
    except MintError:
        assert deadline + DEADLINE_MARGIN < T0 + 1
        return
    exp = minted.claims.exp.timestamp()
    assert T0 < exp <= T0 + min(ttl, MAX_TTL_SECONDS)
    assert exp <= deadline + DEADLINE_MARGIN
    assert exp == int(min(T0 + min(ttl, MAX_TTL_SECONDS), deadline + DEADLINE_MARGIN))
