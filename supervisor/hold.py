"""What a standing hold is (`supervisor.standing_holds`): its lanes, reservations and
tokens, and the subject that names it."""

from __future__ import annotations

import dataclasses

from machine.reservation import Reservation

__all__ = ["HOLD_PREFIX", "Hold", "HoldGrant", "hold_subject", "subject_of"]

HOLD_PREFIX = "claim:"


def hold_subject(claim_uid: str) -> str:
    return f"{HOLD_PREFIX}{claim_uid}"


def subject_of(reservation_id: str) -> str:
    return reservation_id.rpartition("/")[0]


@dataclasses.dataclass(frozen=True)
class HoldGrant:
    """One lane of a hold: all of it (a whole GPU, a MIG instance) or `vram_bytes` of a
    shared GPU's memory, served only through its lane host."""

    lane_id: str
    vram_bytes: int = 0
    whole: bool = True


@dataclasses.dataclass(eq=False)
class Hold:
    claim_uid: str
    reservations: tuple[Reservation, ...]
    tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # by lane, in order
    minted_at: float = 0.0

    @property
    def subject(self) -> str:
        return hold_subject(self.claim_uid)

    @property
    def lane_ids(self) -> tuple[str, ...]:
        return tuple(r.lanes[0].lane_id for r in self.reservations)

    def grants(self) -> tuple[HoldGrant, ...]:
        return tuple(
            HoldGrant(
                lane_id=r.lanes[0].lane_id,
                vram_bytes=0 if r.lanes[0].exclusive else r.lanes[0].vram_bytes,
                whole=r.lanes[0].exclusive,
            )
            for r in self.reservations
        )
