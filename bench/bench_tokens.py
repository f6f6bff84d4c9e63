"""Capability tokens: our verify and mint paths beside the bare primitive and pyseto.

Every pair is measured in the same run, interleaved over several rounds, and
the median rate of each side is compared:

- first-time verification (every call misses the validator's cache: a cycle
  of more distinct tokens than the cache holds) against a bare `cryptography`
  Ed25519 verify of the same PAE message and against pyseto's decode of the
  same tokens (with its JSON deserializer, so it parses claims as we do);
- repeated verification of one token through the cache against the bare verify;
- minting (claims, footer, PAE, signature, revocation tracking) against a bare
  Ed25519 sign of a message of the same size.
"""

from __future__ import annotations

import functools
import itertools
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import pyseto

from bench.harness import Finding, rate
from capabilities import Isolation, KeyRing, LaneOp, TokenService, paseto

ROUNDS = 5
SECONDS = 0.3
DISTINCT_TOKENS = 6000
CACHE_SIZE = 4096  # smaller than DISTINCT_TOKENS: cycling through them always misses
LANE = "lane-gpu-0"
OPS = frozenset({LaneOp.MEMORY_RESERVE, LaneOp.MEMORY_RELEASE, LaneOp.EXECUTE})


def _cycle(fns: list[Callable[[], object]]) -> Callable[[], object]:
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _side_by_side(subjects: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median calls/s of each subject, measured interleaved over ROUNDS rounds."""
    samples: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(ROUNDS):
        for name, fn in subjects.items():
            samples[name].append(rate(fn, seconds=SECONDS))
    return {name: statistics.median(values) for name, values in samples.items()}


def _fmt(per_second: float) -> str:
    return f"{per_second:,.0f}/s ({1e6 / per_second:.1f} us)"


def run() -> list[Finding]:
    with tempfile.TemporaryDirectory() as state:
        return _run(pathlib.Path(state))


def _run(state_dir: pathlib.Path) -> list[Finding]:
    keyring = KeyRing.open(state_dir)
    service = TokenService("bench-node", keyring, ttl=3600, max_live_tokens=1_000_000)
    deadline = time.time() + 3000
    tokens = [
        service.mint(
            invocation_id=f"inv-{i}",
            lane_id=LANE,
            ops=OPS,
            vram_bytes=8 << 30,
            isolation=Isolation.SANDBOX,
            deadline=deadline,
        ).token
        for i in range(DISTINCT_TOKENS)
    ]
    kid, secret = keyring.signing_key()
    public = secret.public_key()
    implicit = service.implicit_assertion()
    header = paseto.HEADER.encode()

    bare_calls: list[Callable[[], object]] = []
    for token in tokens:
        parsed = paseto.parse(token)
        message = paseto.pae(header, parsed.payload, parsed.footer, implicit)
        bare_calls.append(functools.partial(public.verify, parsed.signature, message))

    miss_validator = service.validator(cache_size=CACHE_SIZE)
    ours_first = _cycle(
        [
            functools.partial(miss_validator.validate, token, lane_id=LANE, op=LaneOp.EXECUTE)
            for token in tokens
        ]
    )
    pyseto_key = pyseto.Key.from_paserk(keyring.public_paserks()[kid])
    pyseto_calls = _cycle(
        [
            functools.partial(
                pyseto.decode, pyseto_key, token, implicit_assertion=implicit, deserializer=json
            )
            for token in tokens
        ]
    )
    first = _side_by_side({"bare": _cycle(bare_calls), "ours": ours_first, "pyseto": pyseto_calls})
    assert miss_validator.hits == 0, "first-time bench must never hit the cache"

    hit_validator = service.validator(cache_size=CACHE_SIZE)
    one = tokens[0]
    cached = _side_by_side(
        {
            "bare": bare_calls[0],
            "ours": lambda: hit_validator.validate(one, lane_id=LANE, op=LaneOp.EXECUTE),
        }
    )

    sign_message = paseto.pae(header, paseto.parse(one).payload, paseto.parse(one).footer, implicit)
    minter = TokenService("bench-node", keyring, ttl=3600, max_live_tokens=10_000_000)
    minted = itertools.count()
    mint = _side_by_side(
        {
            "bare": lambda: secret.sign(sign_message),
            "ours": lambda: minter.mint(
                invocation_id=f"inv-{next(minted)}",
                lane_id=LANE,
                ops=OPS,
                vram_bytes=8 << 30,
                isolation=Isolation.SANDBOX,
                deadline=deadline,
            ),
        }
    )

    first_vs_bare = first["ours"] / first["bare"]
    first_vs_pyseto = first["ours"] / first["pyseto"]
    cached_vs_bare = cached["ours"] / cached["bare"]
    mint_vs_sign = mint["ours"] / mint["bare"]
    return [
        Finding(
            name="first-time verify vs bare Ed25519 verify",
            target=">= 0.90x the bare verify rate",
            figures={"ours": _fmt(first["ours"]), "bare verify": _fmt(first["bare"])},
            ratio=first_vs_bare,
            met=first_vs_bare >= 0.90,
        ),
        Finding(
            name="first-time verify vs pyseto decode",
            target="> 1.00x pyseto's decode rate",
            figures={"ours": _fmt(first["ours"]), "pyseto": _fmt(first["pyseto"])},
            ratio=first_vs_pyseto,
            met=first_vs_pyseto > 1.0,
        ),
        Finding(
            name="cached verify vs bare Ed25519 verify",
            target=">= 10x the bare verify rate",
            figures={"ours": _fmt(cached["ours"]), "bare verify": _fmt(cached["bare"])},
            ratio=cached_vs_bare,
            met=cached_vs_bare >= 10.0,
        ),
        Finding(
            name="mint vs bare Ed25519 sign",
            target=">= 0.60x the bare sign rate (our own target; the issue sets none)",
            figures={"ours": _fmt(mint["ours"]), "bare sign": _fmt(mint["bare"])},
            ratio=mint_vs_sign,
            met=mint_vs_sign >= 0.60,
        ),
    ]
