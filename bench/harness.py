"""The small harness every benchmark uses.

A benchmark module is `bench/bench_<topic>.py` with a `run() -> list[Finding]`.
Each finding compares two measurements taken side by side in the same run, so
the figure that matters is a ratio, never an absolute time alone.
"""

from __future__ import annotations

import dataclasses
import http.client
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


class KeepAliveClient:
    """One keep-alive HTTP/1.1 connection to a daemon on loopback. Each call's timeout
    comes from `timeout(what)` (a run's deadline, say); a failure names `label`."""

    def __init__(
        self,
        port: int,
        *,
        label: str = "daemon",
        timeout: Callable[[str], float] = lambda _what: 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        self._label, self._timeout = label, timeout
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout("connect"))

    @classmethod
    def to(cls, url: str) -> KeepAliveClient:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(int(port), host=host)

    def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        expect: int = 200,
    ) -> bytes:
        timeout = self._timeout(f"{method} {path}")
        self._conn.timeout = timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        try:
            self._conn.request(method, path, body=body, headers=headers or {})
            reply = self._conn.getresponse()
            data = reply.read()
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise RuntimeError(f"{self._label}: {method} {path}: {e!r}") from e
        if reply.status != expect:
            raise RuntimeError(f"{self._label}: {method} {path}: {reply.status} {data[:300]!r}")
        return data

    def timed(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> float:
        """Seconds one call took, its answer checked."""
        start = time.perf_counter()
        self.call(method, path, body=body, headers=headers)
        return time.perf_counter() - start

    def close(self) -> None:
        self._conn.close()
