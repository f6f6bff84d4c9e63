"""Property: nothing but the exact token we minted is accepted.

Every single-character change, deletion or insertion, every truncation and
every extension of a valid token is refused with a typed reason, whether or
not the original sits in the validator's cache.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from capabilities import (
    Isolation,
    KeyRing,
    LaneOp,
    LaneValidator,
    TokenRefusal,
    TokenRefused,
    TokenService,
    paseto,
)

T0 = 1_800_000_000.0
LANE = "lane-a"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
# Characters a mutation may write: the base64url alphabet (most likely to get
# past the decoder), its standard-alphabet cousins, padding, separators, and
# some that are not ASCII at all.
CHARS = st.sampled_from(ALPHABET + "+/=. \n\x00é€")


class Fixed:
    """The parts every example shares; built once per module (no I/O per example)."""

    def __init__(self, state_dir: pathlib.Path) -> None:
        self.service = TokenService(
            "node-a", KeyRing.open(state_dir), ttl=600, clock=lambda: T0 + 1
        )
        self.with_footer = self.service.mint(
            invocation_id="inv-1",
            lane_id=LANE,
            ops=frozenset({LaneOp.EXECUTE}),
            vram_bytes=1 << 30,
            isolation=Isolation.SANDBOX,
            deadline=None,
        ).token
        self.cached = self.service.validator()
        self.uncached = self.service.validator(cache_size=0)
        for validator in (self.cached, self.uncached):
            validator.validate(self.with_footer, lane_id=LANE, op=LaneOp.EXECUTE)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixed]:
    yield Fixed(tmp_path_factory.mktemp("keys"))


def _refused(fixed: Fixed, token: str) -> None:
    assume(token != fixed.with_footer)
    for validator in (fixed.cached, fixed.uncached):
        _assert_refused(validator, token)


def _assert_refused(validator: LaneValidator, token: str) -> None:
    with pytest.raises(TokenRefused) as refused:
        validator.validate(token, lane_id=LANE, op=LaneOp.EXECUTE)
    assert isinstance(refused.value.reason, TokenRefusal)


@given(data=st.data())
def test_any_single_character_change_is_refused(fixed: Fixed, data: st.DataObject) -> None:
    token = fixed.with_footer
    index = data.draw(st.integers(0, len(token) - 1), label="index")
    char = data.draw(CHARS.filter(lambda c: c != token[index]), label="char")
    _refused(fixed, token[:index] + char + token[index + 1 :])


@given(data=st.data())
def test_any_deletion_is_refused(fixed: Fixed, data: st.DataObject) -> None:
    token = fixed.with_footer
    start = data.draw(st.integers(0, len(token) - 1), label="start")
    length = data.draw(st.integers(1, len(token) - start), label="length")
    _refused(fixed, token[:start] + token[start + length :])


@given(data=st.data())
def test_any_insertion_is_refused(fixed: Fixed, data: st.DataObject) -> None:
    token = fixed.with_footer
    index = data.draw(st.integers(0, len(token)), label="index")
    extra = data.draw(st.text(CHARS, min_size=1, max_size=8), label="extra")
    _refused(fixed, token[:index] + extra + token[index:])


@given(cut=st.integers(1, 600))
def test_any_truncation_is_refused(fixed: Fixed, cut: int) -> None:
    token = fixed.with_footer
    _refused(fixed, token[: max(0, len(token) - cut)])
    _refused(fixed, token[min(cut, len(token)) :])


@given(extra=st.text(min_size=1, max_size=64) | st.text(CHARS, min_size=1, max_size=64))
def test_any_extension_is_refused(fixed: Fixed, extra: str) -> None:
    _refused(fixed, fixed.with_footer + extra)
    _refused(fixed, extra + fixed.with_footer)


@given(data=st.data())
def test_any_bit_flip_in_the_decoded_parts_is_refused(fixed: Fixed, data: st.DataObject) -> None:
    # Re-encoded canonically, so only the signature can catch it.
    parsed = paseto.parse(fixed.with_footer)
    body = bytearray(parsed.payload + parsed.signature)
    footer = bytearray(parsed.footer)
    target = data.draw(st.sampled_from(["body", "footer"]), label="part")
    part = body if target == "body" else footer
    bit = data.draw(st.integers(0, len(part) * 8 - 1), label="bit")
    part[bit // 8] ^= 1 << (bit % 8)
    forged = "v4.public." + paseto.b64url_encode(bytes(body)) + "." + paseto.b64url_encode(footer)
    _refused(fixed, forged)


def test_the_original_is_still_accepted(fixed: Fixed) -> None:
    for validator in (fixed.cached, fixed.uncached):
        validator.validate(fixed.with_footer, lane_id=LANE, op=LaneOp.EXECUTE)
