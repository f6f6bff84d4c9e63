"""The cap on simulated VRAM: a share of host memory, lanes scaled by one factor."""

from __future__ import annotations

from machine.inventory import MemoryInfo
from machine.sim_vram import cap_vram, vram_limit

GiB = 1 << 30
MiB = 1 << 20
WORKSTATION = (24 * GiB, 6 * GiB, 6 * GiB, 12 * GiB)  # the built-in sim file's lanes


def memory(capacity: int, available: int) -> MemoryInfo:
    return MemoryInfo(total_bytes=64 * GiB, available_bytes=available, capacity_bytes=capacity)


def test_limit_is_half_of_host_memory_and_at_most_what_is_available() -> None:
    assert vram_limit(memory(32 * GiB, 20 * GiB)) == 16 * GiB  # capacity: a cgroup limit
    assert vram_limit(memory(32 * GiB, 30 * GiB)) == 16 * GiB  # the page cache moves nothing
    assert vram_limit(memory(32 * GiB, 6 * GiB)) == 6 * GiB  # a host already short
    assert vram_limit(memory(32 * GiB, 0)) == 0


def test_lanes_scaled_to_fit_the_limit() -> None:
    granted = cap_vram(WORKSTATION, 12 * GiB)
    assert granted == (6 * GiB, 1536 * MiB, 1536 * MiB, 3 * GiB)
    assert cap_vram(WORKSTATION, 12 * GiB) == granted  # same input, same sizes
    odd = cap_vram(WORKSTATION, 10 * GiB + 12345)
    assert sum(odd) <= 10 * GiB + 12345
    assert all(size % MiB == 0 for size in odd)


def test_lanes_within_the_limit_unchanged() -> None:
    assert cap_vram(WORKSTATION, 48 * GiB) == WORKSTATION
    assert cap_vram((), 0) == ()


def test_no_limit_left_grants_nothing() -> None:
    assert cap_vram(WORKSTATION, 0) == (0, 0, 0, 0)
