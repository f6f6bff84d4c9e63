"""The lane host: what the process boundary costs.

Measured side by side in one run, over several rounds:

- the owner -> host round trip of a `noop` Run (frame out, decode, dispatch,
  frame back, over two pipes) against a bare in-process call of the same
  kernel, and against a bare round trip of the same bytes over two pipes to a
  Python echo process (blocking reads and writes, no framing or decoding);
- Write and Read throughput of 16 MiB through the host against a bare NumPy
  copy of the same bytes into (and out of) a buffer in this process.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np
import trio

from bench.harness import Finding
from lanehost.kernels import BUILTIN_KERNELS
from supervisor.lane_host import LaneHost

ROUNDS = 5
CALLS = 2000  # noop round trips per round
CHUNK = 16 << 20  # bytes per Write / Read
TRANSFERS = 8  # per round


def _median_seconds(samples: list[float]) -> float:
    return statistics.median(samples)


async def _timed(fn: Callable[[], Awaitable[object]], n: int) -> float:
    """Seconds per call of `fn`, over n calls."""
    await fn()  # warm up
    start = time.perf_counter()
    for _ in range(n):
        await fn()
    return (time.perf_counter() - start) / n


def _timed_sync(fn: Callable[[], object], n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


async def _measure() -> dict[str, list[float]]:
    names = ("noop_host", "noop_bare", "echo", "write_host", "write_bare", "read_host", "read_bare")
    samples: dict[str, list[float]] = {k: [] for k in names}
    data = np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    local = np.zeros(CHUNK, dtype=np.uint8)

    def bare_write() -> None:
        local[:] = np.frombuffer(data, np.uint8)

    noop = BUILTIN_KERNELS["noop"]
    async with LaneHost("lane_bench", CHUNK, backend="numpy") as host:
        await host.alloc("buf", "uint8", (CHUNK,))
        for _ in range(ROUNDS):
            samples["noop_host"].append(await _timed(lambda: host.run("noop"), CALLS))
            samples["noop_bare"].append(_timed_sync(lambda: noop(np, {}, {}), CALLS * 10))
            samples["echo"].append(_echo_round_trip(CALLS))
            samples["write_host"].append(
                await _timed(lambda: host.write("buf", 0, data), TRANSFERS)
            )
            samples["write_bare"].append(_timed_sync(bare_write, TRANSFERS))
            samples["read_host"].append(await _timed(lambda: host.read("buf", 0, CHUNK), TRANSFERS))
            samples["read_bare"].append(_timed_sync(local.tobytes, TRANSFERS))
    return samples


ECHO = "import os\nwhile chunk := os.read(0, 4096):\n    os.write(1, chunk)\n"
NOOP_FRAME = bytes(30)  # about the size of a noop Run frame and its reply


def _echo_round_trip(n: int) -> float:
    """Seconds per round trip of NOOP_FRAME through a bare Python echo process."""
    with subprocess.Popen(
        [sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as echo:
        assert echo.stdin is not None and echo.stdout is not None
        to_echo, from_echo = echo.stdin.fileno(), echo.stdout.fileno()

        def once() -> None:
            os.write(to_echo, NOOP_FRAME)
            got = 0
            while got < len(NOOP_FRAME):
                got += len(os.read(from_echo, len(NOOP_FRAME) - got))

        seconds = _timed_sync(once, n)
        echo.stdin.close()
    return seconds


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def _gbps(seconds: float) -> str:
    return f"{CHUNK / seconds / 1e9:,.2f} GB/s"


def run() -> list[Finding]:
    samples = trio.run(_measure)
    m = {k: _median_seconds(v) for k, v in samples.items()}
    noop_ratio = m["noop_host"] / m["noop_bare"]
    echo_ratio = m["noop_host"] / m["echo"]
    write_ratio = m["write_bare"] / m["write_host"]
    read_ratio = m["read_bare"] / m["read_host"]
    return [
        Finding(
            name="noop Run round trip to the host vs a bare in-process call",
            target="none: the ratio is what the process boundary costs, in bare calls",
            figures={"host": _us(m["noop_host"]), "bare": _us(m["noop_bare"])},
            ratio=noop_ratio,
            met=True,
        ),
        Finding(
            name="noop Run round trip vs a bare pipe echo of the same bytes",
            target="<= 3x the bare echo (framing, msgpack, dispatch and trio together)",
            figures={"host": _us(m["noop_host"]), "bare echo": _us(m["echo"])},
            ratio=echo_ratio,
            met=echo_ratio <= 3.0,
        ),
        Finding(
            name="16 MiB Write through the host vs a bare NumPy copy",
            target=">= 0.10x the bare copy's throughput",
            figures={"host": _gbps(m["write_host"]), "bare": _gbps(m["write_bare"])},
            ratio=write_ratio,
            met=write_ratio >= 0.10,
        ),
        Finding(
            name="16 MiB Read through the host vs a bare NumPy copy",
            target=">= 0.10x the bare copy's throughput",
            figures={"host": _gbps(m["read_host"]), "bare": _gbps(m["read_bare"])},
            ratio=read_ratio,
            met=read_ratio >= 0.10,
        ),
    ]


if __name__ == "__main__":
    for finding in run():
        print(finding)
