"""Simulated VRAM is host memory: how much of it simulated lanes may promise.

The lane hosts of simulated devices keep their buffers in NumPy arrays, so
each byte of simulated VRAM a lane promises is a byte of this host's RAM,
whatever the sim file declares. Discovery fixes a limit once, from the host's
memory as it reads it then; `build_lanes` scales the lanes' VRAM down to it.
Real (NVML) devices hold their own memory and are never capped.
"""

from __future__ import annotations

from collections.abc import Sequence

from machine.inventory import MemoryInfo

__all__ = ["SHARE", "cap_vram", "vram_limit"]

# Simulated VRAM and the RAM invocations reserve come out of the same host
# memory, yet the ledger counts them apart: at most half of it goes to simulated
# VRAM, the rest stays for invocations, lane hosts and the node itself.
SHARE = (1, 2)
_MIB = 1 << 20


def vram_limit(memory: MemoryInfo) -> int:
    """The most host memory all simulated lanes together may hold as VRAM: SHARE of the
    host's memory (its cgroup limit when lower), and never more than is available now.
    The share is of capacity, not of what is available, so that a restart finds the
    same lane sizes (they do not move with the page cache) unless the host is short."""
    numerator, denominator = SHARE
    share = max(0, memory.capacity_bytes) * numerator // denominator
    return max(0, min(share, memory.available_bytes))


def cap_vram(declared: Sequence[int], limit: int) -> tuple[int, ...]:
    """Each lane's VRAM scaled by one factor so that together they fit in `limit`
    (unchanged when they already fit), rounded down to whole MiB; integers only,
    so the same input always gives the same sizes."""
    total = sum(declared)
    if total <= limit:
        return tuple(declared)
    return tuple(size * limit // total // _MIB * _MIB for size in declared)
