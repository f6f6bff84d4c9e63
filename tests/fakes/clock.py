"""A wall clock a test sets by hand, for code that takes a `clock` callable."""

from __future__ import annotations

__all__ = ["T0", "FakeClock"]

#: A fixed Unix time far from now, so nothing passes by accident of the real date.
T0 = 1_800_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
