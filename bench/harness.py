"""The small harness every benchmark uses.

A benchmark module is `bench/bench_<topic>.py` with a `run() -> list[Finding]`.
Each finding compares two measurements taken side by side in the same run, so
the figure that matters is a ratio, never an absolute time alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Finding:
    """One measured comparison and the target it is held to."""

    name: str
    target: str
    figures: dict[str, str]
    ratio: float
    met: bool


def rate(fn: Callable[[], object], *, seconds: float = 0.5, min_calls: int = 5) -> float:
    """Calls per second of `fn`, measured over at least `seconds`."""
    fn()  # warm up caches and lazy imports outside the timed window
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and calls >= min_calls:
            return calls / elapsed


def percentile(samples: list[float], pct: float) -> float:
    """The `pct` percentile (0-100) of `samples`, nearest-rank."""
    ordered = sorted(samples)
    index = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def median(samples: list[float]) -> float:
    return statistics.median(samples)
